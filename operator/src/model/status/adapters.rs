//! Model reconcile, status step (pure part): `status.adapters`, one entry per `spec.adapters`
//! entry in spec order, from what the node pods on the current config report about each
//! adapter (`models[].adapters` of `/v1/status`).
//!
//! A ready pod is one that reports the base model loaded: it serves requests, and only there
//! does an adapter's load (or refusal by the engine) mean anything. The state is `Refused` when
//! a ready pod refused the adapter (its reason and words, naming the pod), else `Loaded` when a
//! ready pod has it loaded, else `Downloaded` when any pod has its files, else `Pending`. Like
//! the rest of the status, nothing here changes unless a report does.

use gantry_api::{AdapterState as NodeState, LoadState};

use super::facts::Facts;
use crate::node_report::NodeReport;
use gantry_crd::{AdapterState, AdapterStatus};

/// Every adapter of the Model, as the reports of its current pods say.
pub(super) fn fold_adapters(f: &Facts<'_>) -> Vec<AdapterStatus> {
    if f.valid.adapters.is_empty() {
        return Vec::new();
    }
    let entries: Vec<(&NodeReport, &gantry_api::ModelStatus)> = f
        .reports
        .iter()
        .filter_map(|r| Some((*r, r.model(&f.valid.served_name)?)))
        .collect();
    let ready: Vec<&(&NodeReport, &gantry_api::ModelStatus)> = entries
        .iter()
        .filter(|(_, m)| m.load.state == LoadState::Loaded)
        .collect();
    let ready_replicas = count(ready.len());
    f.valid
        .adapters
        .iter()
        .map(|a| {
            let on = |m: &gantry_api::ModelStatus| -> Option<NodeState> {
                m.adapters
                    .iter()
                    .find(|s| s.name == a.name)
                    .map(|s| s.state)
            };
            let refusal = ready.iter().find_map(|(r, m)| {
                let s = m.adapters.iter().find(|s| s.name == a.name)?;
                (s.state == NodeState::Refused).then_some((r, s))
            });
            let loaded = ready
                .iter()
                .filter(|(_, m)| on(m) == Some(NodeState::Loaded))
                .count();
            let downloaded = entries
                .iter()
                .any(|(_, m)| matches!(on(m), Some(NodeState::Downloaded | NodeState::Loaded)));
            let (state, reason, message) = match refusal {
                Some((r, s)) => (
                    AdapterState::Refused,
                    s.reason.clone(),
                    Some(format!(
                        "node pod {}: {}",
                        r.pod,
                        s.message.as_deref().unwrap_or("refused the adapter")
                    )),
                ),
                None if loaded > 0 => (AdapterState::Loaded, None, None),
                None if downloaded => (AdapterState::Downloaded, None, None),
                None => (AdapterState::Pending, None, None),
            };
            AdapterStatus {
                name: a.name.clone(),
                id: a.id.clone(),
                state,
                reason,
                message,
                loaded_replicas: count(loaded),
                ready_replicas,
            }
        })
        .collect()
}

fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}
