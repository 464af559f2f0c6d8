//! Custom resources (the shapes every reconcile step reads and writes): `Model`, `EnginePlugin`,
//! their schema helpers, the CRD generator and the structural-schema checker.

pub mod engine_plugin;
pub mod generate;
pub mod model;
pub mod schema;
pub mod structural;

pub use engine_plugin::{
    EnginePlugin, EnginePluginSpec, EnginePluginStatus, GpuBackend, LoadError, Modality,
    MountStrategy,
};
pub use model::{
    Autoscaling, AutoscalingMode, AutoscalingStatus, Cache, CacheAccessMode, CacheType,
    CandidateRejection, DownloadStatus, EngineConfig, LoadPolicy, Model, ModelFormat,
    ModelResources, ModelSource, ModelSpec, ModelStatus, ReplicaStatus, Replicas, ResolvedEngine,
    Scheduling, SecretKeyRef,
};
