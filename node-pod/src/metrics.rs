//! Metrics (beside the request path): every Prometheus series the node exports, with stable names.
//!
//! The scheduler and the HTTP layer update these; `/metrics` renders them.
//! Besides Gantry's own per-model series, `/metrics` carries the node-wide series the Gateway
//! API Inference Extension / llm-d endpoint picker reads by default under vLLM's names
//! (`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
//! `vllm:cache_config_info`; see docs/observability.md), computed from the per-model series
//! at each scrape.

use prometheus::core::Collector;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
    core::{AtomicF64, GenericGaugeVec},
};

mod epp;

use epp::EppGauges;
pub use epp::{EPP_METRIC_NAMES, LoraInfo};

pub type GaugeVec = GenericGaugeVec<AtomicF64>;

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    pub requests_waiting: GaugeVec,
    pub requests_running: GaugeVec,
    pub kv_cache_usage: GaugeVec,
    pub kv_cache_capacity_tokens: GaugeVec,
    /// Per device (devices.rs): memory in use (by anyone) and the device's total; GPU busy share.
    pub vram_used_bytes: GaugeVec,
    pub vram_total_bytes: GaugeVec,
    pub gpu_utilization: GaugeVec,
    /// Per model: what it holds in its pool (the engine's report, or the measured load when larger).
    pub model_memory_bytes: GaugeVec,
    pub ttft: HistogramVec,
    pub inter_token: HistogramVec,
    pub e2e: HistogramVec,
    pub prompt_tokens: IntCounterVec,
    /// Of those, the tokens the engine took from its prefix cache and the ones it evaluated
    /// (ABI 1.4 `seq_cached_tokens`; only requests whose engine reports it).
    pub prompt_tokens_cached: IntCounterVec,
    pub prompt_tokens_evaluated: IntCounterVec,
    pub generation_tokens: IntCounterVec,
    /// Speculative decoding: tokens drafted (prompt lookup) and, of those, the ones the
    /// verification kept; their ratio is the acceptance rate.
    pub speculative_draft_tokens: IntCounterVec,
    pub speculative_accepted_tokens: IntCounterVec,
    pub requests: IntCounterVec,
    pub model_load_seconds: GaugeVec,
    pub response_cache_hits: IntCounterVec,
    pub response_cache_misses: IntCounterVec,
    pub response_cache_bytes: IntGauge,
    pub engine_hung: IntGauge,
    pub steps: IntCounterVec,
    pub step_tokens: HistogramVec,
    /// Constrained decoding (constraint.rs): the host's time to compute one token's
    /// allowed-token mask, and the time a step waited for its batch's masks.
    pub constraint_mask_seconds: HistogramVec,
    pub constraint_batch_seconds: HistogramVec,
    /// Memory policy (memory.rs): unloads by reason, refused loads by code,
    /// and the accounted use and limit per pool.
    pub model_unloads: IntCounterVec,
    pub model_load_refusals: IntCounterVec,
    /// LoRA adapters (node/adapters.rs): loads, refusals and LRU evictions, per adapter id.
    pub adapter_events: IntCounterVec,
    /// Speech recognition windows by how their answer came (http/audio/decoder.rs): `first`
    /// (the first decode stood), `fallback` (decoded again at a higher temperature),
    /// `silence` (no segment: the model heard no speech).
    pub transcription_windows: IntCounterVec,
    pub memory_used_bytes: GaugeVec,
    pub memory_limit_bytes: GaugeVec,
    /// Time from arrival to admission (or to the deadline, for a request that never left the queue).
    pub queue_seconds: HistogramVec,
    /// How each generation ended: stop, length, deadline, stall, queue_timeout, error, cancelled.
    pub finished: IntCounterVec,
    /// The engines' own event counters (ABI 1.12 `model_counters`), by model and event: the
    /// llama.cpp plugin's graph builds and reuses, for one.
    pub engine_events: IntCounterVec,
    /// Config reloads (node/reload.rs) by result: `applied` or `refused`.
    pub config_reloads: IntCounterVec,
    /// Engine worker crashes (`process` isolation), by model, plugin and reason
    /// (`crashed`, `hung`).
    pub engine_crashes: IntCounterVec,
    /// Requests a worker crash interrupted before their first token, sent again to the
    /// restarted model (`result`: `retried`, `failed`).
    pub crash_retries: IntCounterVec,
    /// Connections at the edge (gantry-edge).
    pub edge: std::sync::Arc<gantry_edge::EdgeMetrics>,
    /// The endpoint picker's series (vLLM names), one sample each for the whole node.
    epp: EppGauges,
}

