//! The node config (operator build step → node start-up): the YAML model list the operator
//! renders into a Model's ConfigMap and the node reads at start, one type for both sides, with
//! the rules the YAML shape cannot express ([`NodeConfig::validate`]) and the `serve` flags'
//! single-model shorthand ([`NodeConfig::single`]).
//!
//! ```yaml
//! models:
//!   - id: gemma-3-270m            # the OpenAI model id
//!     path: /models/gemma.gguf    # a local file or directory
//!     format: gguf                # fixed at registration; never switched at run time
//!     engine: llama_cpp           # optional pin
//!     contextLength: 4096         # per-sequence context
//!     maxBatchSize: 8             # sequences decoded together
//!     requestTimeoutSeconds: 30   # 0 = no deadline
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use gantry_engine_abi::Format;
use serde::{Deserialize, Serialize};

use crate::source::{Source, check_relative_file};

mod adapter;
mod speculation;
pub use adapter::{
    ADAPTER_SEPARATOR, AdapterConfig, MAX_ADAPTERS, check_name as check_adapter_name,
};
pub use speculation::{SpeculationConfig, SpeculationMethod};

/// Where the operator mounts the node's model config inside a node pod
/// (`gantry-node serve --config ...`).
pub const NODE_CONFIG_PATH: &str = "/etc/gantry/models.yaml";

/// Most engine instances one model may have on one node (one per GPU on the largest nodes).
pub const MAX_REPLICAS: u32 = 16;

/// The whole node configuration file.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeConfig {
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// Where downloaded artifacts go (the cache volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "SchedulerConfig::is_default")]
    pub scheduler: SchedulerConfig,
    /// Where engine plugin code runs: in the node process or in a worker process per model.
    #[serde(default, skip_serializing_if = "IsolationConfig::is_default")]
    pub isolation: IsolationConfig,
}

/// Where a plugin's code runs (EnginePlugin `spec.isolation`, node config `isolation`).
#[derive(
    Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum Isolation {
    /// In the node process: no extra copy or hop per step; a crash in the plugin takes the
    /// whole node down.
    #[default]
    InProcess,
    /// In a `gantry-node engine-worker` process per loaded model: a crash or hang ends only
    /// that model's worker, which the node restarts (docs/engines.md, the failure model).
    Process,
}

impl Isolation {
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::InProcess => "inProcess",
            Isolation::Process => "process",
        }
    }
}

/// The node's isolation settings: a default, and per plugin id the mode its EnginePlugin asks
/// for (the operator writes one entry per plugin that sets `spec.isolation`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IsolationConfig {
    /// The mode of a plugin not listed in `plugins`.
    #[serde(default)]
    pub default: Isolation,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub plugins: std::collections::BTreeMap<String, Isolation>,
}

impl IsolationConfig {
    pub fn is_default(&self) -> bool {
        *self == IsolationConfig::default()
    }

    /// The mode plugin `id` runs in.
    pub fn for_plugin(&self, id: &str) -> Isolation {
        self.plugins.get(id).copied().unwrap_or(self.default)
    }
}

/// How a model is loaded relative to readiness.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum LoadPolicy {
    /// Load at start; the node is ready only once loaded (the Kubernetes default).
    #[default]
    Eager,
    /// Load on first request (multi-model nodes only).
    Lazy,
}

