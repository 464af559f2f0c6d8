//! The node status document (node `/v1/status` → operator status step): what the node's engine
//! registry, model store and scheduler report, and what the operator folds into `Model` and
//! `EnginePlugin` status. Both sides use these exact types so the document cannot drift.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Why one candidate plugin cannot serve a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rejection {
    /// Plugin id (or the manifest path when the manifest could not be read).
    pub plugin: String,
    /// Stable machine-readable kind: `format`, `modality`, `architecture`, `backend`,
    /// `abi`, `pin`, `load_error`.
    pub kind: RejectionKind,
    /// Human-readable reason.
    pub reason: String,
}

/// Stable categories of rejection, used as status reasons by the node and in `Model` status.
#[derive(JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectionKind {
    /// The plugin does not read the model's format.
    Format,
    /// The plugin does not serve a modality the model is for.
    Modality,
    /// The plugin does not list the model's architecture.
    Architecture,
    /// The plugin is built for another GPU backend.
    Backend,
    /// The plugin's ABI is not the node's.
    Abi,
    /// The model is pinned to another engine.
    Pin,
    /// The plugin is not usable (invalid, shadowed or failed to load).
    LoadError,
}

/// The registry's answer for one model: supported by one plugin, or not
/// supported with every candidate's reason. There is no third state and no
/// fallback to another format or engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "camelCase")]
pub enum EngineVerdict {
    #[serde(rename_all = "camelCase")]
    Supported { plugin: String, version: String },
    #[serde(rename_all = "camelCase")]
    Unsupported { rejections: Vec<Rejection> },
}

impl EngineVerdict {
    pub fn is_supported(&self) -> bool {
        matches!(self, EngineVerdict::Supported { .. })
    }
}

/// Path of the node's status document.
pub const NODE_STATUS_PATH: &str = "/v1/status";

/// The node's status document (`GET /v1/status`): what the operator reads to
/// fill `Model` and `EnginePlugin` status, and what people read when debugging.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// `gantry-node` version.
    pub version: String,
    /// Compute backend of this node: `cpu` or `cuda`.
    pub backend: String,
    /// Same answer as `/readyz`.
    pub ready: bool,
    /// SIGTERM received: finishing in-flight work, refusing new requests.
    pub draining: bool,
    pub plugins: Vec<PluginStatus>,
    pub models: Vec<ModelStatus>,
    /// The GPUs this node process sees (after `CUDA_VISIBLE_DEVICES`), read through the
    /// CUDA driver; empty on a machine without one, which is a normal state.
    #[serde(default)]
    pub devices: Vec<DeviceStatus>,
    /// Why `devices` is empty (no CUDA driver, no device, a driver error); absent when
    /// devices were found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices_note: Option<String>,
    /// The memory the node's policy budgets its models against; absent from nodes that
    /// predate it. The gateway sends a model no replica has loaded to the replica with the
    /// most room.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStatus>,
    /// The hash of the config file the node runs ([`crate::config::config_hash`] of its
    /// bytes): the one read at start, then the last one a reload applied (a refused file does
    /// not change it). Absent on a node started without `--config`. The operator compares it
    /// with the hash of the YAML it rendered to know the node picked up its model list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hash: Option<String>,
    /// Node-wide settings (`scheduler.*`, `cacheDir`) that the running config file changed but
    /// that apply only at the next start, as dotted camelCase paths; the node keeps the values
    /// it started with meanwhile. Empty when the file's settings are the ones in force.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restart_required: Vec<String>,
}

