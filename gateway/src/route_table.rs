//! The route table (between discovery and every proxied request): which replicas serve each
//! model id, how loaded each one is, and the pick: by routing key with bounded load
//! ([`crate::affinity`]), else the least-loaded replica, preferring those that report the model
//! loaded. Not the gateway's HTTP routes: those are [`crate::router()`].
//!
//! Discovery sources (static file or kube reflectors) hand over whole snapshots with
//! [`RouteTable::replace`]; replicas are kept by base URL across snapshots so their counters
//! survive. The prober updates each [`Replica`]'s liveness and queue depth (`replica.rs`);
//! every change wakes the requests held for a model with no ready replica. The pick,
//! [`RouteTable::pick_keyed`], is in `pick.rs`; what a request's `model` names (a model, or a
//! LoRA adapter of one), [`RouteTable::resolve`], is in `adapter.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::http::HeaderValue;
use gantry_api::node_token::ModelToken;
use tokio::sync::watch;

use crate::affinity::Ring;
use crate::placement::{Placements, model_hash};

mod adapter;
mod pick;
mod replica;
#[cfg(test)]
mod tests;

pub use adapter::Target;
pub use pick::{Lease, NoReplica, Rule};
pub use replica::{PROBE_MISSES_DOWN, Replica};

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
    /// The model ids of its LoRA adapters the source declares (a Model's `spec.adapters`);
    /// the replicas' reports (`models[].adapters[].id`) add any others they serve.
    pub adapters: Vec<String>,
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

    /// A receiver that changes whenever a replica may have become usable.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn notify(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }
}