/// One model this node serves. The field order is the order the operator renders them in.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelConfig {
    /// OpenAI model id (a Model's `servedName`).
    pub id: String,
    /// Local file (a `.gguf`) or directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Where the model lives, as the operator writes it (`file:///...`,
    /// `hf://org/repo`, `https://...`, `s3://...`; a Model's `pvc://claim/path`
    /// arrives as `file:///models/claim/path`); `path` or `source`, not both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// `gguf`, `safetensors` or `onnx`.
    pub format: String,
    /// GGUF quantization to pick, matched exactly (`Q4_K_M`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    /// Files to fetch, relative to the source; empty: what the format needs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
    /// Pin an engine id (`llama_cpp`); never overridden.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// What the model is served for (`completion`, `embedding`, `transcription`, ...): only a
    /// plugin that declares each of them serves it. Empty: not checked (the engine's report
    /// at load decides the routes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub modalities: Vec<String>,
    /// Per-sequence context length; 0 or absent = the model's trained length, capped at 8192.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u32>,
    /// Sequences decoded together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_size: Option<u32>,
    /// Engine threads for this model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    /// GPUs to spread the model over (CUDA nodes); absent = 1. Without `devices` the node
    /// picks the ones with the most free memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
    /// Pinned devices (CUDA ordinals as the node process sees them, after
    /// `CUDA_VISIBLE_DEVICES`), main device first; empty = automatic pick.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<u32>,
    /// Engine instances of this model on this node (seed 001: replicas with round-robin);
    /// absent = 1. On a CUDA node each replica gets its own `gpus` devices (pinned
    /// `devices` are split among the replicas in order); requests go to the replicas in turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// Overrides the model's own chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// Request deadline in seconds (0 = none); a request may ask for less, or more up to `maxRequestTimeoutSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_timeout_seconds: Option<u64>,
    /// The most a request may ask for with `timeout` (0 = unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_request_timeout_seconds: Option<u64>,
    #[serde(default)]
    pub load: LoadPolicy,
    /// Speculative decoding; absent = prompt lookup with the defaults.
    #[serde(default, skip_serializing_if = "SpeculationConfig::is_default")]
    pub speculation: SpeculationConfig,
    /// LoRA adapters served on top of this model, each under its own model id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<AdapterConfig>,
    /// Speech recognition at `temperature` 0: a window whose answer repeats itself or that the
    /// model doubts is decoded again at higher temperatures, and a window of silence gives no
    /// segment, as openai-whisper and faster-whisper do (OpenAI's "increase the temperature
    /// until certain thresholds are hit"). Absent = on; `false` = plain greedy decoding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_fallback: Option<bool>,
}

impl ModelConfig {
    /// The local path the artifacts are at. `file://` sources are local
    /// (a mounted PVC arrives as `file:///models/claim/path`); downloading
    /// sources need the model store and are refused with that reason.
    pub fn local_path(&self) -> Result<PathBuf, ConfigError> {
        match (&self.path, &self.source) {
            (Some(p), None) => Ok(p.clone()),
            (None, Some(uri)) => match Source::parse_on_node(uri) {
                Ok(Source::File { path }) => Ok(path),
                Ok(_) => Err(ConfigError::Invalid {
                    field: format!("models[{}].source", self.id),
                    reason: format!("{uri:?} is not a local path; the model store downloads it"),
                }),
                Err(e) => Err(ConfigError::Invalid {
                    field: format!("models[{}].source", self.id),
                    reason: e.to_string(),
                }),
            },
            (Some(_), Some(_)) => Err(ConfigError::Invalid {
                field: format!("models[{}]", self.id),
                reason: "give `path` or `source`, not both".into(),
            }),
            (None, None) => Err(ConfigError::Invalid {
                field: format!("models[{}]", self.id),
                reason: "needs `path` or `source`".into(),
            }),
        }
    }

    /// Whether the model store downloads this model's artifacts first.
    pub fn is_remote(&self) -> bool {
        self.path.is_none()
            && self
                .source
                .as_deref()
                .and_then(|s| Source::parse_on_node(s).ok())
                .is_some_and(|s| s.is_remote())
    }

    /// Whether the model store downloads anything of this model: its artifacts or an adapter's.
    pub fn downloads(&self) -> bool {
        self.is_remote() || self.adapters.iter().any(AdapterConfig::is_remote)
    }

    pub fn format(&self) -> Result<Format, ConfigError> {
        Format::parse(&self.format).ok_or_else(|| ConfigError::Invalid {
            field: format!("models[{}].format", self.id),
            reason: format!(
                "must be `gguf`, `safetensors` or `onnx`, got {:?}",
                self.format
            ),
        })
    }

