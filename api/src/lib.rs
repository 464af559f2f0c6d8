//! Shared wire types (node ⇄ operator): the JSON the node's status endpoint serves and the operator reads.
//!
//! The node's engine registry produces [`EngineVerdict`]s and the operator
//! folds them into `Model` status; both sides use these exact types so the
//! document cannot drift between them. The OpenAI error body ([`openai_error_json`]) lives here
//! too, so the node and the gateway refuse calls in one shape.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// Why one candidate plugin cannot serve a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rejection {
    /// Plugin id (or the manifest path when the manifest could not be read).
    pub plugin: String,
    /// Stable machine-readable kind: `format`, `architecture`, `backend`,
    /// `abi`, `pin`, `load_error`.
    pub kind: RejectionKind,
    /// Human-readable reason.
    pub reason: String,
}

/// Stable categories of rejection, used as status reasons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectionKind {
    Format,
    Architecture,
    Backend,
    Abi,
    Pin,
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
}

/// One discovered plugin and whether it loaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginStatus {
    pub id: String,
    pub version: Option<String>,
    pub abi_version: Option<String>,
    pub gpu_backend: Option<String>,
    pub loaded: bool,
    /// Stable reason label when refused (`abi_mismatch`, `id_conflict`,
    /// `binary_not_found`, `sha256_mismatch`, `gpu_backend_mismatch`, ...).
    pub reason: Option<String>,
    /// Human-readable refusal message.
    pub message: Option<String>,
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
}

/// Scheduler figures, the same numbers `/metrics` exports as gauges.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueStatus {
    pub waiting: u64,
    pub running: u64,
    pub kv_capacity_tokens: u64,
    pub kv_used_tokens: u64,
}

/// Where the operator mounts the node's model config inside a node pod
/// (`gantry-node serve --config ...`).
pub const NODE_CONFIG_PATH: &str = "/etc/gantry/models.yaml";

/// The node's model config file (YAML): which models a node pod serves. The
/// operator renders it into the Model's ConfigMap; the node reads it at start.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeConfig {
    pub models: Vec<ModelConfig>,
    /// Directory downloads go to (the cache volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<String>,
}

/// One model in [`NodeConfig`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelConfig {
    /// The OpenAI model id (the Model's `servedName`).
    pub id: String,
    /// `hf://org/repo[@rev]`, `https://...`, `file:///...`, `s3://...` (a Model's
    /// `pvc://claim/path` arrives here as `file:///models/claim/path`).
    pub source: String,
    /// `gguf` or `safetensors`.
    pub format: String,
    /// GGUF quantization to pick, matched exactly (e.g. `Q4_K_M`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    /// Files to fetch, relative to the source; empty: what the format needs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
    /// Engine pin (an engine id); never overridden.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_size: Option<u32>,
    /// CPU threads for the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    /// `eager` (default) or `lazy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<String>,
}

/// The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`. The node's
/// `ApiError` and the gateway's `GatewayError` both answer with it.
pub fn openai_error_json(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> String {
    #[derive(Serialize)]
    struct Body<'a> {
        error: Inner<'a>,
    }
    #[derive(Serialize)]
    struct Inner<'a> {
        message: &'a str,
        #[serde(rename = "type")]
        kind: &'a str,
        param: Option<&'a str>,
        code: Option<&'a str>,
    }
    serde_json::to_string(&Body {
        error: Inner {
            message,
            kind,
            param,
            code,
        },
    })
    .unwrap_or_else(|_| "{\"error\":{\"message\":\"unserializable error\"}}".into())
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
