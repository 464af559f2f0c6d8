//! The routing table (between discovery and every proxied request): which replicas serve each
//! model id, how loaded each one is, and the pick: by routing key with bounded load
//! ([`crate::affinity`]), else the least-loaded replica, preferring those that report the model
//! loaded.
//!
//! Discovery sources (static file or kube reflectors) hand over whole snapshots with
//! [`RouteTable::replace`]; replicas are kept by base URL across snapshots so their counters
//! survive. The prober updates each replica's liveness and queue depth; every change wakes the
//! requests held for a model with no ready replica.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::http::HeaderValue;
use gantry_api::LoadState;
use gantry_api::node_token::ModelToken;

use crate::affinity::{Bound, KeyKind, Ring, RouteKey};
use crate::placement::{Placements, model_hash};
use tokio::sync::watch;

/// Which Deployment to scale up for a model (kube source); `None` for static endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ScaleTarget {
    pub namespace: String,
    pub deployment: String,
}

/// One model as a discovery source sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// The OpenAI model id (`spec.servedName` or the Model name).
    pub id: String,
    /// Node base URLs (`http://host:port`) and whether the source says each is ready.
    pub endpoints: Vec<(String, bool)>,
    /// `replicas.min`: 0 means requests are held while a first replica starts.
    pub min_replicas: i32,
    /// `replicas.max`.
    pub max_replicas: i32,
    /// The Model cannot serve (invalid spec, no engine, download failed): refused, not held.
    pub failed: bool,
    pub target: Option<ScaleTarget>,
    /// Unix seconds the model appeared (the Model's creation time; the file's load time for
    /// a static endpoints file): `created` in `/v1/models`.
    pub created: u64,
    /// The token the Model's node pods require (`X-Gantry-Node-Token`); `None`: the table's
    /// default (the install token, for static endpoints) or none at all.
    pub node_token: Option<ModelToken>,
}

/// One node pod (or node process) serving a model.
/// Probes in a row without an answer (timeouts) before a replica leaves the rotation.
pub const PROBE_MISSES_DOWN: u32 = 3;

#[derive(Debug)]
pub struct Replica {
    /// Base URL without a trailing slash.
    pub url: String,
    /// The discovery source's readiness (EndpointSlice condition; always true for a static file).
    source_ready: AtomicBool,
    /// The prober's verdict: the last `/v1/status` said ready and not draining.
    up: AtomicBool,
    /// Requests this gateway has sent and not yet finished (body fully relayed or dropped).
    outstanding: AtomicU64,
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
    node_token: Option<HeaderValue>,
}

impl Replica {
    fn new(url: String, source_ready: bool, up: bool, node_token: Option<HeaderValue>) -> Self {
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

    /// The value of `X-Gantry-Node-Token` for this node, if it requires one.
    pub fn node_token(&self) -> Option<&HeaderValue> {
        self.node_token.as_ref()
    }

    fn usable(&self, now: Instant) -> bool {
        self.source_ready.load(Ordering::Relaxed)
            && self.up.load(Ordering::Relaxed)
            && self
                .unavailable_until
                .lock()
                .map(|u| u.is_none_or(|t| t <= now))
                .unwrap_or(true)
    }

    fn load(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed) + self.waiting.load(Ordering::Relaxed)
    }

    /// Whether the node's last report lists model `id` at all (loaded or not).
    fn lists(&self, id: &str) -> bool {
        self.reported
            .lock()
            .map(|r| r.iter().any(|m| m.id == id))
            .unwrap_or(false)
    }

    fn room(&self) -> u64 {
        self.room.load(Ordering::Relaxed)
    }

    /// Whether the node's last report says model `id` is loaded (a cold replica of a pool
    /// would load it first). A replica that never reported counts as cold.
    fn has_loaded(&self, id: &str) -> bool {
        self.reported
            .lock()
            .map(|r| {
                r.iter()
                    .any(|m| m.id == id && m.load.state == LoadState::Loaded)
            })
            .unwrap_or(false)
    }
}

/// Which rule placed a request (the `rule` label of `gantry_gateway_routed_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Its session header's replica.
    Session,
    /// Its prompt prefix's replica (or the next one on the ring within the load bound).
    Prefix,
    /// No key, or its replicas are all over the load bound: least load.
    LeastLoad,
    /// No replica has the model loaded (a pool's cold model): the one with the most room.
    Cold,
}

