//! One replica of the route table (beside the request path, between the prober and the pick):
//! a node's liveness, load and reported models, and the feedback that takes it out of the
//! rotation or brings it back.
//!
//! [`crate::probe`] records each `/v1/status` answer (or its absence) through
//! [`RouteTable::probed`] and [`RouteTable::probe_missed`]; [`crate::proxy`] reports refused
//! connections and 503s with [`RouteTable::connect_failed`] and [`RouteTable::back_off`]. The
//! pick ([`super::pick`]) reads what these leave: a replica is a candidate only while the
//! discovery source and the prober both say it is up and it is not backing off.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::http::HeaderValue;
use gantry_api::{AdapterState, LoadState};

use super::RouteTable;

/// Probes in a row without an answer (timeouts) before a replica leaves the rotation.
pub const PROBE_MISSES_DOWN: u32 = 3;

/// One node pod (or node process) serving a model.
#[derive(Debug)]
pub struct Replica {
    /// Base URL without a trailing slash.
    pub url: String,
    /// The discovery source's readiness (EndpointSlice condition; always true for a static file).
    pub(super) source_ready: AtomicBool,
    /// The prober's verdict: the last `/v1/status` said ready and not draining.
    up: AtomicBool,
    /// Requests this gateway has sent and not yet finished (body fully relayed or dropped).
    pub(super) outstanding: AtomicU64,
    /// Waiting requests the node last reported.
    waiting: AtomicU64,
    /// Bytes a new model could take on the node before its memory watermark, as it last
    /// reported (`u64::MAX`: no limit; 0: unknown or full).
    room: AtomicU64,
    /// Probes in a row that got no answer in time (reset by any answer).
    probe_misses: AtomicU32,
    /// Skip until then: the node answered 503 with this `Retry-After`, or refused a connection.
    unavailable_until: Mutex<Option<Instant>>,
    /// What the node's last `/v1/status` said about each of its models, by id.
    reported: Mutex<Vec<gantry_api::ModelStatus>>,
    /// Sent as `X-Gantry-Node-Token` on every request and probe (marked sensitive).
    pub(super) node_token: Option<HeaderValue>,
}

impl Replica {
    pub(super) fn new(
        url: String,
        source_ready: bool,
        up: bool,
        node_token: Option<HeaderValue>,
    ) -> Self {
        Replica {
            reported: Mutex::new(Vec::new()),
            node_token,
            url,
            source_ready: AtomicBool::new(source_ready),
            up: AtomicBool::new(up),
            outstanding: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            room: AtomicU64::new(0),
            probe_misses: AtomicU32::new(0),
            unavailable_until: Mutex::new(None),
        }
    }

    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// The node's last report on model `id`, if it listed one.
    pub fn reported(&self, id: &str) -> Option<gantry_api::ModelStatus> {
        self.reported
            .lock()
            .ok()
            .and_then(|r| r.iter().find(|m| m.id == id).cloned())
    }

    /// The node's last report on the adapter served as `adapter` of model `model`.
    pub fn adapter(&self, model: &str, adapter: &str) -> Option<gantry_api::AdapterStatus> {
        self.reported.lock().ok().and_then(|r| {
            r.iter()
                .find(|m| m.id == model)?
                .adapters
                .iter()
                .find(|a| a.id == adapter)
                .cloned()
        })
    }

    /// Whether the node's last report lists `adapter` among model `model`'s adapters.
    pub(super) fn lists_adapter(&self, model: &str, adapter: &str) -> bool {
        self.adapter_state(model, adapter).is_some()
    }

    /// The adapter's state in the node's last report, if it lists it.
    pub(super) fn adapter_state(&self, model: &str, adapter: &str) -> Option<AdapterState> {
        self.adapter(model, adapter).map(|a| a.state)
    }

    /// The ids of model `model`'s adapters in the node's last report, in its order.
    pub(super) fn adapter_ids(&self, model: &str) -> Vec<String> {
        self.reported
            .lock()
            .ok()
            .and_then(|r| {
                let m = r.iter().find(|m| m.id == model)?;
                Some(m.adapters.iter().map(|a| a.id.clone()).collect())
            })
            .unwrap_or_default()
    }

    /// The value of `X-Gantry-Node-Token` for this node, if it requires one.
    pub fn node_token(&self) -> Option<&HeaderValue> {
        self.node_token.as_ref()
    }

    pub(super) fn usable(&self, now: Instant) -> bool {
        self.source_ready.load(Ordering::Relaxed)
            && self.up.load(Ordering::Relaxed)
            && self
                .unavailable_until
                .lock()
                .map(|u| u.is_none_or(|t| t <= now))
                .unwrap_or(true)
    }

    pub(super) fn load(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed) + self.waiting.load(Ordering::Relaxed)
    }

    /// Whether the node's last report lists model `id` at all (loaded or not).
    pub(super) fn lists(&self, id: &str) -> bool {
        self.reported
            .lock()
            .map(|r| r.iter().any(|m| m.id == id))
            .unwrap_or(false)
    }

    pub(super) fn room(&self) -> u64 {
        self.room.load(Ordering::Relaxed)
    }

    /// Whether the node's last report says model `id` is loaded (a cold replica of a pool
    /// would load it first). A replica that never reported counts as cold.
    pub(super) fn has_loaded(&self, id: &str) -> bool {
        self.reported
            .lock()
            .map(|r| {
                r.iter()
                    .any(|m| m.id == id && m.load.state == LoadState::Loaded)
            })
            .unwrap_or(false)
    }
}

impl RouteTable {
    /// Record a probe result. Wakes held requests when a replica comes up.
    pub fn probed(
        &self,
        replica: &Replica,
        up: bool,
        waiting: u64,
        models: Vec<gantry_api::ModelStatus>,
        room: u64,
    ) {
        if let Ok(mut r) = replica.reported.lock() {
            *r = models;
        }
        replica.probe_misses.store(0, Ordering::Relaxed);
        replica.waiting.store(waiting, Ordering::Relaxed);
        replica.room.store(room, Ordering::Relaxed);
        let was = replica.up.swap(up, Ordering::Relaxed);
        if up && !was {
            self.notify();
        }
    }

    /// A probe got no answer in time. A node busy generating can be slow to answer one status
    /// call, so the replica keeps its place until [`PROBE_MISSES_DOWN`] misses in a row; a
    /// refused connection (here or on the request path) takes it out at once.
    pub fn probe_missed(&self, replica: &Replica) {
        let misses = replica.probe_misses.fetch_add(1, Ordering::Relaxed) + 1;
        if misses >= PROBE_MISSES_DOWN {
            replica.up.store(false, Ordering::Relaxed);
        }
    }

    /// The node refused a connection: skip it until the prober sees it up again.
    pub fn connect_failed(&self, replica: &Replica) {
        replica.up.store(false, Ordering::Relaxed);
    }

    /// The node answered 503 with `Retry-After: after`: skip it that long.
    pub fn back_off(&self, replica: &Replica, after: Duration) {
        if let Ok(mut u) = replica.unavailable_until.lock() {
            *u = Some(Instant::now() + after);
        }
    }
}
