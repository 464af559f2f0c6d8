//! Response cache (in front of the scheduler): answers repeated temperature-0 requests from memory.
//!
//! The specification caches identical greedy requests in an in-memory LRU
//! bounded by a share of RAM (default 5 %), lost on restart. The key is every
//! input that can change a greedy answer: model, prompt tokens, `max_tokens`,
//! stop sequences, logprob settings, penalties and logit bias. Only complete
//! answers are stored (never cancelled or failed ones).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;

use gantry_engine_abi::Sampling;

use crate::metrics::Metrics;
use crate::scheduler::{FinishReason, GenEvent};

/// Everything that decides a greedy answer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey {
    pub model: String,
    pub prompt: Vec<i32>,
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub logprobs: Option<u32>,
    /// Bit patterns of the float knobs that still matter under greedy decoding.
    pub knobs: Vec<u32>,
    pub logit_bias: Vec<(i32, u32)>,
}

impl CacheKey {
    /// `None` unless the request is greedy (temperature 0).
    pub fn for_request(
        model: &str,
        prompt: &[i32],
        max_tokens: u32,
        stop: &[String],
        logprobs: Option<u32>,
        s: &Sampling,
    ) -> Option<Self> {
        s.is_greedy().then(|| CacheKey {
            model: model.to_string(),
            prompt: prompt.to_vec(),
            max_tokens,
            stop: stop.to_vec(),
            logprobs,
            knobs: vec![
                s.repetition_penalty.to_bits(),
                s.presence_penalty.to_bits(),
                s.frequency_penalty.to_bits(),
                s.penalty_last_n as u32,
            ],
            logit_bias: s
                .logit_bias
                .iter()
                .map(|&(t, b)| (t, b.to_bits()))
                .collect(),
        })
    }

    fn digest(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.hash(&mut h);
        h.finish()
    }
}

/// A finished answer: its events in order, ending with `Done`.
#[derive(Clone, Debug)]
pub struct CachedAnswer {
    pub key: CacheKey,
    pub events: Vec<GenEvent>,
    pub bytes: usize,
}

impl CachedAnswer {
    pub fn new(key: CacheKey, mut events: Vec<GenEvent>) -> Option<Self> {
        // Only complete answers: a deadline cut is not the model's answer.
        let complete = matches!(events.last(), Some(GenEvent::Done { reason, .. }) if matches!(reason, FinishReason::Stop | FinishReason::Length));
        if !complete {
            return None;
        }
        // A replay evaluates none of its prompt: all of it comes from this cache.
        if let Some(GenEvent::Done {
            prompt_tokens,
            cached_tokens,
            ..
        }) = events.last_mut()
        {
            *cached_tokens = Some(*prompt_tokens);
        }
        let bytes = key.prompt.len() * 4
            + events
                .iter()
                .map(|e| match e {
                    GenEvent::Token { text, logprob } => {
                        64 + text.len() + logprob.as_ref().map_or(0, |l| 64 + l.top.len() * 48)
                    }
                    _ => 64,
                })
                .sum::<usize>();
        Some(Self { key, events, bytes })
    }
}

pub struct ResponseCache {
    inner: Option<Mutex<Inner>>,
    metrics: Metrics,
}

struct Inner {
    lru: lru::LruCache<u64, CachedAnswer>,
    bytes: usize,
    limit: usize,
}

fn total_ram_bytes() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|kb| kb.parse::<usize>().ok())
                })
        })
        .map_or(1 << 30, |kb| kb * 1024)
}

impl ResponseCache {
    /// A cache bounded by `fraction` of the machine's RAM; 0 disables it.
    pub fn with_ram_fraction(fraction: f64, metrics: Metrics) -> Self {
        let limit = (total_ram_bytes() as f64 * fraction) as usize;
        Self::with_limit(limit, metrics)
    }