impl Rule {
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Session => "session",
            Rule::Prefix => "prefix",
            Rule::LeastLoad => "least_load",
            Rule::Cold => "cold",
        }
    }
}

/// A replica picked for one request: counts as outstanding until dropped.
#[derive(Debug)]
pub struct Lease {
    pub replica: Arc<Replica>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.replica.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A model's routing entry.
#[derive(Debug)]
pub struct ModelRoute {
    pub spec: ModelSpec,
    pub replicas: Vec<Arc<Replica>>,
    /// The replicas' points on the hash ring (indices into `replicas`).
    pub ring: Ring,
    /// The model id's hash, under which its keys' placements are kept.
    pub model_hash: u64,
}

impl ModelRoute {
    /// Listed by `/v1/models`: not failed, and a replica is ready now or one can be scaled up
    /// from zero (`replicas.min == 0`, `replicas.max > 0`).
    pub fn listable(&self) -> bool {
        !self.spec.failed
            && (self.replicas.iter().any(|r| r.usable(Instant::now()))
                || self.spec.min_replicas == 0 && self.spec.max_replicas > 0)
    }
}

/// Why no replica could be picked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoReplica {
    /// No replica is usable now; one may come (scale up, start, recover).
    NoneReady,
    /// The Model is marked failed.
    Failed,
}

/// All models, swapped whole on every discovery snapshot.
#[derive(Debug)]
pub struct RouteTable {
    models: RwLock<Arc<HashMap<String, Arc<ModelRoute>>>>,
    /// New replicas start up (kube: trust the EndpointSlice) or down until probed (static file).
    trust_source: bool,
    /// Bumped on every change that may make a replica usable.
    changed: watch::Sender<u64>,
    /// Rotates the starting point among equally loaded replicas.
    rotor: AtomicUsize,
    synced: AtomicBool,
    /// Node token for models whose spec names none (static endpoints: the install token).
    default_node_token: Option<ModelToken>,
    /// Where each routing key went last; kept across snapshots.
    placements: Mutex<Placements>,
}

/// A token as a sensitive header value; a token that is not a valid header value is dropped
/// (install tokens are checked to be visible ASCII, derived ones are hex).
fn token_header(token: &ModelToken) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_str(token.as_str()).ok()?;
    v.set_sensitive(true);
    Some(v)
}

impl RouteTable {
    pub fn new(trust_source: bool) -> Self {
        RouteTable {
            default_node_token: None,
            models: RwLock::new(Arc::new(HashMap::new())),
            trust_source,
            changed: watch::Sender::new(0),
            rotor: AtomicUsize::new(0),
            synced: AtomicBool::new(false),
            placements: Mutex::new(Placements::new(crate::placement::DEFAULT_PLACEMENT_TTL)),
        }
    }

    /// Forget a key's placement `ttl` after its last request (`--placement-ttl-seconds`).
    pub fn with_placement_ttl(mut self, ttl: Duration) -> Self {
        self.placements = Mutex::new(Placements::new(ttl));
        self
    }

