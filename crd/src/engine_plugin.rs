//! Custom resources, `EnginePlugin` (cluster-scoped): the types the EnginePlugin reconcile reads
//! and whose status it writes, and that the Model reconcile's engine selection chooses from.

use gantry_api::config::Isolation;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::model::{ENGINE_ID_PATTERN, ModelFormat};
use super::schema::{conditions_schema, isolation_schema};

/// Container image references: `registry/path[:tag][@sha256:digest]`.
pub const IMAGE_PATTERN: &str = r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$";
/// Plugin versions are plain `MAJOR.MINOR.PATCH`, as the plugin manifest requires.
pub const VERSION_PATTERN: &str = r"^[0-9]+\.[0-9]+\.[0-9]+$";
/// Library sha256 pins: 64 lower-case hex digits.
pub const SHA256_PATTERN: &str = r"^[a-f0-9]{64}$";
/// Absolute path inside the plugin image.
pub const LIBRARY_PATH_PATTERN: &str = r"^/[A-Za-z0-9._/-]*$";

/// An engine plugin image: a shared library with the Gantry C ABI (and its manifest) that node
/// pods load to run models. Declaring one makes it a candidate for every Model it fits.
// kube's printcolumn(...) repeats `type_ = ...` by design; clippy reads that as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "gantry.dev",
    version = "v1alpha1",
    kind = "EnginePlugin",
    status = "EnginePluginStatus",
    derive = "PartialEq",
    shortname = "gep",
    category = "gantry",
    doc = "An engine plugin image (a shared library with the Gantry C ABI and its manifest) that node pods can load. Cluster-scoped: every Model it fits may use it.",
    printcolumn(
        name = "Engine",
        type_ = "string",
        json_path = ".spec.engineId",
        description = "Engine id"
    ),
    printcolumn(
        name = "Version",
        type_ = "string",
        json_path = ".spec.version",
        description = "Engine version"
    ),
    printcolumn(
        name = "Backend",
        type_ = "string",
        json_path = ".spec.gpuBackend",
        description = "GPU backend"
    ),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        description = "Spec valid and ABI supported"
    ),
    printcolumn(
        name = "Loaded",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Loaded\")].status",
        description = "Loaded by the node pods that mount it"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EnginePluginSpec {
    /// Image holding the plugin under `libraryPath` (and the `/copy` helper for the InitContainer
    /// strategy). Pin a digest (`...@sha256:...`) for reproducible rollouts.
    #[schemars(regex(pattern = IMAGE_PATTERN), length(max = 512))]
    pub image: String,
    /// Engine id: the plugin manifest's `id` (e.g. `llama_cpp`). Models pin engines by this id.
    #[schemars(regex(pattern = ENGINE_ID_PATTERN))]
    pub engine_id: String,
    /// Engine version, `MAJOR.MINOR.PATCH` (the manifest's `version`).
    #[schemars(regex(pattern = VERSION_PATTERN))]
    pub version: String,
    /// Major version of the Gantry engine ABI the library implements. Accepted only when the
    /// operator's node image supports it.
    #[schemars(range(min = 1, max = 1000))]
    pub abi_version: i32,
    /// Compute backend the library is built for.
    pub gpu_backend: GpuBackend,
    /// Weight formats the engine reads.
    #[schemars(length(min = 1, max = 8))]
    pub formats: Vec<ModelFormat>,
    /// Model architectures the engine runs (GGUF `general.architecture` / the first `config.json` `architectures` class).
    #[schemars(
        length(min = 1, max = 512),
        inner(regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"))
    )]
    pub architectures: Vec<String>,
    /// What the engine produces. Defaults to `completion`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub modalities: Vec<Modality>,
    /// sha256 of the library; node pods refuse a library that does not match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = SHA256_PATTERN))]
    pub sha256: Option<String>,
    /// How node pods get the plugin files: `InitContainer` (default; copies them with the image's
    /// `/copy`, works on every cluster) or `ImageVolume` (mounts the image read-only; needs
    /// Kubernetes image volumes with subPath, 1.33+).
    #[serde(default)]
    pub mount_strategy: MountStrategy,
    /// Directory inside the image holding `manifest.json` and the library.
    /// Defaults to `/engines/{engineId}/{gpuBackend}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = LIBRARY_PATH_PATTERN), length(max = 1024))]
    pub library_path: Option<String>,
    /// Where the node runs this plugin's code: `inProcess` (in the node process: no extra copy
    /// or hop per step, but a crash in the plugin takes down the whole node pod and every model
    /// on it) or `process` (each loaded model in its own `gantry-node engine-worker` process: a
    /// crash or hang ends only that model's worker, which the node restarts with backoff, at
    /// the cost of one extra process per loaded model). Absent: the node's default,
    /// `inProcess`. Changing it restarts the node pods that mount the plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "isolation_schema")]
    pub isolation: Option<Isolation>,
}