fn gauge(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid gauge");
    reg.register(Box::new(g.clone())).expect("unique gauge");
    g
}

fn counter(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter");
    reg.register(Box::new(c.clone())).expect("unique counter");
    c
}

/// 5 µs to 0.5 s, about four buckets per decade: fine enough to read a p50 and a p99.
fn mask_buckets() -> Vec<f64> {
    let mut b = Vec::new();
    let mut decade = 5e-6;
    while decade < 0.5 {
        for f in [1.0, 2.0, 3.0, 6.0] {
            b.push(decade * f);
        }
        decade *= 10.0;
    }
    b.push(0.5);
    b
}

fn histogram(
    reg: &Registry,
    name: &str,
    help: &str,
    buckets: Vec<f64>,
    labels: &[&str],
) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
        .expect("valid histogram");
    reg.register(Box::new(h.clone())).expect("unique histogram");
    h
}

impl Metrics {
    #[allow(clippy::expect_used)] // metric definitions are static; a bad one is a programming error at start-up
    pub fn new() -> Self {
        let r = Registry::new();
        let m = ["model"];
        let latency = vec![
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ];
        let itl = vec![
            0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5.0,
        ];
        let e2e = vec![0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
        let engine_hung = IntGauge::new(
            "gantry_engine_hung",
            "1 when an engine step overran the watchdog; /healthz fails",
        )
        .expect("gauge");
        r.register(Box::new(engine_hung.clone())).expect("unique");
        let cache_bytes = IntGauge::new(
            "gantry_response_cache_bytes",
            "Bytes held by the temperature-0 response cache",
        )
        .expect("gauge");
        r.register(Box::new(cache_bytes.clone())).expect("unique");
        let config_reloads = counter(
            &r,
            "gantry_config_reloads_total",
            "Config file reloads by result: applied, or refused (unreadable or invalid; the old config keeps serving)",
            &["result"],
        );
        // Both series exist from the start, so a rate over them needs no first reload.
        for result in ["applied", "refused"] {
            config_reloads.with_label_values(&[result]);
        }
        let engine_crashes = counter(
            &r,
            "gantry_engine_crashes_total",
            "Engine worker processes that ended without the node asking, by model, plugin and reason (crashed: a signal or exit; hung: the watchdog killed a step that overran)",
            &["model", "plugin", "reason"],
        );
        let crash_retries = counter(
            &r,
            "gantry_engine_crash_retries_total",
            "Requests a worker crash interrupted before their first token, by result (retried: sent to the restarted model; failed: it did not come back in time)",
            &["model", "result"],
        );
        Self {
            requests_waiting: gauge(
                &r,
                "gantry_num_requests_waiting",
                "Requests queued for admission",
                &m,
            ),
            requests_running: gauge(
                &r,
                "gantry_num_requests_running",
                "Requests holding a sequence in the engine",
                &m,
            ),
            kv_cache_usage: gauge(
                &r,
                "gantry_kv_cache_usage_perc",
                "Fraction of KV-cache cells in use (0-1)",
                &m,
            ),
            kv_cache_capacity_tokens: gauge(
                &r,
                "gantry_kv_cache_capacity_tokens",
                "KV-cache capacity reported by the engine",
                &m,
            ),
            vram_used_bytes: gauge(
                &r,
                "gantry_vram_used_bytes",
                "Device memory in use on the GPU (total - free, every process), from the CUDA driver",
                &["device"],
            ),
            vram_total_bytes: gauge(
                &r,
                "gantry_vram_total_bytes",
                "Device memory of the GPU, from the CUDA driver",
                &["device"],
            ),
            gpu_utilization: gauge(
                &r,
                "gantry_gpu_utilization_percent",
                "GPU busy share over NVML's last sample period (absent without NVML)",
                &["device"],
            ),
            model_memory_bytes: gauge(
                &r,
                "gantry_model_memory_bytes",
                "Memory the model holds in its pool (VRAM on a CUDA node, RAM on a CPU node): the engine's report, or the measured fall in free device memory when larger",
                &m,
            ),
            ttft: histogram(
                &r,
                "gantry_time_to_first_token_seconds",
                "Arrival to first generated token",
                latency.clone(),
                &m,
            ),
            inter_token: histogram(
                &r,
                "gantry_inter_token_latency_seconds",
                "Time between consecutive tokens of a stream",
                itl,
                &m,
            ),
            e2e: histogram(
                &r,
                "gantry_request_duration_seconds",
                "Arrival to last token",
                e2e,
                &m,
            ),
            prompt_tokens: counter(
                &r,
                "gantry_prompt_tokens_total",
                "Prompt tokens processed",
                &m,
            ),
            speculative_draft_tokens: counter(
                &r,
                "gantry_speculative_draft_tokens_total",
                "Tokens drafted by prompt lookup and verified by the engine (speculative decoding)",
                &m,
            ),
            speculative_accepted_tokens: counter(
                &r,
                "gantry_speculative_accepted_tokens_total",
                "Drafted tokens the verification kept (accepted / drafted = acceptance rate)",
                &m,
            ),
            prompt_tokens_cached: counter(
                &r,
                "gantry_prompt_tokens_cached_total",
                "Prompt tokens the engine took from its prefix cache instead of evaluating (engines that report it, ABI 1.4)",
                &m,
            ),
            prompt_tokens_evaluated: counter(
                &r,
                "gantry_prompt_tokens_evaluated_total",
                "Prompt tokens the engine evaluated: prompt minus cached (engines that report it, ABI 1.4)",
                &m,
            ),
            generation_tokens: counter(
                &r,
                "gantry_generation_tokens_total",
                "Tokens generated",
                &m,
            ),
            requests: counter(
                &r,
                "gantry_requests_total",
                "Requests by endpoint and outcome (HTTP status code)",
                &["model", "endpoint", "code"],
            ),
            model_load_seconds: gauge(
                &r,
                "gantry_model_load_seconds",
                "Seconds the last load of the model took",
                &m,
            ),
            response_cache_hits: counter(
                &r,
                "gantry_response_cache_hits_total",
                "Temperature-0 requests answered from the response cache",
                &m,
            ),
            response_cache_misses: counter(
                &r,
                "gantry_response_cache_misses_total",
                "Temperature-0 requests the cache could not answer",
                &m,
            ),
            response_cache_bytes: cache_bytes,
            engine_hung,
            steps: counter(&r, "gantry_engine_steps_total", "Engine forward passes", &m),
            step_tokens: histogram(
                &r,
                "gantry_engine_step_tokens",
                "Tokens per engine forward pass",
                vec![
                    1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                ],
                &m,
            ),
            constraint_mask_seconds: histogram(
                &r,
                "gantry_constraint_mask_seconds",
                "Host time to compute one constrained token's allowed-token mask",
                mask_buckets(),
                &m,
            ),
            constraint_batch_seconds: histogram(
                &r,
                "gantry_constraint_batch_seconds",
                "Time an engine step waited for its batch's allowed-token masks (computed in parallel)",
                mask_buckets(),
                &m,
            ),
            model_unloads: counter(
                &r,
                "gantry_model_unloads_total",
                "Models unloaded (reason: ram_watermark/vram_watermark, the memory policy; config_removed/config_changed, a config reload)",
                &["model", "reason"],
            ),
            adapter_events: counter(
                &r,
                "gantry_adapter_events_total",
                "LoRA adapter loads (event: loaded), refusals by the engine or the download (refused) and unloads by the memory policy (evicted)",
                &["adapter", "event"],
            ),
            transcription_windows: counter(
                &r,
                "gantry_transcription_windows_total",
                "Speech recognition windows by outcome: first (the first decode stood), fallback (decoded again at a higher temperature), silence (dropped: no speech heard)",
                &["model", "outcome"],
            ),
            model_load_refusals: counter(
                &r,
                "gantry_model_load_refusals_total",
                "Model loads refused because they cannot fit (code: OOM_RAM or OOM_VRAM)",
                &["model", "code"],
            ),
            memory_used_bytes: gauge(
                &r,
                "gantry_memory_used_bytes",
                "Bytes the loaded models hold, as the memory policy accounts them",
                &["pool"],
            ),
            memory_limit_bytes: gauge(
                &r,
                "gantry_memory_limit_bytes",
                "The memory policy's limit per pool (0 = none)",
                &["pool"],
            ),
            queue_seconds: histogram(
                &r,
                "gantry_request_queue_seconds",
                "Time a generation waited in the queue before admission (or until its deadline)",
                latency.clone(),
                &m,
            ),
            finished: counter(
                &r,
                "gantry_request_finish_total",
                "Generations by how they ended: stop, length, deadline, stall, queue_timeout, error, cancelled",
                &["model", "reason"],
            ),
            engine_events: counter(
                &r,
                "gantry_engine_events_total",
                "Events the model's engine counts itself (ABI 1.12 model_counters), by event: for the llama.cpp plugin graph_builds and graph_reuses (on CUDA, graph captures and replays), ubatches, sampler_attaches",
                &["model", "event"],
            ),
            config_reloads,
            engine_crashes,
            crash_retries,
            edge: std::sync::Arc::new(
                gantry_edge::EdgeMetrics::register(&r, "gantry").expect("edge metrics"),
            ),
            epp: EppGauges::new(&r),
            registry: r,
        }
    }

    /// The name of every metric family registered here, also those with no sample yet (which
    /// `/metrics` leaves out); the dashboard test checks its queries against these.
    pub fn family_names(&self) -> Vec<String> {
        let collectors: [&dyn Collector; 45] = [
            &self.requests_waiting,
            &self.requests_running,
            &self.kv_cache_usage,
            &self.kv_cache_capacity_tokens,
            &self.vram_used_bytes,
            &self.vram_total_bytes,
            &self.gpu_utilization,
            &self.model_memory_bytes,
            &self.ttft,
            &self.inter_token,
            &self.e2e,
            &self.prompt_tokens,
            &self.prompt_tokens_cached,
            &self.prompt_tokens_evaluated,
            &self.generation_tokens,
            &self.speculative_draft_tokens,
            &self.speculative_accepted_tokens,
            &self.requests,
            &self.model_load_seconds,
            &self.response_cache_hits,
            &self.response_cache_misses,
            &self.response_cache_bytes,
            &self.engine_hung,
            &self.steps,
            &self.step_tokens,
            &self.constraint_mask_seconds,
            &self.constraint_batch_seconds,
            &self.model_unloads,
            &self.model_load_refusals,
            &self.adapter_events,
            &self.transcription_windows,
            &self.memory_used_bytes,
            &self.memory_limit_bytes,
            &self.queue_seconds,
            &self.finished,
            &self.engine_events,
            &self.config_reloads,
            &self.engine_crashes,
            &self.crash_retries,
            &self.epp.waiting,
            &self.epp.running,
            &self.epp.kv_usage,
            &self.epp.kv_usage_legacy,
            &self.epp.cache_config,
            &self.epp.lora_info,
        ];
        let mut names: Vec<String> = collectors
            .iter()
            .flat_map(|c| c.desc())
            .map(|d| d.fq_name.clone())
            .collect();
        names.extend(self.edge.family_names());
        names
    }

    /// Count a generation the HTTP side ended (the stall timer) under `reason`.
    pub fn finished_by_http(&self, model: &str, reason: &str) {
        self.finished.with_label_values(&[model, reason]).inc();
    }

    /// Recompute the endpoint picker's node-wide series from the per-model ones.
    fn refresh_epp(&self) {
        self.epp.refresh(
            &self.requests_waiting,
            &self.requests_running,
            &self.kv_cache_capacity_tokens,
            &self.kv_cache_usage,
        );
    }

    /// Drop the gauge series of a model this node no longer serves (a config reload removed
    /// it), so the node-wide sums stop counting it. Counters and histograms stay: they are
    /// cumulative, and Prometheus reads a vanished counter as the end of that series anyway.
    pub fn forget_model(&self, model: &str) {
        for g in [
            &self.requests_waiting,
            &self.requests_running,
            &self.kv_cache_usage,
            &self.kv_cache_capacity_tokens,
            &self.model_memory_bytes,
            &self.model_load_seconds,
        ] {
            // Absent when the model never loaded: nothing to drop.
            let _ = g.remove_label_values(&[model]);
        }
    }

    /// The Prometheus text exposition.
    /// The per-device gauges from a device snapshot (devices.rs); series of devices no
    /// longer seen are dropped.
    pub fn set_devices(&self, snap: &crate::devices::DeviceSnapshot) {
        self.vram_used_bytes.reset();
        self.vram_total_bytes.reset();
        self.gpu_utilization.reset();
        for d in &snap.devices {
            let l = [d.index.to_string()];
            let l = [l[0].as_str()];
            self.vram_total_bytes
                .with_label_values(&l)
                .set(d.total_bytes as f64);
            self.vram_used_bytes
                .with_label_values(&l)
                .set(d.total_bytes.saturating_sub(d.free_bytes) as f64);
            if let Some(u) = d.utilization_percent {
                self.gpu_utilization.with_label_values(&l).set(f64::from(u));
            }
        }
    }

    /// The text exposition, with the endpoint picker's series recomputed; `lora` is what
    /// `vllm:lora_requests_info` says now.
    pub fn render_with(&self, lora: &LoraInfo) -> String {
        self.epp.set_lora(lora);
        self.render()
    }

    pub fn render(&self) -> String {
        self.refresh_epp();
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Metrics {
    /// One model's series for its schedulers, bound to its label once: they update these on
    /// every token, so the label lookup stays off the hot path.
    pub fn for_model(&self, model: &str) -> gantry_scheduler::SchedulerMetrics {
        let m = [model];
        gantry_scheduler::SchedulerMetrics {
            requests_waiting: self.requests_waiting.with_label_values(&m),
            requests_running: self.requests_running.with_label_values(&m),
            kv_cache_usage: self.kv_cache_usage.with_label_values(&m),
            kv_cache_capacity: self.kv_cache_capacity_tokens.with_label_values(&m),
            ttft: self.ttft.with_label_values(&m),
            inter_token: self.inter_token.with_label_values(&m),
            e2e: self.e2e.with_label_values(&m),
            prompt_tokens: self.prompt_tokens.with_label_values(&m),
            prompt_tokens_cached: self.prompt_tokens_cached.with_label_values(&m),
            prompt_tokens_evaluated: self.prompt_tokens_evaluated.with_label_values(&m),
            generation_tokens: self.generation_tokens.with_label_values(&m),
            draft_tokens: self.speculative_draft_tokens.with_label_values(&m),
            accepted_tokens: self.speculative_accepted_tokens.with_label_values(&m),
            steps: self.steps.with_label_values(&m),
            step_tokens: self.step_tokens.with_label_values(&m),
            queue_seconds: self.queue_seconds.with_label_values(&m),
            constraint_mask: self.constraint_mask_seconds.with_label_values(&m),
            constraint_batch: self.constraint_batch_seconds.with_label_values(&m),
            engine_hung: self.engine_hung.clone(),
            finish: self.finished.clone(),
            engine_events: self.engine_events.clone(),
            model: model.to_string(),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