    /// Placements held now (live or not yet swept), for the gauge.
    pub fn placements(&self) -> usize {
        self.placements.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// Send `token` to the nodes of every model whose spec names no token of its own.
    pub fn with_default_node_token(mut self, token: Option<ModelToken>) -> Self {
        self.default_node_token = token;
        self
    }

    /// A snapshot of every model.
    pub fn snapshot(&self) -> Arc<HashMap<String, Arc<ModelRoute>>> {
        self.models
            .read()
            .map(|m| m.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    pub fn get(&self, id: &str) -> Option<Arc<ModelRoute>> {
        self.snapshot().get(id).cloned()
    }

    /// True once a source has delivered its first complete snapshot (`/readyz`).
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }

    /// Replace every model with `specs`, keeping known replicas (by URL) and their counters.
    pub fn replace(&self, specs: Vec<ModelSpec>) {
        let old = self.snapshot();
        // One Replica per URL, shared by every model it serves, so that it is probed once and
        // its outstanding count covers all its models.
        let mut known: HashMap<String, Arc<Replica>> = old
            .values()
            .flat_map(|m| m.replicas.iter())
            .map(|r| (r.url.clone(), Arc::clone(r)))
            .collect();
        let mut next = HashMap::with_capacity(specs.len());
        for spec in specs {
            let token = spec
                .node_token
                .as_ref()
                .or(self.default_node_token.as_ref())
                .and_then(token_header);
            let replicas: Vec<Arc<Replica>> = spec
                .endpoints
                .iter()
                .map(|(url, ready)| {
                    // A URL now serving with another token is another node (a pod IP reused by
                    // another Model's pod): it starts afresh.
                    let r = match known.get(url) {
                        Some(r) if r.node_token == token => Arc::clone(r),
                        _ => {
                            let r = Arc::new(Replica::new(
                                url.clone(),
                                *ready,
                                self.trust_source,
                                token.clone(),
                            ));
                            known.insert(url.clone(), Arc::clone(&r));
                            r
                        }
                    };
                    r.source_ready.store(*ready, Ordering::Relaxed);
                    r
                })
                .collect();
            if next.contains_key(&spec.id) {
                tracing::warn!(model = %spec.id, "two Models serve the same id; the first one listed wins");
                continue;
            }
            let ring = Ring::new(replicas.iter().map(|r| r.url.as_str()));
            next.insert(
                spec.id.clone(),
                Arc::new(ModelRoute {
                    model_hash: model_hash(&spec.id),
                    spec,
                    replicas,
                    ring,
                }),
            );
        }
        match self.models.write() {
            Ok(mut m) => *m = Arc::new(next),
            Err(e) => *e.into_inner() = Arc::new(next),
        }
        self.synced.store(true, Ordering::Relaxed);
        self.notify();
    }

    /// Every distinct replica, for the prober.
    pub fn replicas(&self) -> Vec<Arc<Replica>> {
        let mut seen = std::collections::HashSet::new();
        self.snapshot()
            .values()
            .flat_map(|m| m.replicas.iter())
            .filter(|r| seen.insert(r.url.clone()))
            .cloned()
            .collect()
    }

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

    /// A receiver that changes whenever a replica may have become usable.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn notify(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The least-loaded usable replica of `route` not in `exclude` (see [`Self::pick_keyed`]).
    pub fn pick(&self, route: &ModelRoute, exclude: &[String]) -> Result<Lease, NoReplica> {
        let bound = Bound {
            load_factor: 1.0,
            slack: 0,
        };
        self.pick_keyed(route, exclude, None, bound)
            .map(|(lease, _)| lease)
    }

    /// A replica of `route` not in `exclude`, and the rule that chose it. The candidates are
    /// the usable replicas that report the model loaded when any does, else all usable ones.
    /// - With a key:
    ///   1. the replica the key last went to (its placement), unless it is no longer a
    ///      candidate or is over the `bound` ([`Bound::over`]);
    ///   2. else the first candidate clockwise from the key on the ring that is within the
    ///      bound and holds fewer than `ceil((placed keys + 1) / candidates)` of the model's
    ///      other live keys, so new conversations spread evenly;
    ///   3. else the least loaded.
    ///
    ///   The key's placement then moves to the replica picked: it now holds the prompt.
    /// - Otherwise: the least loaded (this gateway's outstanding requests + the node's
    ///   reported waiting requests); ties rotate.
    pub fn pick_keyed(
        &self,
        route: &ModelRoute,
        exclude: &[String],
        key: Option<RouteKey>,
        bound: Bound,
    ) -> Result<(Lease, Rule), NoReplica> {
        if route.spec.failed {
            return Err(NoReplica::Failed);
        }
        let now = Instant::now();
        let n = route.replicas.len();
        let usable: Vec<bool> = route
            .replicas
            .iter()
            .map(|r| r.usable(now) && !exclude.iter().any(|e| *e == r.url))
            .collect();
        let count = usable.iter().filter(|u| **u).count();
        if count == 0 {
            return Err(NoReplica::NoneReady);
        }
        let lease = |r: &Arc<Replica>| {
            r.outstanding.fetch_add(1, Ordering::Relaxed);
            Lease {
                replica: Arc::clone(r),
            }
        };
        let start = if n > 0 {
            self.rotor.fetch_add(1, Ordering::Relaxed) % n
        } else {
            0
        };
        let id = &route.spec.id;
        let warm: Vec<bool> = (0..n)
            .map(|i| usable[i] && route.replicas[i].has_loaded(id))
            .collect();
        let any_warm = warm.iter().any(|w| *w);
        // A model its replicas list but none has loaded (a pool's cold model): it loads where
        // there is the most room; on a tie, the least load, then in turn.
        if !any_warm && (0..n).any(|i| usable[i] && route.replicas[i].lists(id)) {
            let best = (0..n)
                .map(|i| (start + i) % n)
                .filter(|&i| usable[i])
                .map(|i| &route.replicas[i])
                .max_by_key(|r| (r.room(), std::cmp::Reverse(r.load())))
                .ok_or(NoReplica::NoneReady)?;
            return Ok((lease(best), Rule::Cold));
        }
        // The candidates: the replicas that have the model loaded when any has, else all.
        let candidate = |i: usize| if any_warm { warm[i] } else { usable[i] };
        let least_loaded = || {
            (0..n)
                .map(|i| (start + i) % n)
                .filter(|&i| candidate(i))
                .min_by_key(|&i| route.replicas[i].load())
                .ok_or(NoReplica::NoneReady)
        };
        if let Some(key) = key {
            let loads: Vec<u64> = route.replicas.iter().map(|r| r.load()).collect();
            let cands: Vec<usize> = (0..n).filter(|&i| candidate(i)).collect();
            let total: u64 = cands.iter().map(|&i| loads[i]).sum();
            let min = cands.iter().map(|&i| loads[i]).min().unwrap_or(0);
            let within = |i: usize| !bound.over(loads[i], total, min, cands.len());
            let model = route.model_hash;
            let mut placements = self.placements.lock().unwrap_or_else(|e| e.into_inner());
            let placed = placements
                .get(model, key.hash, now)
                .and_then(|url| (0..n).find(|&i| *route.replicas[i].url == *url));
            let kept = placed.filter(|&i| candidate(i) && within(i));
            let (i, rule) = match kept.or_else(|| {
                // This key's own placement does not count against its new replica.
                let keys = |i: usize| {
                    placements
                        .count(model, &route.replicas[i].url)
                        .saturating_sub(usize::from(placed == Some(i)))
                };
                let placed_keys: usize = cands.iter().map(|&i| keys(i)).sum();
                let key_cap = (placed_keys + 1).div_ceil(cands.len().max(1));
                route
                    .ring
                    .walk(key.hash, n)
                    .into_iter()
                    .find(|&i| candidate(i) && within(i) && keys(i) < key_cap)
            }) {
                Some(i) => (
                    i,
                    match key.kind {
                        KeyKind::Session => Rule::Session,
                        KeyKind::Prefix => Rule::Prefix,
                    },
                ),
                None => (least_loaded()?, Rule::LeastLoad),
            };
            placements.place(model, key.hash, &route.replicas[i].url, now);
            return Ok((lease(&route.replicas[i]), rule));
        }
        let i = least_loaded()?;
        Ok((lease(&route.replicas[i]), Rule::LeastLoad))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain bound (no slack), as CHWBL defines it.
    const CHWBL: Bound = Bound {
        load_factor: 1.25,
        slack: 0,
    };
    const EXACT: Bound = Bound {
        load_factor: 1.0,
        slack: 0,
    };

    fn spec(id: &str, urls: &[&str]) -> ModelSpec {
        ModelSpec {
            id: id.into(),
            endpoints: urls.iter().map(|u| (u.to_string(), true)).collect(),
            min_replicas: 1,
            max_replicas: 1,
            failed: false,
            target: None,
            created: 0,
            node_token: None,
        }
    }

    #[test]
    fn pick_prefers_the_replica_with_fewer_outstanding_plus_waiting() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a", "http://b"])]);
        let route = t.get("m").expect("route");
        let first = t.pick(&route, &[]).expect("pick");
        let second = t.pick(&route, &[]).expect("pick");
        assert_ne!(first.replica.url, second.replica.url);
        // b reports a queue: a wins while it has fewer in total.
        let b = route
            .replicas
            .iter()
            .find(|r| r.url == "http://b")
            .expect("b");
        t.probed(b, true, 5, Vec::new(), 0);
        drop(second);
        drop(first);
        for _ in 0..3 {
            let l = t.pick(&route, &[]).expect("pick");
            assert_eq!(l.replica.url, "http://a");
            std::mem::forget(l);
        }
    }

    fn prefix_key(text: &str) -> RouteKey {
        RouteKey {
            hash: crate::affinity::hash64(&[text.as_bytes()]),
            kind: KeyKind::Prefix,
        }
    }

    #[test]
    fn a_key_sticks_to_its_replica_until_that_replica_passes_the_load_bound() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
        let route = t.get("m").expect("route");
        let key = prefix_key("conversation 1");
        let (first, rule) = t.pick_keyed(&route, &[], Some(key), CHWBL).expect("pick");
        assert_eq!(rule, Rule::Prefix);
        let home = first.replica.url.clone();
        drop(first);
        // Sequential requests of one conversation: always home.
        for _ in 0..5 {
            let (l, rule) = t.pick_keyed(&route, &[], Some(key), CHWBL).expect("pick");
            assert_eq!(
                (l.replica.url.as_str(), rule),
                (home.as_str(), Rule::Prefix)
            );
        }
        // Concurrent ones: home takes them while its load is within
        // ceil(1.25 x (total + 1) / 3); past that the next replica on the ring takes over.
        let mut held = Vec::new();
        let mut homes = 0;
        for _ in 0..6 {
            let (l, _) = t.pick_keyed(&route, &[], Some(key), CHWBL).expect("pick");
            homes += usize::from(l.replica.url == home);
            held.push(l);
        }
        let loads: Vec<u64> = route.replicas.iter().map(|r| r.outstanding()).collect();
        assert!(homes >= 2, "home took {homes} of 6");
        assert!(homes < 6, "the bound never spilled: {loads:?}");
        // No replica above 1.25x the mean (rounded up), the point of the bound.
        let cap = crate::affinity::load_cap(6 - 1, 3, 1.25);
        assert!(loads.iter().all(|&l| l <= cap), "{loads:?} past {cap}");
    }

    /// The gateway's default bound: CHWBL's factor with a slack of 3 requests.
    const SLACK3: Bound = Bound {
        load_factor: 1.25,
        slack: 3,
    };

    #[test]
    fn a_conversation_stays_on_its_replica_until_that_one_is_far_busier_then_moves_for_good() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
        let route = t.get("m").expect("route");
        let key = prefix_key("conversation 7");
        let (first, _) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
        let home = first.replica.url.clone();
        // Two more of its requests at once: home is past CHWBL's cap (2 of 3 in flight) but
        // only 2 above the others, so it keeps them.
        let (second, _) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
        let (third, rule) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
        assert_eq!(
            (
                second.replica.url.as_str(),
                third.replica.url.as_str(),
                rule
            ),
            (home.as_str(), home.as_str(), Rule::Prefix)
        );
        // A fourth finds home 3 above an idle replica: it goes elsewhere...
        let (fourth, rule) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
        assert_ne!(fourth.replica.url, home);
        assert_eq!(rule, Rule::Prefix);
        let moved = fourth.replica.url.clone();
        drop((first, second, third, fourth));
        // ...and the conversation stays there once home is idle again: that replica now holds
        // its newest prompt.
        for _ in 0..3 {
            let (l, _) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
            assert_eq!(l.replica.url, moved);
        }
    }