    pub fn request_timeout(&self, defaults: &SchedulerConfig) -> Option<Duration> {
        match self
            .request_timeout_seconds
            .unwrap_or(defaults.request_timeout_seconds)
        {
            0 => None,
            s => Some(Duration::from_secs(s)),
        }
    }
}

/// Scheduler and watchdog settings; defaults are the specification's numbers.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Request deadline (seconds, 0 = none).
    pub request_timeout_seconds: u64,
    /// A stream that got its first token and then none for this long is ended.
    pub stall_timeout_seconds: u64,
    /// An engine step slower than this marks the engine hung (`/healthz` fails).
    pub step_timeout_seconds: u64,
    /// Most prompt tokens fed per step across prefilling sequences.
    pub prefill_chunk_tokens: u32,
    /// Share of RAM for the temperature-0 response cache (0 disables it).
    pub response_cache_ram_fraction: f64,
    /// Seconds to let in-flight streams finish after SIGTERM.
    pub shutdown_grace_seconds: u64,
    /// Threads per engine (0 = all cores).
    pub threads: u32,
    /// Where the memory policy starts unloading idle models and refuses loads, in percent of
    /// the node's memory budget (50-99; a ModelPool's `memoryWatermarkPercent`).
    pub memory_watermark_percent: u64,
}

impl SchedulerConfig {
    /// Whether every setting is the default (the operator renders no `scheduler` block then).
    pub fn is_default(&self) -> bool {
        self == &Self::default()
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            request_timeout_seconds: 30,
            stall_timeout_seconds: 5,
            step_timeout_seconds: 30,
            prefill_chunk_tokens: 512,
            response_cache_ram_fraction: 0.05,
            shutdown_grace_seconds: 30,
            threads: 0,
            memory_watermark_percent: 90,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: String, reason: String },
}

/// The hash that names one node config file: the first 16 hex digits of the sha256 of its
/// bytes. The node reports the hash of the file it runs (`/v1/status` `configHash`); the
/// operator computes the same over the YAML it renders, so the two compare byte for byte.
pub fn config_hash(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(&sha2::Sha256::digest(bytes)[..8])
}

impl NodeConfig {
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let bytes = std::fs::read(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml(&bytes, path)
    }

