//! The built-in autoscaler (beside the reconcile path), observation: what it asks each ready
//! node pod every interval (`GET /v1/status`) — the queue and KV use of the model it scales, or
//! of every model on a pool's pod, and the pod's memory pressure counter.

use std::sync::Arc;

use super::decide::PodLoad;
use crate::node_report::{ModelRef, NodeStatusSource};

/// What one ready pod reported: its load, and (pools) its evictions plus refused loads so far.
#[derive(Clone, Copy, Debug)]
pub(super) struct PodAnswer {
    pub(super) load: PodLoad,
    pub(super) pressure_total: u64,
}

/// Ask every ready pod for its load: of the model `served`, or (a pool, `None`) of every
/// model on it, with its memory pressure counter; `None` for a pod that stays silent.
pub(super) async fn fetch_loads(
    source: Arc<dyn NodeStatusSource>,
    model: (String, String),
    served: Option<String>,
    ips: Vec<String>,
) -> Vec<Option<PodAnswer>> {
    let (namespace, name) = (model.0.as_str(), model.1.as_str());
    futures::future::join_all(ips.iter().map(|ip| {
        let source = source.clone();
        let served = served.as_deref();
        async move {
            let status = source.fetch(ip, ModelRef { namespace, name }).await.ok()?;
            let load = match served {
                Some(served) => {
                    let entry = status.models.iter().find(|m| m.id == served)?;
                    PodLoad::from_queue(&entry.queue)
                }
                None => {
                    let mut sum = gantry_api::QueueStatus::default();
                    for m in &status.models {
                        sum.waiting += m.queue.waiting;
                        sum.running += m.queue.running;
                        sum.kv_used_tokens += m.queue.kv_used_tokens;
                        sum.kv_capacity_tokens += m.queue.kv_capacity_tokens;
                    }
                    PodLoad::from_queue(&sum)
                }
            };
            Some(PodAnswer {
                load: load.with_devices(&status.devices),
                pressure_total: pressure_total(&status),
            })
        }
    }))
    .await
}

/// Models evicted plus loads refused since the node started, from its memory status.
fn pressure_total(status: &gantry_api::NodeStatus) -> u64 {
    status
        .memory
        .as_ref()
        .map_or(0, |m| m.evictions_total.saturating_add(m.refusals_total))
}