    #[test]
    fn new_conversations_spread_evenly_and_keep_their_replicas_across_snapshots() {
        let t = RouteTable::new(true);
        let urls = ["http://a", "http://b", "http://c"];
        t.replace(vec![spec("m", &urls)]);
        let route = t.get("m").expect("route");
        let keys: Vec<RouteKey> = (0..16)
            .map(|i| prefix_key(&format!("conversation {i}")))
            .collect();
        let mut home = HashMap::new();
        for k in &keys {
            let (l, rule) = t.pick_keyed(&route, &[], Some(*k), SLACK3).expect("pick");
            assert_eq!(rule, Rule::Prefix);
            home.insert(k.hash, l.replica.url.clone());
        }
        let per: Vec<usize> = urls
            .iter()
            .map(|u| home.values().filter(|h| h == u).count())
            .collect();
        // 16 keys on 3 replicas: 6/5/5 in some order, however the ring falls.
        assert_eq!(per.iter().max().copied(), Some(6), "{per:?}");
        assert_eq!(per.iter().min().copied(), Some(5), "{per:?}");
        assert_eq!(t.placements(), 16);
        // A new snapshot with the same replicas keeps every placement.
        t.replace(vec![spec("m", &urls)]);
        let route = t.get("m").expect("route");
        for k in &keys {
            let (l, _) = t.pick_keyed(&route, &[], Some(*k), SLACK3).expect("pick");
            assert_eq!(l.replica.url, home[&k.hash]);
        }
        // A replica gone: its keys move, the others stay.
        t.replace(vec![spec("m", &urls[..2])]);
        let route = t.get("m").expect("route");
        for k in &keys {
            let (l, _) = t.pick_keyed(&route, &[], Some(*k), SLACK3).expect("pick");
            if home[&k.hash] == "http://c" {
                assert_ne!(l.replica.url, "http://c");
            } else {
                assert_eq!(l.replica.url, home[&k.hash]);
            }
        }
    }

