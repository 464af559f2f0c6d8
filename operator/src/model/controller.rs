//! Model reconcile, shared by every step of the pipeline (`model::reconcile` and the apply,
//! deliver and status steps that write): the controller's name in metrics and logs, and when a
//! Model with pods is looked at again if nothing happens (the resync, also the EnginePlugin
//! reconcile's).

use std::time::Duration;

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "model";

/// The safety-net resync of a Model with pods (and of an EnginePlugin), spread by up to +20 %
/// per object (see [`resync`]). Everything that changes a Model's outcome arrives otherwise: its own edits and
/// its owned objects and node pods through watches, node reports through the report poller,
/// so this only catches a missed event.
pub const RESYNC: Duration = Duration::from_secs(600);

/// When to look at a Model with pods (or an EnginePlugin) again if nothing happens: [`RESYNC`]
/// stretched by a factor in [1.0, 1.2) taken from its uid, so objects created together do not
/// resync together.
pub fn resync(uid: &str) -> Duration {
    RESYNC.mul_f64(crate::report_cache::stretch(uid))
}
