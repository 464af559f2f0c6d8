//! Where each routing key was last sent (on the request path, inside the keyed pick of
//! [`crate::route_table`]): the memory that keeps a conversation on the replica holding its prompt
//! in cache, and the per-replica key counts that spread new conversations evenly.
//!
//! A placement is (model, key) → replica URL and when it was last used. It follows the key:
//! when a keyed request goes elsewhere (its replica left, or passed the load bound) the
//! placement moves with it, because that replica now holds the newest copy of the prompt. A
//! placement unused for the TTL (`--placement-ttl-seconds`) is forgotten, as the node's prompt
//! cache will have evicted it by then; so are the oldest ones past [`MAX_PLACEMENTS`].
//!
//! Hand-written rather than an LRU crate: the pick needs each replica's count of live keys per
//! model, kept in step with every insert, move and expiry, which a plain LRU map does not keep.
//! Each gateway replica keeps its own (they run active-active); first placements follow the
//! hash ring, so two gateways with the same history place a key alike.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::hash::hash64;

/// Placements kept at most; past it the least recently used are dropped (about 100 bytes
/// each, so a few MiB).
pub const MAX_PLACEMENTS: usize = 65_536;
/// Default time a placement outlives its last request.
pub const DEFAULT_PLACEMENT_TTL: Duration = Duration::from_secs(600);

#[derive(Debug)]
struct Entry {
    url: Arc<str>,
    last: Instant,
}

/// The placements of every model's keys.
#[derive(Debug)]
pub struct Placements {
    /// By (model hash, key hash).
    entries: HashMap<(u64, u64), Entry>,
    /// Live keys per model, per replica URL.
    counts: HashMap<u64, HashMap<Arc<str>, usize>>,
    ttl: Duration,
    last_sweep: Instant,
}

/// A model id's hash, the first half of a placement's identity (computed once per route,
/// when a discovery snapshot builds it).
pub fn model_hash(id: &str) -> u64 {
    hash64(&[b"model\0", id.as_bytes()])
}

impl Placements {
    pub fn new(ttl: Duration) -> Self {
        Placements {
            entries: HashMap::new(),
            counts: HashMap::new(),
            ttl,
            last_sweep: Instant::now(),
        }
    }

    /// The replica `key` of `model` was last sent to, if that was within the TTL.
    pub fn get(&mut self, model: u64, key: u64, now: Instant) -> Option<Arc<str>> {
        let s = (model, key);
        let live = match self.entries.get(&s) {
            None => return None,
            Some(e) => now.saturating_duration_since(e.last) < self.ttl,
        };
        if live {
            self.entries.get(&s).map(|e| Arc::clone(&e.url))
        } else {
            self.remove(s);
            None
        }
    }

    /// Live keys of `model` placed on `url`.
    pub fn count(&self, model: u64, url: &str) -> usize {
        self.counts
            .get(&model)
            .and_then(|c| c.get(url))
            .copied()
            .unwrap_or(0)
    }

    /// Record that `key` of `model` went to `url` now.
    pub fn place(&mut self, model: u64, key: u64, url: &str, now: Instant) {
        let s = (model, key);
        if let Some(e) = self.entries.get_mut(&s)
            && &*e.url == url
        {
            e.last = now;
            return;
        }
        self.remove(s);
        let url: Arc<str> = Arc::from(url);
        *self
            .counts
            .entry(model)
            .or_default()
            .entry(Arc::clone(&url))
            .or_insert(0) += 1;
        self.entries.insert(s, Entry { url, last: now });
        if self.entries.len() > MAX_PLACEMENTS
            || now.saturating_duration_since(self.last_sweep) >= self.ttl / 8
        {
            self.sweep(now);
        }
    }

    /// Placements held now (live or not yet swept).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn remove(&mut self, s: (u64, u64)) {
        let Some(e) = self.entries.remove(&s) else {
            return;
        };
        let model = s.0;
        if let Some(per_url) = self.counts.get_mut(&model) {
            if let Some(c) = per_url.get_mut(&e.url) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    per_url.remove(&e.url);
                }
            }
            if per_url.is_empty() {
                self.counts.remove(&model);
            }
        }
    }

    /// Drop expired placements, then the least recently used past [`MAX_PLACEMENTS`].
    fn sweep(&mut self, now: Instant) {
        self.last_sweep = now;
        let ttl = self.ttl;
        let mut stale: Vec<(u64, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.last) >= ttl)
            .map(|(s, _)| *s)
            .collect();
        let over = (self.entries.len() - stale.len()).saturating_sub(MAX_PLACEMENTS);
        if over > 0 {
            let mut live: Vec<(Instant, (u64, u64))> = self
                .entries
                .iter()
                .filter(|(_, e)| now.saturating_duration_since(e.last) < ttl)
                .map(|(s, e)| (e.last, *s))
                .collect();
            live.select_nth_unstable(over - 1);
            stale.extend(live[..over].iter().map(|(_, s)| *s));
        }
        for s in stale {
            self.remove(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placement_follows_its_key_and_counts_stay_in_step() {
        let now = Instant::now();
        let mut p = Placements::new(Duration::from_secs(60));
        let m = model_hash("m");
        p.place(m, 1, "http://a", now);
        p.place(m, 2, "http://a", now);
        p.place(model_hash("other"), 1, "http://a", now);
        assert_eq!(p.get(m, 1, now).as_deref(), Some("http://a"));
        assert_eq!((p.count(m, "http://a"), p.count(m, "http://b")), (2, 0));
        // Key 1 moves: the counts move with it; a repeat changes nothing.
        p.place(m, 1, "http://b", now);
        p.place(m, 1, "http://b", now);
        assert_eq!(p.get(m, 1, now).as_deref(), Some("http://b"));
        assert_eq!((p.count(m, "http://a"), p.count(m, "http://b")), (1, 1));
        assert_eq!(p.count(model_hash("other"), "http://a"), 1);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn an_unused_placement_expires_after_the_ttl() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(60);
        let mut p = Placements::new(ttl);
        let m = model_hash("m");
        p.place(m, 1, "http://a", t0);
        p.place(m, 2, "http://a", t0);
        // Key 2 is used again later; key 1 is not.
        p.place(m, 2, "http://a", t0 + ttl / 2);
        let later = t0 + ttl + Duration::from_secs(1);
        assert_eq!(p.get(m, 1, later), None);
        assert_eq!(p.get(m, 2, later).as_deref(), Some("http://a"));
        assert_eq!(p.count(m, "http://a"), 1);
        // A sweep (due after ttl/8) drops whatever expired without being asked for.
        p.place(m, 3, "http://b", t0 + 3 * ttl);
        assert_eq!(p.len(), 1);
        assert_eq!(p.count(m, "http://a"), 0);
    }

    #[test]
    fn past_the_cap_the_least_recently_used_go_first() {
        let t0 = Instant::now();
        let mut p = Placements::new(Duration::from_secs(3600));
        let m = model_hash("m");
        for k in 0..(MAX_PLACEMENTS as u64 + 10) {
            p.place(m, k, "http://a", t0 + Duration::from_millis(k));
        }
        assert!(p.len() <= MAX_PLACEMENTS, "{} kept", p.len());
        assert_eq!(p.count(m, "http://a"), p.len());
        let newest = MAX_PLACEMENTS as u64 + 9;
        let at = t0 + Duration::from_secs(1000);
        assert_eq!(p.get(m, newest, at).as_deref(), Some("http://a"));
        assert_eq!(p.get(m, 0, at), None);
    }
}