    #[test]
    fn a_session_key_stays_on_the_ring_however_deep_the_queues_are() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a", "http://b"])]);
        let route = t.get("m").expect("route");
        // Both report a deep queue: the bound moves with the mean, so the key keeps its home.
        for r in &route.replicas {
            t.probed(r, true, 20, Vec::new(), 0);
        }
        let key = RouteKey {
            hash: 7,
            kind: KeyKind::Session,
        };
        let (l1, rule) = t.pick_keyed(&route, &[], Some(key), EXACT).expect("pick");
        assert_eq!(rule, Rule::Session);
        let home = l1.replica.url.clone();
        drop(l1);
        let (l2, _) = t.pick_keyed(&route, &[], Some(key), EXACT).expect("pick");
        assert_eq!(l2.replica.url, home);
        let (_l, rule) = t.pick_keyed(&route, &[], None, EXACT).expect("pick");
        assert_eq!(rule, Rule::LeastLoad);
    }

    #[test]
    fn least_load_prefers_replicas_that_report_the_model_loaded() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a", "http://b"])]);
        let route = t.get("m").expect("route");
        let b = replica(&route, "http://b");
        // b is warm but busier; a would load the model first.
        t.probed(b, true, 3, vec![listed("m", LoadState::Loaded)], 0);
        for _ in 0..3 {
            let (l, rule) = t.pick_keyed(&route, &[], None, CHWBL).expect("pick");
            assert_eq!(
                (l.replica.url.as_str(), rule),
                ("http://b", Rule::LeastLoad)
            );
        }
    }

    fn listed(id: &str, state: LoadState) -> gantry_api::ModelStatus {
        gantry_api::ModelStatus {
            id: id.into(),
            format: "gguf".into(),
            architecture: None,
            verdict: None,
            artifact: Default::default(),
            load: gantry_api::LoadStatus {
                state,
                ..Default::default()
            },
            queue: Default::default(),
            devices: Vec::new(),
            replicas: Vec::new(),
            crashes: None,
            engine_choice: None,
        }
    }

    fn replica<'a>(route: &'a ModelRoute, url: &str) -> &'a Arc<Replica> {
        route
            .replicas
            .iter()
            .find(|r| r.url == url)
            .expect("replica")
    }

    #[test]
    fn a_model_no_replica_has_loaded_goes_where_there_is_the_most_room() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
        let route = t.get("m").expect("route");
        const GIB: u64 = 1 << 30;
        // A pool's three pods list the model, none has loaded it; b has the most room but the
        // most waiting requests too: room decides, load only breaks ties.
        for (url, room, waiting) in [
            ("http://a", GIB, 0),
            ("http://b", 5 * GIB, 4),
            ("http://c", 3 * GIB, 0),
        ] {
            let r = replica(&route, url);
            t.probed(
                r,
                true,
                waiting,
                vec![listed("m", LoadState::Unloaded)],
                room,
            );
        }
        for key in [None, Some(prefix_key("You are terse."))] {
            let (l, rule) = t.pick_keyed(&route, &[], key, CHWBL).expect("pick");
            assert_eq!((l.replica.url.as_str(), rule), ("http://b", Rule::Cold));
        }
        // Equal room: the least loaded.
        t.probed(
            replica(&route, "http://c"),
            true,
            0,
            vec![listed("m", LoadState::Unloaded)],
            5 * GIB,
        );
        let (l, rule) = t.pick_keyed(&route, &[], None, CHWBL).expect("pick");
        assert_eq!((l.replica.url.as_str(), rule), ("http://c", Rule::Cold));
        // Once one has it loaded, the model stays there, prefix keys included.
        t.probed(
            replica(&route, "http://a"),
            true,
            0,
            vec![listed("m", LoadState::Loaded)],
            0,
        );
        for text in ["one system prompt", "another", "a third"] {
            let (l, rule) = t
                .pick_keyed(&route, &[], Some(prefix_key(text)), CHWBL)
                .expect("pick");
            assert_eq!(
                (l.replica.url.as_str(), rule),
                ("http://a", Rule::Prefix),
                "{text}"
            );
        }
    }

    #[test]
    fn replicas_that_never_reported_keep_prefix_routing_over_all_of_them() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
        let route = t.get("m").expect("route");
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..64 {
            let (l, rule) = t
                .pick_keyed(&route, &[], Some(prefix_key(&format!("prompt {i}"))), CHWBL)
                .expect("pick");
            assert_eq!(rule, Rule::Prefix);
            seen.insert(l.replica.url.clone());
        }
        assert_eq!(
            seen.len(),
            3,
            "64 prefixes spread over every replica: {seen:?}"
        );
    }

    #[test]
    fn a_replica_leaves_the_rotation_only_after_three_missed_probes_in_a_row() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a"])]);
        let route = t.get("m").expect("route");
        let a = &route.replicas[0];
        t.probed(a, true, 0, Vec::new(), 0);
        t.probe_missed(a);
        t.probe_missed(a);
        assert!(a.is_up(), "two slow answers keep a busy node in rotation");
        t.probed(a, true, 0, Vec::new(), 0);
        t.probe_missed(a);
        t.probe_missed(a);
        assert!(a.is_up(), "an answer resets the count");
        t.probe_missed(a);
        assert!(!a.is_up(), "the third miss in a row takes it out");
        assert_eq!(t.pick(&route, &[]).err(), Some(NoReplica::NoneReady));
        t.probed(a, true, 0, Vec::new(), 0);
        assert!(
            t.pick(&route, &[]).is_ok(),
            "the next answer brings it back"
        );
    }

    #[test]
    fn replicas_survive_a_snapshot_with_their_counters() {
        let t = RouteTable::new(true);
        t.replace(vec![spec("m", &["http://a"])]);
        let lease = t.pick(&t.get("m").expect("m"), &[]).expect("pick");
        t.replace(vec![spec("m", &["http://a", "http://b"])]);
        let a = t.get("m").expect("m").replicas[0].clone();
        assert_eq!(a.outstanding(), 1);
        drop(lease);
        assert_eq!(a.outstanding(), 0);
    }

    #[test]
    fn replicas_carry_their_models_token_or_the_default_and_a_new_token_is_a_new_replica() {
        let install: gantry_api::node_token::InstallToken =
            "0123456789abcdef0123456789abcdef".parse().expect("token");
        let t = RouteTable::new(true).with_default_node_token(Some(install.as_node_token()));
        let mut own = spec("own", &["http://a"]);
        own.node_token = Some(install.for_model("ns", "own"));
        t.replace(vec![own.clone(), spec("static", &["http://b"])]);
        let a = t.get("own").expect("own").replicas[0].clone();
        let b = t.get("static").expect("static").replicas[0].clone();
        let sent = |r: &Replica| r.node_token().map(|v| v.as_bytes().to_vec());
        assert_eq!(
            sent(&a),
            Some(install.for_model("ns", "own").as_str().as_bytes().to_vec())
        );
        assert!(a.node_token().is_some_and(HeaderValue::is_sensitive));
        assert_eq!(
            sent(&b),
            Some(install.as_node_token().as_str().as_bytes().to_vec())
        );
        // The same URL under the same token keeps its replica (and counters)...
        let lease = t.pick(&t.get("own").expect("own"), &[]).expect("pick");
        t.replace(vec![own.clone()]);
        assert!(Arc::ptr_eq(&a, &t.get("own").expect("own").replicas[0]));
        // ...but a pod IP reused by another Model's pod is a fresh replica with its token.
        own.node_token = Some(install.for_model("ns", "other"));
        t.replace(vec![own]);
        let c = t.get("own").expect("own").replicas[0].clone();
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(c.outstanding(), 0);
        assert_eq!(
            sent(&c),
            Some(
                install
                    .for_model("ns", "other")
                    .as_str()
                    .as_bytes()
                    .to_vec()
            )
        );
        drop(lease);
    }

    #[test]
    fn failed_and_down_models_are_not_picked() {
        let t = RouteTable::new(false);
        let mut s = spec("m", &["http://a"]);
        t.replace(vec![s.clone()]);
        assert_eq!(
            t.pick(&t.get("m").expect("m"), &[]).err(),
            Some(NoReplica::NoneReady),
            "a static replica is down until probed"
        );
        s.failed = true;
        t.replace(vec![s]);
        assert_eq!(
            t.pick(&t.get("m").expect("m"), &[]).err(),
            Some(NoReplica::Failed)
        );
    }
}