/// The memory pool the node's load policy watches (VRAM on a CUDA node, RAM on a CPU node): the
/// same figures as the `gantry_memory_used_bytes` / `gantry_memory_limit_bytes` gauges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemoryStatus {
    /// `vram` or `ram`.
    pub pool: String,
    /// The budget; 0 when the pool has no limit.
    pub limit_bytes: u64,
    /// Where loads start unloading idle models or are refused (90 % of the budget); absent
    /// without a limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watermark_bytes: Option<u64>,
    /// What the loaded models hold.
    pub used_bytes: u64,
    /// Models unloaded by the memory policy to make room, since the node started (the
    /// `reason="*_watermark"` part of `gantry_model_unloads_total`).
    #[serde(default)]
    pub evictions_total: u64,
    /// Model loads refused because they could not fit, since the node started
    /// (`gantry_model_load_refusals_total`). With `evictionsTotal`, the pressure a pool's
    /// autoscaler counts per minute.
    #[serde(default)]
    pub refusals_total: u64,
}

impl MemoryStatus {
    /// Bytes a new model can take before the watermark; `u64::MAX` when the pool has no limit.
    pub fn room_bytes(&self) -> u64 {
        self.watermark_bytes
            .map_or(u64::MAX, |w| w.saturating_sub(self.used_bytes))
    }
}

/// One GPU as the node last read it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceStatus {
    /// CUDA ordinal in this process (what engines and `gpus`/`devices` in the model
    /// config name); `CUDA_VISIBLE_DEVICES` renumbers from 0.
    pub index: u32,
    /// `GPU-xxxxxxxx-...`, as `nvidia-smi -L` prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    pub name: String,
    /// `major.minor`, e.g. `9.0` for an H100.
    pub compute_capability: String,
    pub total_bytes: u64,
    /// Free on the device, whoever holds the rest (this node, other processes).
    pub free_bytes: u64,
    /// GPU busy share over the last sample period (NVML; absent without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_percent: Option<u32>,
    /// Device memory this node process holds (NVML; absent without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_used_bytes: Option<u64>,
    /// Models placed on this device.
    #[serde(default)]
    pub models: Vec<String>,
}

/// What a node knows about its GPUs at one moment: filled by the engine host's CUDA probe (or a
/// recorded fixture), read by the node's memory policy and `/v1/status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceSnapshot {
    /// Where the figures come from: `cuda` (driver API), `cuda+nvml`, `none`, or a fixture's name.
    pub source: String,
    /// The CUDA driver's version, e.g. `12.8`, when a driver was found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    pub devices: Vec<DeviceStatus>,
    /// Why there are no devices (no driver library, no device, a driver error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl DeviceSnapshot {
    /// The state of a machine without GPUs, and why.
    pub fn none(note: impl Into<String>) -> Self {
        Self {
            source: "none".into(),
            driver_version: None,
            devices: Vec::new(),
            note: Some(note.into()),
        }
    }

    pub fn device(&self, index: u32) -> Option<&DeviceStatus> {
        self.devices.iter().find(|d| d.index == index)
    }

    /// Free bytes on the given devices (all of them when `on` is empty).
    pub fn free_on(&self, on: &[u32]) -> u64 {
        self.devices
            .iter()
            .filter(|d| on.is_empty() || on.contains(&d.index))
            .map(|d| d.free_bytes)
            .sum()
    }

    /// The snapshot with `models` recorded on the devices that hold them.
    pub fn with_models(mut self, placed: &std::collections::BTreeMap<String, Vec<u32>>) -> Self {
        for d in &mut self.devices {
            d.models = placed
                .iter()
                .filter(|(_, on)| on.contains(&d.index))
                .map(|(id, _)| id.clone())
                .collect();
        }
        self
    }
}

/// One discovered plugin and whether it loaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginStatus {
    pub id: String,
    pub version: Option<String>,
    pub abi_version: Option<String>,
    pub gpu_backend: Option<String>,
    /// How the loaded library uses the hardware, e.g. the CPU variant it runs and its
    /// SIMD extensions (engine ABI 1.3); absent when the plugin does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_info: Option<String>,
    pub loaded: bool,
    /// Where its code runs: `inProcess`, or `process` (a worker process per loaded model).
    #[serde(default = "in_process")]
    pub isolation: String,
    /// Stable reason label when refused (`abi_mismatch`, `id_conflict`,
    /// `binary_not_found`, `sha256_mismatch`, `gpu_backend_mismatch`, ...).
    pub reason: Option<String>,
    /// Human-readable refusal message.
    pub message: Option<String>,
    /// The last change of its library the node saw while running (hot reload): applied, or
    /// refused with the old version still serving. Absent when it never changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update: Option<PluginUpdate>,
}

