//! Replica prober (beside the request path, feeding the least-loaded pick): polls every node's
//! `/v1/status` about once a second for readiness and queue depth.
//!
//! One call gives both: `ready` is the node's `/readyz` answer and `models[].queue.waiting` the
//! same figure as its `gantry_num_requests_waiting` gauge. A replica that fails the probe, is
//! draining or is not ready is skipped by the pick until a later probe says otherwise.

use std::sync::Arc;
use std::time::Duration;

use gantry_api::{NODE_STATUS_PATH, NodeStatus};

use crate::gateway::routes::{Replica, RouteTable};

async fn probe_one(client: &reqwest::Client, replica: &Replica, timeout: Duration) -> (bool, u64) {
    let url = format!("{}{NODE_STATUS_PATH}", replica.url);
    let answer = async {
        let resp = client.get(url).timeout(timeout).send().await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.json::<NodeStatus>().await.ok()
    }
    .await;
    match answer {
        Some(s) => (
            s.ready && !s.draining,
            s.models.iter().map(|m| m.queue.waiting).sum(),
        ),
        None => (false, 0),
    }
}

/// Probe every replica in the table every `every`, forever. Each probe is bounded by `every`.
pub async fn run(table: Arc<RouteTable>, client: reqwest::Client, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let replicas = table.replicas();
        let results = futures::future::join_all(
            replicas
                .iter()
                .map(|r| probe_one(&client, r, every.max(Duration::from_millis(200)))),
        )
        .await;
        for (r, (up, waiting)) in replicas.iter().zip(results) {
            table.probed(r, up, waiting);
        }
    }
}
