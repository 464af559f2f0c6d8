//! Replica prober (beside the request path, feeding the least-loaded pick): polls every node's
//! `/v1/status` about once a second for readiness, queue depth, the models each node has loaded
//! and its memory room.
//!
//! One call gives both: `ready` is the node's `/readyz` answer and `models[].queue.waiting` the
//! same figure as its `gantry_num_requests_waiting` gauge. A replica that fails the probe, is
//! draining or is not ready is skipped by the pick until a later probe says otherwise.

use std::sync::Arc;
use std::time::Duration;

use gantry_api::node_token::NODE_TOKEN_HEADER;
use gantry_api::{NODE_STATUS_PATH, NodeStatus};

use crate::route_table::{Replica, RouteTable};

/// What one status call said.
enum Probe {
    /// An answer: ready (and not draining), and the waiting requests of its models.
    Answer {
        up: bool,
        waiting: u64,
        models: Vec<gantry_api::ModelStatus>,
        /// Bytes the node could still load before its memory watermark (0: not reported).
        room: u64,
    },
    /// Nothing listens there: the node is gone.
    Refused,
    /// No usable answer in time (timeout, error status, unreadable body).
    Missed,
}

async fn probe_one(client: &reqwest::Client, replica: &Replica, timeout: Duration) -> Probe {
    let url = format!("{}{NODE_STATUS_PATH}", replica.url);
    let mut req = client.get(url).timeout(timeout);
    if let Some(token) = replica.node_token() {
        req = req.header(NODE_TOKEN_HEADER, token.clone());
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) if e.is_connect() => return Probe::Refused,
        Err(_) => return Probe::Missed,
    };
    if !resp.status().is_success() {
        return Probe::Missed;
    }
    match resp.json::<NodeStatus>().await {
        Ok(s) => Probe::Answer {
            up: s.ready && !s.draining,
            waiting: s.models.iter().map(|m| m.queue.waiting).sum(),
            room: s.memory.as_ref().map_or(0, |m| m.room_bytes()),
            models: s.models,
        },
        Err(_) => Probe::Missed,
    }
}

/// Probe every replica in the table every `every`, forever. Each probe is bounded by `every`
/// (at least 200 ms); a replica leaves the rotation when refused, when it says it is not ready,
/// or after [`crate::route_table::PROBE_MISSES_DOWN`] unanswered probes in a row.
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
        for (r, probe) in replicas.iter().zip(results) {
            match probe {
                Probe::Answer {
                    up,
                    waiting,
                    models,
                    room,
                } => table.probed(r, up, waiting, models, room),
                Probe::Refused => table.probed(r, false, 0, Vec::new(), 0),
                Probe::Missed => table.probe_missed(r),
            }
        }
    }
}