/// A plugin library that changed under a running node (`process` isolation reloads it by
/// shadow load; an in-process plugin waits for a restart).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginUpdate {
    /// The manifest version of the new library.
    pub version: Option<String>,
    /// `applied` (every model of the plugin switched to it), `refused` (it failed
    /// validation, load or warm-up; the old version keeps serving), or `restartRequired`
    /// (an in-process plugin cannot be replaced in a running node).
    pub state: String,
    pub message: String,
    /// The models moved to the new version (for `applied`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    pub seconds_ago: u64,
}

/// One model assigned to this node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelStatus {
    /// The OpenAI model id.
    pub id: String,
    pub format: String,
    /// From `config.json` or the GGUF header; `None` until artifacts are read.
    pub architecture: Option<String>,
    /// `None` until the architecture is known.
    pub verdict: Option<EngineVerdict>,
    pub artifact: ArtifactStatus,
    pub load: LoadStatus,
    pub queue: QueueStatus,
    /// Devices (CUDA ordinals) the model is placed on, first = main; empty on CPU. With
    /// several replicas, every replica's devices, in replica order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<u32>,
    /// The engine instances of a loaded model (node config `replicas`; requests go to them
    /// in turn): where each runs and what it holds. Empty while the model is not loaded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaStatus>,
    /// Its engine worker's crashes (`process` isolation): how many, the last one, and the
    /// restart. Absent when it never crashed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crashes: Option<CrashStatus>,
    /// How the node chose between several engines that support the model (absent when one
    /// engine supports it, or `engine` pins one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_choice: Option<EngineChoice>,
    /// Its LoRA adapters (node config `adapters`), in config order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<AdapterStatus>,
    /// Its draft model (node config `speculation.method: draftModel`), once the model loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<DraftStatus>,
}

/// A loaded model's draft model for speculative decoding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraftStatus {
    /// The draft model's id in the node config.
    pub model: String,
    /// Every replica drafts with a private instance of it. When false the model decodes
    /// without drafts and `message` says why (the draft failed to load, its tokenizer differs).
    pub active: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// What the draft instances hold, all replicas together (counted in the model's
    /// `load.bytesUsed`).
    pub bytes_used: u64,
}

/// One LoRA adapter of a model on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterStatus {
    /// The adapter's name in the model's `adapters` list.
    pub name: String,
    /// The OpenAI model id it is served under (`<model>:<name>` or its `servedName`).
    pub id: String,
    /// `pending` (waiting for its base model or its download), `downloaded` (artifacts on
    /// disk, not in memory), `loaded` (in the engine, requests use it at once), or `refused`
    /// (download failed, or the engine refused it: `reason` says why; the base keeps serving).
    pub state: AdapterState,
    /// Stable label of a refusal: `download`, `unsupported` (the engine serves no adapters),
    /// `mismatch` (wrong rank, shape or base model), `corrupt`, `memory`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Human-readable detail of a refusal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// What it holds in memory while loaded (all replicas together).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// Where one adapter stands on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum AdapterState {
    Pending,
    Downloaded,
    Loaded,
    Refused,
}

impl AdapterState {
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterState::Pending => "pending",
            AdapterState::Downloaded => "downloaded",
            AdapterState::Loaded => "loaded",
            AdapterState::Refused => "refused",
        }
    }
}

fn in_process() -> String {
    "inProcess".into()
}

/// The node's choice between engines that all support a model: each candidate's bounded
/// benchmark and the rule that picked one (docs/engines.md, "Engine choice by measurement").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineChoice {
    /// The plugin that serves the model.
    pub chosen: String,
    /// The rule, in words.
    pub rule: String,
    /// Every candidate's benchmark, in engine id order.
    pub candidates: Vec<EngineBench>,
}

