//! Custom resources (the shapes every reconcile step reads and writes, and that the gateway's
//! discovery reads): `Model`, `ModelPool`, `EnginePlugin`, their schema helpers, and the object names and
//! condition types both the operator and the gateway rely on.
//!
//! This crate is the contract between the control plane (`gantry-operator`) and the data-plane
//! edge (`gantry-gateway`); neither depends on the other. The CRD generator and the
//! structural-schema check stay in the operator (`gantry-operator crdgen`).
#![forbid(unsafe_code)]

pub mod conditions;
pub mod engine_plugin;
pub mod model;
pub mod names;
pub mod pool;
pub mod schema;

pub use engine_plugin::{
    EnginePlugin, EnginePluginSpec, EnginePluginStatus, GpuBackend, LoadError, MAX_UPDATES,
    MAX_VERSION_ROWS, Modality, MountStrategy, PendingUpdate, PluginVersion,
};
pub use model::{
    Adapter, AdapterSource, AdapterState, AdapterStatus, Autoscaling, AutoscalingMode,
    AutoscalingStatus, Cache, CacheAccessMode, CacheType, CandidateRejection, DownloadStatus,
    DraftStatus, EngineConfig, LoadPolicy, Model, ModelFormat, ModelResources, ModelSource,
    ModelSpec, ModelStatus, PoolPlacement, ReplicaStatus, Replicas, ResolvedEngine, Rollout,
    RolloutStrategy, Scheduling, SecretKeyRef,
};
pub use pool::{ModelPool, ModelPoolSpec, ModelPoolStatus, PoolMember, PoolPod, PoolRefusal};
