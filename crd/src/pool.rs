//! Custom resources, `ModelPool` (namespaced): node pods that serve several Models at once. The
//! pool reconcile reads the spec and writes the status; Models join with `spec.pool`, and the
//! gateway's discovery routes their requests to the pool's pods.
//!
//! The pod template fields (`resources`, `scheduling`, `replicas`, `rollout`, `cache`,
//! `engineConfig`) are the Model's own types with the same meaning: what a dedicated Model says
//! about its node pods, a pool says about the pool's.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::model::{
    Autoscaling, AutoscalingStatus, Cache, EngineConfig, ModelResources, Replicas, Rollout,
    Scheduling,
};
use super::schema::{conditions_schema, quantity_schema};

/// A pool's name names its objects (`<name>-pool`), so it must be a DNS-1035 label that leaves
/// room for the suffix.
pub const POOL_NAME_RULE: &str =
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 58";

/// Node pods that serve several Models: the pool's pods load its Models lazily, unload the
/// least recently used past the memory watermark, and pick up a joining or leaving Model
/// without a restart.
// kube's printcolumn(...) repeats `type_ = ...` by design; clippy reads that as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "gantry.dev",
    version = "v1alpha1",
    kind = "ModelPool",
    namespaced,
    status = "ModelPoolStatus",
    derive = "PartialEq",
    shortname = "gmp",
    category = "gantry",
    doc = "Node pods that serve several Models at once. A Model joins with spec.pool; the operator owns one ConfigMap listing every member (the node reloads it in place), one Deployment, one Service and (when replicas.min > 1) a PodDisruptionBudget per pool.",
    validation = Rule::new(POOL_NAME_RULE).message("metadata.name must be a DNS-1035 label of at most 58 characters (it names the pool's objects, <name>-pool)"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status", description = "Whether the pool's pods serve"),
    printcolumn(name = "Models", type_ = "integer", json_path = ".status.modelCount", description = "Member Models in the node config"),
    printcolumn(name = "Refused", type_ = "integer", json_path = ".status.refusedCount", description = "Member Models the pool cannot serve"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".status.replicas.ready", description = "Ready node pods"),
    printcolumn(name = "Endpoint", type_ = "string", json_path = ".status.endpoint", description = "In-cluster OpenAI base URL", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ModelPoolSpec {
    /// Compute resources of each node pod (GPUs, memory, CPU), shared by every member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ModelResources>,
    /// Where node pods may run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduling: Option<Scheduling>,
    /// Node pods. The Deployment starts with `min`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Replicas>,
    /// Autoscaling targets within `replicas`, on the pool's summed queue and KV use and its
    /// memory pressure (loads refused and models evicted per minute). `Builtin` only;
    /// `replicas.min: 0` scales an idle pool to zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// How node pods are replaced when the pod template changes (a member joining or leaving
    /// changes only the node config, which the pods reload without a restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
    /// The volume node pods download weights into, shared by the members.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<Cache>,
    /// EnginePlugin names the pool's pods may mount. Empty: every plugin that fits a member.
    /// A member no allowed plugin can serve is refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub engine_plugins: Vec<String>,
    /// Memory each pod has for model weights and KV caches: the VRAM of its GPUs on a GPU pool,
    /// its RAM otherwise. Defaults to `resources.memory` on a CPU pool. A member whose
    /// `resources.memory` exceeds the watermark (`memoryWatermarkPercent`) of it can never load
    /// and is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub model_memory: Option<Quantity>,
    /// Where the pods' memory policy starts unloading the least recently used idle member and
    /// refuses loads, in percent of `modelMemory` (50-99). Defaults to 90. A change rolls the
    /// pods (a node reads it at start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 50, max = 99))]
    pub memory_watermark_percent: Option<i32>,
    /// Engine settings for members that do not set their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_config: Option<EngineConfig>,
}

/// What the operator observed about a pool. Written only by the operator, only when it changes.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelPoolStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` (reasons `Ready`, `ScaledToZero`, `ReplicasNotReady`, `NoMembers`, `InvalidSpec`,
    /// `ApplyFailed`), and `Progressing` and `Degraded` with a Model's rollout and in-place
    /// plugin delivery reasons (`PluginUpdating`, `PluginUpdateHalted`; see docs/operator.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Member Models in the node config, by Model name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<PoolMember>,
    /// `models`' length (for the printer column).
    #[serde(default)]
    pub model_count: i32,
    /// Models that name this pool but are not in its node config, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<PoolRefusal>,
    /// `refused`'s length (for the printer column).
    #[serde(default)]
    pub refused_count: i32,
    /// Each running node pod: the config it runs, what it has loaded, its memory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PoolPod>,
    /// Node pod counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<super::model::ReplicaStatus>,
    /// The autoscaler's last decision (field manager `gantry-autoscaler`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingStatus>,
    /// In-cluster OpenAI base URL of the pool's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
}

/// One Model in the pool's node config.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolMember {
    /// The Model's name.
    pub name: String,
    /// Its OpenAI model id.
    pub served_name: String,
    /// EnginePlugins that may serve it in the pool's pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plugins: Vec<String>,
}

/// A Model that names the pool but is not served by it.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolRefusal {
    /// The Model's name.
    pub name: String,
    /// Stable reason: `InvalidSpec`, `EngineUnresolved` or `DoesNotFit`.
    pub reason: String,
    /// Why, with the field and the limit.
    pub message: String,
}

/// One node pod of the pool as it last reported.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolPod {
    /// Pod name.
    pub name: String,
    /// Whether the node says it is ready.
    pub ready: bool,
    /// Whether it runs the current node config (it reloads a changed one within seconds).
    pub config_current: bool,
    /// Served names of the members it has loaded now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loaded: Vec<String>,
    /// What the loaded models hold.
    #[serde(default)]
    pub memory_used_bytes: i64,
    /// The node's memory budget (0: none).
    #[serde(default)]
    pub memory_limit_bytes: i64,
    /// Models its memory policy unloaded to make room, since the pod started.
    #[serde(default)]
    pub evictions: i64,
    /// Loads it refused because they could not fit, since the pod started.
    #[serde(default)]
    pub refusals: i64,
}