    pub fn with_limit(limit: usize, metrics: Metrics) -> Self {
        let inner = (limit > 0).then(|| {
            Mutex::new(Inner {
                lru: lru::LruCache::unbounded(),
                bytes: 0,
                limit,
            })
        });
        Self { inner, metrics }
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    pub fn get(&self, key: &CacheKey) -> Option<Vec<GenEvent>> {
        let inner = self.inner.as_ref()?;
        let mut g = inner.lock().unwrap_or_else(|p| p.into_inner());
        // The digest is only an index: the full key must match.
        let hit = g
            .lru
            .get(&key.digest())
            .filter(|a| &a.key == key)
            .map(|a| a.events.clone());
        let m = [key.model.as_str()];
        match hit {
            Some(_) => self.metrics.response_cache_hits.with_label_values(&m).inc(),
            None => self
                .metrics
                .response_cache_misses
                .with_label_values(&m)
                .inc(),
        }
        hit
    }

    pub fn put(&self, answer: CachedAnswer) {
        let Some(inner) = self.inner.as_ref() else {
            return;
        };
        let mut g = inner.lock().unwrap_or_else(|p| p.into_inner());
        if answer.bytes > g.limit {
            return;
        }
        if let Some(old) = g.lru.put(answer.key.digest(), answer.clone()) {
            g.bytes -= old.bytes;
        }
        g.bytes += answer.bytes;
        while g.bytes > g.limit {
            match g.lru.pop_lru() {
                Some((_, evicted)) => g.bytes -= evicted.bytes,
                None => break,
            }
        }
        self.metrics.response_cache_bytes.set(g.bytes as i64);
    }

    /// Drop every answer of `model`: a config reload removed or replaced it, and a model that
    /// comes back under the same id may answer otherwise.
    pub fn forget_model(&self, model: &str) {
        let Some(inner) = self.inner.as_ref() else {
            return;
        };
        let mut g = inner.lock().unwrap_or_else(|p| p.into_inner());
        let stale: Vec<u64> = g
            .lru
            .iter()
            .filter(|(_, a)| a.key.model == model)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            if let Some(a) = g.lru.pop(&k) {
                g.bytes -= a.bytes;
            }
        }
        self.metrics.response_cache_bytes.set(g.bytes as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(model: &str, prompt: Vec<i32>, text: &str) -> CachedAnswer {
        let key = CacheKey::for_request(model, &prompt, 8, &[], None, &Sampling::greedy())
            .expect("greedy");
        CachedAnswer::new(
            key,
            vec![
                GenEvent::Token {
                    text: text.into(),
                    logprob: None,
                },
                GenEvent::Done {
                    reason: FinishReason::Length,
                    prompt_tokens: 1,
                    cached_tokens: None,
                    completion_tokens: 1,
                    queued: std::time::Duration::ZERO,
                },
            ],
        )
        .expect("complete")
    }

    #[test]
    fn only_greedy_requests_have_a_key_and_hits_need_the_full_key() {
        let hot = Sampling {
            temperature: 0.7,
            ..Sampling::greedy()
        };
        assert!(CacheKey::for_request("m", &[1], 8, &[], None, &hot).is_none());
        let c = ResponseCache::with_limit(1 << 20, Metrics::new());
        let a = answer("m", vec![1, 2], "x");
        c.put(a.clone());
        assert!(c.get(&a.key).is_some());
        let mut other = a.key.clone();
        other.max_tokens = 9;
        assert!(c.get(&other).is_none());
    }

    #[test]
    fn the_byte_bound_evicts_least_recently_used_answers() {
        let one = answer("m", vec![1], "a").bytes;
        let c = ResponseCache::with_limit(one * 2, Metrics::new());
        let (a, b, d) = (
            answer("m", vec![1], "a"),
            answer("m", vec![2], "a"),
            answer("m", vec![3], "a"),
        );
        c.put(a.clone());
        c.put(b.clone());
        assert!(c.get(&a.key).is_some()); // a is now the most recent
        c.put(d.clone());
        assert!(c.get(&b.key).is_none(), "b was least recently used");
        assert!(c.get(&a.key).is_some() && c.get(&d.key).is_some());
    }

    #[test]
    fn forgetting_a_model_drops_its_answers_only() {
        let c = ResponseCache::with_limit(1 << 20, Metrics::new());
        let (a1, a2, b) = (
            answer("a", vec![1], "x"),
            answer("a", vec![2], "x"),
            answer("b", vec![1], "x"),
        );
        for x in [&a1, &a2, &b] {
            c.put(x.clone());
        }
        c.forget_model("a");
        assert!(c.get(&a1.key).is_none() && c.get(&a2.key).is_none());
        assert!(c.get(&b.key).is_some());
        c.put(a1.clone());
        assert!(
            c.get(&a1.key).is_some(),
            "a model back under the id caches again"
        );
    }

    #[test]
    fn incomplete_answers_are_not_stored_and_zero_disables() {
        let key =
            CacheKey::for_request("m", &[1], 8, &[], None, &Sampling::greedy()).expect("greedy");
        assert!(
            CachedAnswer::new(
                key.clone(),
                vec![GenEvent::Token {
                    text: "x".into(),
                    logprob: None
                }]
            )
            .is_none()
        );
        assert!(!ResponseCache::with_limit(0, Metrics::new()).enabled());
    }
}
