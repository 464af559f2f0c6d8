//! Custom resources, `Model` (namespaced): the types the read step deserializes and the status
//! step writes; `crdgen` turns them into the CRD YAML.
//!
//! Every field carries a doc comment because it becomes the schema
//! `description` that `kubectl explain model.spec...` prints. What the
//! apiserver can check at admission lives here as schema validation
//! (enums, patterns, ranges, CEL); the validate step re-checks the rest.
//!
//! This file holds the spec; its children hold `status` (`model/status.rs`), the LoRA
//! adapters of both (`model/adapter.rs`) and speculative decoding (`model/speculation.rs`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::schema::{adapter_list_schema, quantity_schema};

mod adapter;
mod speculation;
mod status;
pub use adapter::{
    ADAPTER_NAME_PATTERN, ADAPTER_NOT_BASE_RULE, ADAPTER_SERVED_NAMES_RULE, Adapter, AdapterSource,
    AdapterState, AdapterStatus, MAX_ADAPTER_SCALE, MAX_ADAPTERS,
};
pub use speculation::{Speculation, SpeculationMethod};
pub use status::{
    AutoscalingStatus, CandidateRejection, DownloadStatus, DraftStatus, ModelStatus, PoolPlacement,
    ReplicaStatus, ResolvedEngine,
};

/// `source.uri` pattern: one alternative per supported scheme.
pub const SOURCE_URI_PATTERN: &str = r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?|https://[^\s/]+(/\S*)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/\S+|file:///\S+|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\S*)?)$";
/// OpenAI model ids as Gantry accepts them: no spaces or slashes-only names.
pub const SERVED_NAME_PATTERN: &str = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$";
/// Engine ids (the plugin manifest `id`), e.g. `llama_cpp`.
pub const ENGINE_ID_PATTERN: &str = r"^[a-z0-9][a-z0-9_-]{0,62}$";
/// Architecture names as GGUF `general.architecture` / `config.json` `architectures` spell them.
pub const ARCHITECTURE_PATTERN: &str = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$";
/// Extended resource names such as `nvidia.com/gpu` or `amd.com/gpu`.
pub const GPU_RESOURCE_PATTERN: &str = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$";
/// A Model's name names its Service, so it must be a DNS-1035 label.
pub const MODEL_NAME_RULE: &str =
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63";

/// HPA mode needs `replicas.min >= 1`: `minReplicas: 0` needs the alpha `HPAScaleToZero` gate.
pub const HPA_MIN_RULE: &str = "!has(self.autoscaling) || !has(self.autoscaling.mode) || self.autoscaling.mode != 'HPA' || !has(self.replicas) || !has(self.replicas.min) || self.replicas.min >= 1";

/// A model served by Gantry: its weights, the engine that runs them and the
/// node pods that serve them behind one OpenAI-compatible endpoint.
// kube's printcolumn(...) repeats `type_ = ...` by design; clippy reads that as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "gantry.dev",
    version = "v1alpha1",
    kind = "Model",
    namespaced,
    status = "ModelStatus",
    derive = "PartialEq",
    shortname = "gm",
    category = "gantry",
    doc = "A model served by Gantry: where its weights come from, which engine runs them and how many node pods serve it. The operator owns a ConfigMap, a Deployment of node pods, a Service and (when replicas.min > 1) a PodDisruptionBudget for each Model.",
    validation = Rule::new(MODEL_NAME_RULE).message("metadata.name must be a DNS-1035 label of at most 63 characters (it names the Model's Service)"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status", description = "Whether the model answers requests"),
    printcolumn(name = "Format", type_ = "string", json_path = ".spec.format", description = "Weight format"),
    printcolumn(name = "Engine", type_ = "string", json_path = ".status.engine.id", description = "Resolved engine id"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".status.replicas.ready", description = "Ready node pods"),
    printcolumn(name = "Endpoint", type_ = "string", json_path = ".status.endpoint", description = "In-cluster OpenAI base URL", priority = 1),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.replicas.desired", description = "Node pods wanted now", priority = 1),
    printcolumn(name = "Scaling", type_ = "string", json_path = ".status.autoscaling.reason", description = "Reason of the autoscaler's last decision", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(HPA_MIN_RULE).message("replicas.min must be >= 1 with autoscaling.mode HPA: a HorizontalPodAutoscaler cannot scale to zero (use mode Builtin for min 0)"))]