impl EnginePluginSpec {
    /// `libraryPath`, or its default.
    pub fn library_path(&self) -> String {
        self.library_path
            .clone()
            .unwrap_or_else(|| format!("/engines/{}/{}", self.engine_id, self.gpu_backend.as_str()))
    }
}

/// Compute backends.
#[derive(
    JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum GpuBackend {
    /// Runs on CPU.
    Cpu,
    /// Runs on NVIDIA GPUs through CUDA.
    Cuda,
}

impl GpuBackend {
    pub fn as_str(self) -> &'static str {
        match self {
            GpuBackend::Cpu => "cpu",
            GpuBackend::Cuda => "cuda",
        }
    }
}

/// What an engine produces.
#[derive(JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Modality {
    /// Text completion and chat.
    Completion,
    /// Embeddings.
    Embedding,
    /// Speech recognition: audio in, text out (`/v1/audio/transcriptions`).
    Transcription,
    /// Speech synthesis: text in, audio out (`/v1/audio/speech`; declared, no engine yet).
    Speech,
    /// Image in, text out (vision-language models; declared, no engine yet).
    Vision,
    /// Text in, image out (declared, no engine yet).
    Image,
}

impl Modality {
    /// The name manifests, node configs and rejections use.
    pub fn as_str(self) -> &'static str {
        match self {
            Modality::Completion => "completion",
            Modality::Embedding => "embedding",
            Modality::Transcription => "transcription",
            Modality::Speech => "speech",
            Modality::Vision => "vision",
            Modality::Image => "image",
        }
    }
}

/// How node pods get the plugin files.
#[derive(JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MountStrategy {
    /// An init container runs the image's `/copy` into a shared emptyDir.
    #[default]
    InitContainer,
    /// The image is mounted as a read-only image volume.
    ImageVolume,
}

/// What the operator observed about the plugin.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnginePluginStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Accepted` (spec valid, ABI supported) and `Loaded` (node pods loaded it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Node pods (`namespace/pod`) that loaded the plugin.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loaded_by: Vec<String>,
    /// Load failures reported by node pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load_errors: Vec<LoadError>,
    /// What the node pods that loaded the plugin run: one row per version and isolation, with
    /// a pod count, sorted by version; at most `MAX_VERSION_ROWS` rows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub versions: Vec<PluginVersion>,
    /// Pods left out of `versions` once it holds its maximum of rows.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub versions_omitted: i32,
    /// Library changes a node pod saw while running and did not apply (`refused`, or
    /// `restartRequired` for an in-process plugin), one per pod, sorted by pod; at most
    /// `MAX_UPDATES`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub updates: Vec<PendingUpdate>,
    /// Pods with such a change left out of `updates`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub updates_omitted: i32,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// Most rows in `status.versions` (the schema's `maxItems` says the same).
pub const MAX_VERSION_ROWS: usize = 10;
/// Most entries in `status.updates` (the schema's `maxItems` says the same).
pub const MAX_UPDATES: usize = 20;

/// Node pods that run one version of the plugin in one isolation mode.
#[derive(KubeSchema, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginVersion {
    /// The manifest version in force, as the node reports it; absent when it reports none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Where the node runs the plugin's code: `inProcess` or `process`.
    pub isolation: String,
    /// How many node pods run it.
    pub pods: i32,
    /// Up to three of those pods (`namespace/pod`), the first by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 3))]
    pub example_pods: Vec<String>,
}

/// A changed plugin library a node pod saw and did not switch to.
#[derive(KubeSchema, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingUpdate {
    /// The node pod, `namespace/pod`.
    pub pod: String,
    /// The manifest version of the changed library; absent when the node could not read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// `refused` (it failed validation, load or warm-up; the old version keeps serving) or
    /// `restartRequired` (an in-process plugin changes only when the pod restarts).
    pub state: String,
    /// The node's message.
    pub message: String,
}

/// A node pod that failed to load the plugin.
#[derive(KubeSchema, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadError {
    /// The node pod, `namespace/pod`.
    pub pod: String,
    /// Stable reason from the node: `abi_mismatch`, `id_conflict`, `binary_not_found`, `sha256_mismatch`, ...
    pub reason: String,
    /// The node's message.
    pub message: String,
}