    /// Parse and validate the bytes of the config file at `path` (named in errors).
    pub fn from_yaml(bytes: &[u8], path: &Path) -> Result<Self, ConfigError> {
        let cfg: NodeConfig =
            serde_yaml::from_slice(bytes).map_err(|source| ConfigError::Parse {
                path: path.to_path_buf(),
                source,
            })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Rules that the YAML shape cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: String, reason: String| Err(ConfigError::Invalid { field, reason });
        let mut seen = std::collections::HashSet::new();
        for m in &self.models {
            if m.id.trim().is_empty() {
                return invalid("models[].id".into(), "must not be empty".into());
            }
            if !seen.insert(m.id.as_str()) {
                return invalid(format!("models[{}].id", m.id), "appears twice".into());
            }
            m.format()?;
            if m.path.is_some() == m.source.is_some() {
                m.local_path()?;
            }
            if let Some(uri) = &m.source {
                Source::parse_on_node(uri).map_err(|e| ConfigError::Invalid {
                    field: format!("models[{}].source", m.id),
                    reason: e.to_string(),
                })?;
            }
            for f in &m.files {
                check_relative_file(f).map_err(|reason| ConfigError::Invalid {
                    field: format!("models[{}].files", m.id),
                    reason,
                })?;
            }
            if m.max_batch_size == Some(0) {
                return invalid(
                    format!("models[{}].maxBatchSize", m.id),
                    "must be >= 1".into(),
                );
            }
            if m.gpus == Some(0) {
                return invalid(
                    format!("models[{}].gpus", m.id),
                    "must be >= 1 (leave it out on CPU nodes)".into(),
                );
            }
            let mut pinned = m.devices.clone();
            pinned.sort_unstable();
            if pinned.windows(2).any(|w| w[0] == w[1]) {
                return invalid(
                    format!("models[{}].devices", m.id),
                    format!("lists a device twice: {:?}", m.devices),
                );
            }
            let replicas = m.replicas.unwrap_or(1);
            if !(1..=MAX_REPLICAS).contains(&replicas) {
                return invalid(
                    format!("models[{}].replicas", m.id),
                    format!("must be within [1, {MAX_REPLICAS}], got {replicas}"),
                );
            }
            if !m.devices.is_empty() && !m.devices.len().is_multiple_of(replicas as usize) {
                return invalid(
                    format!("models[{}].devices", m.id),
                    format!(
                        "pins {} device(s), which cannot be split evenly among {replicas} replicas",
                        m.devices.len()
                    ),
                );
            }
            if let Some(g) = m.gpus
                && !m.devices.is_empty()
                && m.devices.len() < (g * replicas) as usize
            {
                return invalid(
                    format!("models[{}].devices", m.id),
                    format!(
                        "pins {} device(s) but {replicas} replica(s) of {g} GPU(s) need {}",
                        m.devices.len(),
                        g * replicas
                    ),
                );
            }
            if let Some((field, reason)) = m.speculation.check() {
                return invalid(format!("models[{}].speculation.{field}", m.id), reason);
            }
            if let Some((field, reason)) = adapter::check_list(&m.adapters) {
                return invalid(format!("models[{}].{field}", m.id), reason);
            }
        }
        // A draft model is another model. One this config does not serve is not an error here:
        // the model then loads without drafts and its status says why, so a pool whose member
        // names a missing draft keeps serving every model.
        for m in &self.models {
            if m.speculation.draft_model.as_deref() == Some(m.id.as_str()) {
                return invalid(
                    format!("models[{}].speculation.draftModel", m.id),
                    "names the model itself".into(),
                );
            }
        }
        // Every served id (models and adapters) names one thing.
        let mut ids = std::collections::HashSet::new();
        for m in &self.models {
            ids.insert(m.id.clone());
        }
        for m in &self.models {
            for a in &m.adapters {
                let id = a.model_id(&m.id);
                if !ids.insert(id.clone()) {
                    return invalid(
                        format!("models[{}].adapters[{}]", m.id, a.name),
                        format!("serves as {id:?}, which another model or adapter already is"),
                    );
                }
            }
        }
        let s = &self.scheduler;
        if !(50..=99).contains(&s.memory_watermark_percent) {
            return invalid(
                "scheduler.memoryWatermarkPercent".into(),
                format!(
                    "must be within [50, 99], got {}",
                    s.memory_watermark_percent
                ),
            );
        }
        if s.prefill_chunk_tokens == 0 {
            return invalid("scheduler.prefillChunkTokens".into(), "must be >= 1".into());
        }
        if !(0.0..=0.5).contains(&s.response_cache_ram_fraction) {
            return invalid(
                "scheduler.responseCacheRamFraction".into(),
                format!(
                    "must be within [0, 0.5], got {}",
                    s.response_cache_ram_fraction
                ),
            );
        }
        Ok(())
    }

    /// The single-model shorthand: `--model PATH` (format from the file name).
    pub fn single(path: &Path, id: Option<String>) -> Result<Self, ConfigError> {
        let format = if path.is_dir() || path.extension().is_some_and(|e| e == "safetensors") {
            "safetensors"
        } else if path.extension().is_some_and(|e| e == "gguf") {
            "gguf"
        } else if path.extension().is_some_and(|e| e == "onnx") {
            "onnx"
        } else {
            return Err(ConfigError::Invalid {
                field: "--model".into(),
                reason: format!(
                    "{} is neither a .gguf or .onnx file nor a model directory",
                    path.display()
                ),
            });
        };
        let id = id.unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
        let cfg = NodeConfig {
            models: vec![ModelConfig {
                id,
                path: Some(path.to_path_buf()),
                format: format.into(),
                ..ModelConfig::default()
            }],
            ..NodeConfig::default()
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests;
