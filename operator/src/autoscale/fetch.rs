//! The built-in autoscaler (beside the reconcile path), observation: what it reads of each
//! ready node pod every interval — the queue and KV use of the model it scales, or of every
//! model on a pool's pod, and the pod's memory pressure counter — from the node report cache,
//! which asks the pod (`GET /v1/status`) when its answer is older than one interval.

use std::sync::Arc;
use std::time::Duration;

use super::decide::PodLoad;
use crate::node_report::{NodeStatusSource, PodFacts};
use crate::report_cache::Reports;

/// What one ready pod reported: its load, and (pools) its evictions plus refused loads so far.
#[derive(Clone, Copy, Debug)]
pub(super) struct PodAnswer {
    pub(super) load: PodLoad,
    pub(super) pressure_total: u64,
}

/// Every ready pod's load, at most `max_age` old and newer than the answer read last time
/// (each pod with that answer's number): of the model `served`, or (a pool, `None`) of every
/// model on it, with its memory pressure counter and the number of the answer read; `None` for
/// a pod that stays silent.
pub(super) async fn fetch_loads(
    reports: Arc<Reports>,
    source: Arc<dyn NodeStatusSource>,
    served: Option<String>,
    pods: Vec<(PodFacts, u64)>,
    max_age: Duration,
) -> Vec<Option<(u64, PodAnswer)>> {
    futures::future::join_all(pods.iter().map(|(f, after)| {
        let (reports, source) = (reports.clone(), source.clone());
        let served = served.as_deref();
        async move {
            let read = |status: &gantry_api::NodeStatus| {
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
                    pressure_total: pressure_total(status),
                })
            };
            let (seq, answer) = reports
                .recent(source.as_ref(), f, max_age, *after, read)
                .await?;
            Some((seq, answer?))
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