#[x_kube(validation = Rule::new(ADAPTER_NOT_BASE_RULE).message("spec.adapters[].servedName must not be the Model's spec.servedName"))]
pub struct ModelSpec {
    /// Where the weights come from.
    pub source: ModelSource,
    /// Weight file format. Fixed when the Model is created: to change it, create a new Model.
    #[x_kube(validation = Rule::new("self == oldSelf").message("format is immutable; create a new Model to change it"))]
    pub format: ModelFormat,
    /// The OpenAI model id clients send in `model`. Defaults to the Model's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = SERVED_NAME_PATTERN))]
    pub served_name: Option<String>,
    /// The model architecture (GGUF `general.architecture`, e.g. `gemma3`, or the first `config.json` `architectures` class, e.g. `LlamaForCausalLM`).
    /// Optional: when unset the operator mounts every plugin that fits format, backend and pin, and
    /// learns the architecture from the first node pod's status report. Setting it selects the engine
    /// before any pod starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = ARCHITECTURE_PATTERN))]
    pub architecture: Option<String>,
    /// Pin the engine id (an EnginePlugin `engineId`, e.g. `llama_cpp`). A pin is never overridden:
    /// if the pinned engine cannot serve the model, the Model stays unresolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = ENGINE_ID_PATTERN))]
    pub engine: Option<String>,
    /// What the model is served for (`completion`, `embedding`, `transcription`, ...). Only an
    /// EnginePlugin that declares each of them in its `modalities` is chosen; the others are
    /// listed in the status with reason `modality`. Unset: not checked, and the routes follow
    /// what the engine reports once the model is loaded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 6))]
    pub modalities: Vec<crate::engine_plugin::Modality>,
    /// Compute resources of each node pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ModelResources>,
    /// Where node pods may run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduling: Option<Scheduling>,
    /// Bounds on the number of node pods. Without autoscaling the Deployment runs `min` pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Replicas>,
    /// Autoscaling targets within `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// How node pods are replaced when their template changes (a new node image, engine plugin
    /// or config). Default `Surge`: a new pod starts before an old one goes, so a Model never
    /// drops to zero ready pods, at the cost of room (a spare GPU) for one more pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
    /// Settings passed to the engine when the model is loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_config: Option<EngineConfig>,
    /// The volume node pods download weights into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<Cache>,
    /// When the node loads the model: `eager` at start-up (the pod is ready only once loaded) or `lazy` on the first request.
    /// Members of a pool always load lazily.
    #[serde(default)]
    pub load: LoadPolicy,
    /// Join the ModelPool of this name in the Model's namespace instead of getting node pods of
    /// its own. The pool's pods serve it beside the other members; `resources`, `scheduling`,
    /// `replicas`, `autoscaling`, `rollout` and `cache` belong to the pool then (only
    /// `resources.memory`, the memory the model needs once loaded, may stay: the pool refuses a
    /// member that can never fit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = POOL_NAME_PATTERN))]
    pub pool: Option<String>,
    /// LoRA adapters served on top of the weights, each under a model id of its own
    /// (`<servedName>:<name>`, or its `servedName`), at most 64. Requests for an adapter go to
    /// the Model's node pods, which apply it to the base model per request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "adapter_list_schema")]
    pub adapters: Vec<Adapter>,
}

/// `spec.pool`: a ModelPool name.
pub const POOL_NAME_PATTERN: &str = r"^[a-z]([-a-z0-9]*[a-z0-9])?$";

/// Where the weights come from.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// Location of the weights. Schemes: `hf://org/repo[@revision]` (Hugging Face),
    /// `https://host/path`, `pvc://claim/path` (a PersistentVolumeClaim in the Model's namespace,
    /// mounted read-only), `file:///path` (inside the node container), `s3://bucket/prefix`.
    #[schemars(regex(pattern = SOURCE_URI_PATTERN), length(max = 2048))]
    pub uri: String,
    /// Files to fetch from the source, relative to it. Empty: the node picks what the format needs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub files: Vec<String>,
    /// GGUF quantization to pick from a repository holding several, matched exactly against the
    /// file name (e.g. `Q4_K_M`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[A-Za-z0-9_.-]{1,32}$"))]
    pub quantization: Option<String>,
    /// Secret holding a token for the source (Hugging Face or HTTP bearer token). Passed to the
    /// node as `GANTRY_SOURCE_TOKEN` (and `HF_TOKEN` for `hf://`). For `s3://` the whole Secret
    /// also becomes the node's environment: keys `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    /// optional `AWS_SESSION_TOKEN`, `AWS_ENDPOINT_URL`, `AWS_REGION`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
}