/// One candidate engine's benchmark for a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineBench {
    /// The engine (plugin manifest `id`).
    pub plugin: String,
    /// The engine's version.
    pub version: String,
    /// `chosen`, `slower` (passed, lost on the rule), `rejected` (over the memory limit) or
    /// `failed` (load or generation failed).
    pub outcome: String,
    /// Decode tokens per second of one greedy sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Time to the first token of the benchmark prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Peak memory of the load: the larger of the engine's report and what the process (or
    /// the device) measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// Why it was rejected or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The figures came from the node's cache (same model fingerprint, engine version and
    /// device), not from a run at this load.
    #[serde(default)]
    pub cached: bool,
}

/// The crashes of a model's engine worker process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CrashStatus {
    /// Crashes since the node started (a signal, an abort, an OOM kill, a watchdog kill).
    pub count: u64,
    /// Crashes in a row without a quiet minute between them (the restart backoff's count).
    pub consecutive: u64,
    /// The plugin that crashed.
    pub plugin: String,
    /// `crashed` (a signal or exit), `hung` (the watchdog killed a step that overran).
    pub reason: String,
    /// The signal that ended the worker (`SIGSEGV`, `SIGABRT`, `SIGKILL`, ...), when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// Its exit code, when it exited instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub message: String,
    /// Seconds since the last crash.
    pub seconds_ago: u64,
    /// Seconds until the next restart while one waits (exponential backoff); 0 when none waits.
    pub restart_in_seconds: u64,
}

/// One engine instance (replica) of a loaded model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// Its place in the round-robin order, from 0.
    pub index: u32,
    /// Devices it runs on, main first; empty on CPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<u32>,
    /// Weights, KV and buffers, as its engine reports them.
    pub bytes_used: u64,
    pub queue: QueueStatus,
    /// The engine worker process serving it (`process` isolation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_pid: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ArtifactState {
    #[default]
    Pending,
    Downloading,
    Ready,
    Failed,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactStatus {
    pub state: ArtifactState,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub bytes_per_second: f64,
    pub message: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LoadState {
    #[default]
    Unloaded,
    Loading,
    Loaded,
    Failed,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadStatus {
    pub state: LoadState,
    pub plugin: Option<String>,
    pub message: Option<String>,
    pub bytes_used: u64,
    /// The fall in the placed devices' free memory across the load, to check the
    /// engine's `bytesUsed` against; absent on CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_vram_bytes: Option<u64>,
    /// Recurrent state (state-space or short-convolution layers) one sequence holds whatever
    /// its length, as the engine reports it (ABI 1.7); absent for a model with K/V only. Such
    /// a model reuses no prefix and is not sped up by drafts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recurrent_state_bytes_per_sequence: Option<u64>,
}

/// Scheduler figures, the same numbers `/metrics` exports as gauges.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueStatus {
    pub waiting: u64,
    pub running: u64,
    pub kv_capacity_tokens: u64,
    pub kv_used_tokens: u64,
    /// Recurrent state the running sequences hold (running × the model's per-sequence state);
    /// absent for a model with K/V only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recurrent_state_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_json_is_tagged_and_camel_case() {
        let v = EngineVerdict::Unsupported {
            rejections: vec![Rejection {
                plugin: "llama_cpp".into(),
                kind: RejectionKind::LoadError,
                reason: "x".into(),
            }],
        };
        let j = serde_json::to_value(&v).expect("json");
        assert_eq!(j["verdict"], "unsupported");
        assert_eq!(j["rejections"][0]["kind"], "load_error");
        let back: EngineVerdict = serde_json::from_value(j).expect("roundtrip");
        assert_eq!(back, v);
        let s = serde_json::to_value(EngineVerdict::Supported {
            plugin: "a".into(),
            version: "1.0.0".into(),
        })
        .expect("json");
        assert_eq!(
            s,
            serde_json::json!({"verdict": "supported", "plugin": "a", "version": "1.0.0"})
        );
    }
}
