//! Custom resources, `Model.status`: what the status step writes (the autoscaler writes
//! `autoscaling` under its own field manager) and the gateway's discovery reads back.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use super::AdapterStatus;
use crate::schema::{adapter_status_list_schema, conditions_schema};

/// What the operator observed. Written only by the operator, only when it changes.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `EngineResolved`, `ArtifactReady`, `Progressing` and `Degraded`, with stable reasons (see docs/operator.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The engine serving this model, once resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<ResolvedEngine>,
    /// How a node pod chose the engine when several serve the model (each candidate's
    /// tokens/s, time to first token and peak memory, and the rule), from the first node pod
    /// that reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_choice: Option<gantry_api::EngineChoice>,
    /// The model architecture: from the node pods' report, else from `spec.architecture`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// The source (`uri`, with `@quantization` when set) that `architecture` and `download` describe.
    /// When `spec.source` changes, what was learnt about the old source is dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_source: Option<String>,
    /// Node pod counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicaStatus>,
    /// The autoscaler's last decision. Written by the autoscaler (field manager
    /// `gantry-autoscaler`) only when the decision's reason or replica count changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingStatus>,
    /// Download progress of the weights, from the node pod furthest behind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download: Option<DownloadStatus>,
    /// In-cluster OpenAI base URL of this model's node pods (the gateway routes to the same pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// When no engine can serve the model: every candidate EnginePlugin and why it was rejected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<CandidateRejection>,
    /// A pool member: the pool and which of its pods hold the model now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolPlacement>,
    /// Each of `spec.adapters`, in spec order: its served id, where it stands on the node
    /// pods and how many of the ready ones have it loaded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "adapter_status_list_schema")]
    pub adapters: Vec<AdapterStatus>,
    /// With `spec.engineConfig.speculation.method: DraftModel`: whether the ready node pods
    /// draft with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<DraftStatus>,
}

/// Where a Model's draft model stands on its node pods.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DraftStatus {
    /// `spec.engineConfig.speculation.draftModel`.
    pub model: String,
    /// Ready node pods (those serving the Model) that draft with it.
    pub active_replicas: i32,
    /// Ready node pods.
    pub ready_replicas: i32,
    /// When a ready pod decodes without it: that pod and its reason (the draft is not in the
    /// pool, failed to load, tokenizes differently).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Where a pool member is.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolPlacement {
    /// The ModelPool's name.
    pub name: String,
    /// Pool pods running a config that lists the model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listed_by: Vec<String>,
    /// Pool pods that have it loaded now (the others load it on its first request).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loaded_on: Vec<String>,
}

/// The engine serving a model.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedEngine {
    /// Engine id (the plugin manifest `id`).
    pub id: String,
    /// Engine version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Name of the EnginePlugin object that provides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<String>,
}

/// Node pod counts.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// Node pods wanted now (between `replicas.min` and `replicas.max`).
    pub desired: i32,
    /// Node pods that exist.
    pub current: i32,
    /// Node pods ready to serve.
    pub ready: i32,
}

/// The autoscaler's last decision (see docs/autoscaling.md for every reason).
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingStatus {
    /// `Builtin` or `HPA`: who sets the Deployment's replicas.
    pub mode: String,
    /// Node pods the last decision asked for.
    pub desired_replicas: i32,
    /// Stable reason of the last decision, e.g. `ScaledUpQueueDepth`, `ScaleDownStabilizing`,
    /// `ScaledToZeroIdle`, `MetricsUnavailable`, `DelegatedToHPA`.
    pub reason: String,
    /// The figures behind the decision when its reason last changed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When the reason or the desired count last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_decision_time: Option<Time>,
    /// When the autoscaler last changed the Deployment's replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
}

/// Download progress.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DownloadStatus {
    /// Bytes on disk.
    pub bytes_done: i64,
    /// Bytes in total (0 while unknown).
    pub bytes_total: i64,
}

/// One EnginePlugin that cannot serve this model, and why.
#[derive(KubeSchema, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CandidateRejection {
    /// EnginePlugin name (or engine id, when the rejection comes from a node pod).
    pub plugin: String,
    /// Stable category: `format`, `architecture`, `backend`, `abi`, `pin` or `load_error`.
    pub kind: gantry_api::RejectionKind,
    /// Human-readable reason.
    pub reason: String,
}

impl From<&gantry_api::Rejection> for CandidateRejection {
    fn from(r: &gantry_api::Rejection) -> Self {
        CandidateRejection {
            plugin: r.plugin.clone(),
            kind: r.kind,
            reason: r.reason.clone(),
        }
    }
}