/// A key of a Secret in the Model's namespace.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
        length(max = 253)
    )]
    pub name: String,
    /// Key inside the Secret. Defaults to `token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[-._a-zA-Z0-9]{1,253}$"))]
    pub key: Option<String>,
}

/// Weight file formats. There is never a fallback from one format to another.
#[derive(JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelFormat {
    /// A single GGUF file (llama.cpp and compatible engines).
    Gguf,
    /// Hugging Face safetensors with `config.json`.
    Safetensors,
    /// An ONNX graph with its config beside it (a Piper voice: `<name>.onnx` and
    /// `<name>.onnx.json`), for the ONNX Runtime engine.
    Onnx,
}

impl ModelFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelFormat::Gguf => "gguf",
            ModelFormat::Safetensors => "safetensors",
            ModelFormat::Onnx => "onnx",
        }
    }
}

/// Compute resources of each node pod.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelResources {
    /// GPUs per node pod (requests = limits). 0 runs on CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 16))]
    pub gpus: Option<i32>,
    /// Extended resource name of the GPUs. Defaults to the operator's setting (`nvidia.com/gpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = GPU_RESOURCE_PATTERN), length(max = 253))]
    pub gpu_resource_name: Option<String>,
    /// Memory per node pod, requested and limited (e.g. `8Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub memory: Option<Quantity>,
    /// CPU per node pod, requested (not limited, to avoid throttling token generation), e.g. `4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub cpu: Option<Quantity>,
}

/// Where node pods may run (copied to the pod template).
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Scheduling {
    /// Node labels a node must carry to run a node pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of the node pods (e.g. for tainted GPU nodes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Affinity and anti-affinity of the node pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// RuntimeClass of the node pods (e.g. `nvidia`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
        length(max = 253)
    )]
    pub runtime_class_name: Option<String>,
}

/// Bounds on the number of node pods.
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.min <= self.max").message("replicas.min must be <= replicas.max"))]
pub struct Replicas {
    /// Fewest node pods. 0 is allowed: the gateway holds requests while the first pod starts.
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 1000))]
    pub min: i32,
    /// Most node pods.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 1000))]
    pub max: i32,
}

fn one() -> i32 {
    1
}

impl Default for Replicas {
    fn default() -> Self {
        Replicas { min: 1, max: 1 }
    }
}

/// `rollout.maxSurge` belongs to the `Surge` strategy, `rollout.maxUnavailable` to `InPlace`.
pub const ROLLOUT_SURGE_RULE: &str =
    "!has(self.maxSurge) || !has(self.strategy) || self.strategy == 'Surge'";
pub const ROLLOUT_IN_PLACE_RULE: &str =
    "!has(self.maxUnavailable) || (has(self.strategy) && self.strategy == 'InPlace')";

/// How node pods are replaced when their template changes.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(ROLLOUT_SURGE_RULE).message("rollout.maxSurge applies only to strategy Surge"))]
#[x_kube(validation = Rule::new(ROLLOUT_IN_PLACE_RULE).message("rollout.maxUnavailable applies only to strategy InPlace"))]
pub struct Rollout {
    /// `Surge` (default): start new pods first and remove old ones once the new are ready; no
    /// downtime, but each surge pod needs the Model's full resources (GPUs included) while the
    /// old pods still hold theirs — it stays Pending, and the rollout waits, without a spare
    /// GPU or with the namespace's GPU quota used up. `InPlace`: remove old pods first; no extra
    /// GPU, but a Model with one replica serves nothing until its new pod is ready.
    #[serde(default)]
    pub strategy: RolloutStrategy,
    /// `Surge` only: pods started above the current count at once. Defaults to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_surge: Option<i32>,
    /// `InPlace` only: pods removed at once before their replacements start. Defaults to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_unavailable: Option<i32>,
}

/// The rollout strategy of a Model's node pods.
#[derive(JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RolloutStrategy {
    /// New pods first (no downtime; needs room for `maxSurge` more pods).
    #[default]
    Surge,
    /// Old pods first (no extra GPU; a single replica is down during the rollout).
    InPlace,
}

