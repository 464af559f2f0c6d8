//! ModelPool reconcile, shared by its steps and by a pool member's reconcile: the controller's
//! name in metrics and logs, and how often a pool (and each member) is looked at again.

use std::time::Duration;

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "modelpool";

/// How often a pool with members (and each member) is looked at again when nothing happens:
/// the pool's status lists what each pod has loaded, which changes with traffic.
pub const RESYNC: Duration = Duration::from_secs(30);
