//! The pick (on the request path, after [`crate::proxy`] has the model's route and the
//! request's routing key): which replica of a model takes one request, and the lease that
//! counts it as outstanding there until the response is relayed or dropped.
//!
//! Candidates are the usable replicas that report the model loaded when any does, else all
//! usable ones; a model none has loaded goes where there is the most room. A request for a
//! LoRA adapter goes to its base model's replicas, never to one that refused the adapter, and
//! to those that report the adapter loaded when any does. A keyed request follows its
//! placement ([`crate::placement`]) or the hash ring within the load [`Bound`]; anything else
//! goes to the least loaded.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gantry_api::AdapterState;

use crate::affinity::{Bound, KeyKind, RouteKey};
use crate::placement::model_hash;

use super::{ModelRoute, Replica, RouteTable};

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

/// Why no replica could be picked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoReplica {
    /// No replica is usable now; one may come (scale up, start, recover).
    NoneReady,
    /// The Model is marked failed.
    Failed,
    /// Every usable replica refused the requested adapter.
    AdapterRefused,
}

impl RouteTable {
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
        self.pick_served(route, None, exclude, key, bound)
    }

    /// [`Self::pick_keyed`] for the model of `route` or, with `adapter`, for that adapter of
    /// it: a replica that refused the adapter is no candidate; among the rest, those that
    /// report it loaded are preferred (they have the base model loaded too), else those with
    /// the base model loaded. An adapter's routing keys are placed apart from its base model's:
    /// its prompts' cache entries are its own.
    pub fn pick_served(
        &self,
        route: &ModelRoute,
        adapter: Option<&str>,
        exclude: &[String],
        key: Option<RouteKey>,
        bound: Bound,
    ) -> Result<(Lease, Rule), NoReplica> {
        if route.spec.failed {
            return Err(NoReplica::Failed);
        }
        let now = Instant::now();
        let n = route.replicas.len();
        let id = &route.spec.id;
        let live: Vec<bool> = route
            .replicas
            .iter()
            .map(|r| r.usable(now) && !exclude.iter().any(|e| *e == r.url))
            .collect();
        let adapter_state = |i: usize| adapter.and_then(|a| route.replicas[i].adapter_state(id, a));
        let usable: Vec<bool> = (0..n)
            .map(|i| live[i] && adapter_state(i) != Some(AdapterState::Refused))
            .collect();
        let count = usable.iter().filter(|u| **u).count();
        if count == 0 {
            return Err(if live.iter().any(|l| *l) {
                NoReplica::AdapterRefused
            } else {
                NoReplica::NoneReady
            });
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
        let base_warm: Vec<bool> = (0..n)
            .map(|i| usable[i] && route.replicas[i].has_loaded(id))
            .collect();
        let adapter_warm: Vec<bool> = (0..n)
            .map(|i| base_warm[i] && adapter_state(i) == Some(AdapterState::Loaded))
            .collect();
        let warm = if adapter_warm.iter().any(|w| *w) {
            adapter_warm
        } else {
            base_warm
        };
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
            let model = adapter.map_or(route.model_hash, model_hash);
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