impl RolloutStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            RolloutStrategy::Surge => "Surge",
            RolloutStrategy::InPlace => "InPlace",
        }
    }
}

/// Autoscaling targets. The built-in autoscaler scales the Deployment within `replicas`.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Autoscaling {
    /// `Builtin`: the operator scales from the node pods' metrics. `HPA`: an autoscaling/v2
    /// HorizontalPodAutoscaler on the same metrics (needs a metrics adapter).
    #[serde(default)]
    pub mode: AutoscalingMode,
    /// Waiting requests per node pod to aim for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub target_queue_depth: Option<i32>,
    /// VRAM / KV-cache utilization per node pod to aim for, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub target_vram_utilization: Option<i32>,
    /// Seconds the desired replica count must stay lower before scaling down. Defaults to 300.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_down_stabilization_seconds: Option<i32>,
    /// With `replicas.min: 0` (Builtin mode only): seconds without a waiting or running request
    /// before the last node pod is removed. Defaults to 600.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub scale_to_zero_after_seconds: Option<i32>,
}

/// Who scales the node pods.
#[derive(JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AutoscalingMode {
    /// The operator's built-in autoscaler (default).
    #[default]
    Builtin,
    /// A HorizontalPodAutoscaler.
    #[serde(rename = "HPA")]
    Hpa,
}

impl AutoscalingMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AutoscalingMode::Builtin => "Builtin",
            AutoscalingMode::Hpa => "HPA",
        }
    }
}

/// Settings passed to the engine when the model is loaded.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EngineConfig {
    /// Context length in tokens. Defaults to the model's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1048576))]
    pub context_length: Option<i32>,
    /// Most sequences in one batch step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_batch_size: Option<i32>,
    /// CPU threads the engine uses. Defaults to the engine's choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub threads: Option<i32>,
    /// Speculative decoding. Defaults to prompt lookup (drafts copied from the prompt and the
    /// text so far, verified in one engine step) where the engine supports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<Speculation>,
    /// Speech recognition at temperature 0: a window whose text repeats itself or whose
    /// tokens the model doubts is decoded again at higher temperatures, and a silent window
    /// gives no text, as OpenAI's API and openai-whisper do. Defaults to on; `false` decodes
    /// each window once, greedily. Only for Models that declare the `transcription` modality
    /// or declare none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_fallback: Option<bool>,
}

/// The volume node pods download weights into.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.type != 'PersistentVolumeClaim' || has(self.size)").message("cache.size is required when cache.type is PersistentVolumeClaim"))]
pub struct Cache {
    /// `EmptyDir` (default): per pod, lost with the pod. `PersistentVolumeClaim`: one claim the
    /// operator creates and every node pod of this Model mounts.
    #[serde(default, rename = "type")]
    pub type_: CacheType,
    /// Claim size, or the emptyDir size limit (e.g. `20Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub size: Option<Quantity>,
    /// StorageClass of the claim. Defaults to the cluster's default class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
        length(max = 253)
    )]
    pub storage_class: Option<String>,
    /// Access mode of the claim. `ReadWriteOnce` (default) keeps all node pods of this Model on one
    /// node; use `ReadWriteMany` when `replicas.max > 1` spans nodes.
    #[serde(default)]
    pub access_mode: CacheAccessMode,
}

/// Kind of cache volume.
#[derive(JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CacheType {
    /// An emptyDir per pod.
    #[default]
    EmptyDir,
    /// One PersistentVolumeClaim shared by the Model's node pods.
    PersistentVolumeClaim,
}

/// PersistentVolumeClaim access modes usable for the cache.
#[derive(JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CacheAccessMode {
    /// Mounted read-write by one node.
    #[default]
    ReadWriteOnce,
    /// Mounted read-write by many nodes.
    ReadWriteMany,
}

impl CacheAccessMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheAccessMode::ReadWriteOnce => "ReadWriteOnce",
            CacheAccessMode::ReadWriteMany => "ReadWriteMany",
        }
    }
}

/// When the node loads the model.
#[derive(JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadPolicy {
    /// At start-up; the pod turns ready once the model is loaded.
    #[default]
    Eager,
    /// On the first request.
    Lazy,
}

impl LoadPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            LoadPolicy::Eager => "eager",
            LoadPolicy::Lazy => "lazy",
        }
    }
}
