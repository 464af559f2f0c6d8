//! Metrics, the endpoint picker's series (beside the request path; rendered by `/metrics`): the
//! node-wide gauges the Gateway API Inference Extension / llm-d endpoint picker reads by default
//! under vLLM's names, recomputed from Gantry's per-model series at each scrape
//! (docs/observability.md).

use prometheus::core::Collector;
use prometheus::{Opts, Registry};

use super::{GaugeVec, gauge};

/// The endpoint picker's default series, node-wide.
#[derive(Clone)]
pub(super) struct EppGauges {
    pub(super) waiting: prometheus::Gauge,
    pub(super) running: prometheus::Gauge,
    pub(super) kv_usage: prometheus::Gauge,
    pub(super) kv_usage_legacy: prometheus::Gauge,
    pub(super) cache_config: GaugeVec,
    pub(super) lora_info: GaugeVec,
}

/// The endpoint picker's metric names (vLLM's), in the order they are registered.
pub const EPP_METRIC_NAMES: [&str; 6] = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
];

/// What `vllm:lora_requests_info` says at a scrape: the LoRA adapters (served ids) with
/// requests in flight, and how many adapters the node can hold at once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoraInfo {
    pub running: Vec<String>,
    pub max_lora: usize,
}

impl EppGauges {
    #[allow(clippy::expect_used)] // static definitions
    pub(super) fn new(r: &Registry) -> Self {
        let g = |name: &str, help: &str| {
            let g = prometheus::Gauge::with_opts(Opts::new(name, help)).expect("valid gauge");
            r.register(Box::new(g.clone())).expect("unique gauge");
            g
        };
        EppGauges {
            waiting: g(
                EPP_METRIC_NAMES[0],
                "Requests queued on this node, all models (endpoint picker)",
            ),
            running: g(
                EPP_METRIC_NAMES[1],
                "Requests generating on this node, all models (endpoint picker)",
            ),
            kv_usage: g(
                EPP_METRIC_NAMES[2],
                "Fraction of this node's KV cache in use, 0 to 1 (endpoint picker)",
            ),
            kv_usage_legacy: g(
                EPP_METRIC_NAMES[3],
                "Same as vllm:kv_cache_usage_perc, under the name older endpoint pickers read",
            ),
            cache_config: gauge(
                r,
                EPP_METRIC_NAMES[4],
                "KV cache geometry for the endpoint picker: block_size 1 (token-granular cells), num_gpu_blocks = KV cells, all models",
                &["block_size", "num_gpu_blocks"],
            ),
            lora_info: gauge(
                r,
                EPP_METRIC_NAMES[5],
                "LoRA adapters with requests in flight on this node (running_lora_adapters, served ids, comma-separated; waiting_lora_adapters stays empty: a request waits in the scheduler with its adapter loaded) and max_lora, the adapters the node serves; the value is the scrape's Unix time, as vLLM sets it (endpoint picker's LoRA affinity)",
                &["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            ),
        }
    }

    /// Set `vllm:lora_requests_info`'s one sample.
    pub(super) fn set_lora(&self, info: &LoraInfo) {
        let mut running = info.running.clone();
        running.sort();
        running.dedup();
        self.lora_info.reset();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.lora_info
            .with_label_values(&[&running.join(","), "", &info.max_lora.to_string()])
            .set(now);
    }

    /// Recompute the endpoint picker's node-wide series from the per-model ones.
    pub(super) fn refresh(
        &self,
        waiting: &GaugeVec,
        running: &GaugeVec,
        capacity: &GaugeVec,
        usage: &GaugeVec,
    ) {
        let sum = |g: &GaugeVec| per_model(g).iter().map(|(_, v)| v).sum::<f64>();
        self.waiting.set(sum(waiting));
        self.running.set(sum(running));
        let capacity = per_model(capacity);
        let usage = per_model(usage);
        let total: f64 = capacity.iter().map(|(_, c)| c).sum();
        let used: f64 = capacity
            .iter()
            .map(|(model, c)| {
                usage
                    .iter()
                    .find(|(m, _)| m == model)
                    .map_or(0.0, |(_, u)| u * c)
            })
            .sum();
        let frac = if total > 0.0 {
            (used / total).clamp(0.0, 1.0)
        } else {
            0.0
        };
        self.kv_usage.set(frac);
        self.kv_usage_legacy.set(frac);
        self.cache_config.reset();
        self.cache_config
            .with_label_values(&["1", &format!("{}", total as u64)])
            .set(1.0);
    }
}

/// Sum of a per-model gauge's samples, and the samples by model.
fn per_model(g: &GaugeVec) -> Vec<(String, f64)> {
    g.collect()
        .iter()
        .flat_map(|f| f.get_metric().iter())
        .map(|m| {
            let model = m
                .get_label()
                .iter()
                .find(|l| l.name() == "model")
                .map(|l| l.value().to_string())
                .unwrap_or_default();
            (model, m.get_gauge().get_value())
        })
        .collect()
}
