//! The series a scheduler updates (scheduler → `/metrics`), bound to its model's label once by
//! the node's registry, so no label lookup happens on the per-token path.

use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGauge};

/// One model's series.
#[derive(Clone)]
pub struct SchedulerMetrics {
    pub requests_waiting: Gauge,
    pub requests_running: Gauge,
    pub kv_cache_usage: Gauge,
    /// KV cells of all the model's replicas (`gantry_kv_cache_capacity_tokens`).
    pub kv_cache_capacity: Gauge,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    pub prompt_tokens: IntCounter,
    pub prompt_tokens_cached: IntCounter,
    pub prompt_tokens_evaluated: IntCounter,
    pub generation_tokens: IntCounter,
    /// `gantry_speculative_draft_tokens_total` / `_accepted_tokens_total`.
    pub draft_tokens: IntCounter,
    pub accepted_tokens: IntCounter,
    pub steps: IntCounter,
    pub step_tokens: Histogram,
    pub queue_seconds: Histogram,
    pub constraint_mask: Histogram,
    pub constraint_batch: Histogram,
    /// The node-wide `gantry_engine_hung` (an in-process step overran).
    pub engine_hung: IntGauge,
    /// `gantry_request_finish_total` by model and reason.
    pub finish: IntCounterVec,
    /// `gantry_engine_events_total` by model and event (the engine's own counters).
    pub engine_events: IntCounterVec,
    pub model: String,
}

impl SchedulerMetrics {
    /// Count one generation's end under `reason` (see `gantry_request_finish_total`).
    pub fn finished(&self, reason: &str) {
        self.finish.with_label_values(&[&self.model, reason]).inc();
    }
}
