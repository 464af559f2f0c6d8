//! Model reconcile, validate step (pure, no client): turns a `Model` into a [`ValidModel`] or
//! lists every reason it cannot be served as written.
//!
//! The CRD schema already refuses most bad input at admission. This step
//! re-checks what matters for building objects (the CRD installed in a
//! cluster may be older than this operator) and adds what a schema cannot
//! express: quantity grammar, path traversal in sources, quantization on a
//! non-GGUF format. Each failure quotes the field, becomes part of the
//! `InvalidSpec` condition message, and the reconcile waits for a change.
//!
//! This file holds the entry ([`validate`]) and what it returns; the checks of one part of the
//! spec each live in a child: `source` (the URI, files and Secret), `adapter` (the LoRA
//! adapters: names, scales, sources, served ids), `scaling` (autoscaling and
//! rollout defaults and ranges), `pool_member` (what a pool member may not set), `grammar`
//! (Kubernetes quantity and name grammars), and `invalid` (one problem, and the message they
//! make together).

mod adapter;
mod grammar;
mod invalid;
mod pool_member;
mod scaling;
mod source;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;

use crate::context::Settings;
use adapter::validate_adapters;
use gantry_crd::{
    Cache, CacheType, EngineConfig, GpuBackend, LoadPolicy, Model, ModelFormat, Replicas,
    Scheduling,
};
use grammar::{check_quantity, is_served_name};
use pool_member::check_pool_member;
use scaling::{validate_autoscaling, validate_rollout};
use source::validate_source;

pub use adapter::ValidAdapter;
pub use grammar::{is_dns1035_label, is_quantity, is_resource_name, quantity_bytes};
pub use invalid::{Invalid, message};
pub use scaling::{
    DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS, DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS,
    DEFAULT_TARGET_QUEUE_DEPTH, DEFAULT_TARGET_VRAM_UTILIZATION, ValidAutoscaling, ValidRollout,
};
pub use source::ValidSource;

/// A Model that passed validation, with every default filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidModel {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub generation: Option<i64>,
    /// OpenAI model id: `spec.servedName` or the object name.
    pub served_name: String,
    pub source: ValidSource,
    pub format: ModelFormat,
    /// `spec.architecture`, when the user stated it.
    pub declared_architecture: Option<String>,
    /// `spec.engine`.
    pub pin: Option<String>,
    /// `spec.modalities`, by name, each once.
    pub modalities: Vec<String>,
    /// `cuda` when the Model asks for GPUs, `cpu` otherwise.
    pub backend: GpuBackend,
    pub gpus: i32,
    pub gpu_resource: String,
    pub memory: Option<Quantity>,
    pub cpu: Option<Quantity>,
    pub scheduling: Scheduling,
    pub replicas: Replicas,
    pub autoscaling: ValidAutoscaling,
    pub rollout: ValidRollout,
    pub engine_config: EngineConfig,
    pub cache: Cache,
    pub load: LoadPolicy,
    /// `spec.pool`: the ModelPool whose pods serve this Model instead of its own.
    pub pool: Option<String>,
    /// `spec.adapters`, in spec order.
    pub adapters: Vec<ValidAdapter>,
    /// The object the owned objects belong to: the Model itself, or the ModelPool for the
    /// template the pool reconcile builds its pods from (`pool::admit::template`).
    pub owner: Owner,
}

/// The controller reference of built objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    /// `Model` or `ModelPool`.
    pub kind: &'static str,
    pub name: String,
}

/// Validate a Model against everything the build step relies on.
pub fn validate(model: &Model, settings: &Settings) -> Result<ValidModel, Vec<Invalid>> {
    let mut problems = Vec::new();
    let spec = &model.spec;
    let name = model.name_any();

    if !is_dns1035_label(&name) {
        problems.push(Invalid::new(
            "metadata.name",
            format!("must be a DNS-1035 label of at most 63 characters (it names the Service), got {name:?}"),
        ));
    }
    let namespace = model.namespace().unwrap_or_default();
    if namespace.is_empty() {
        problems.push(Invalid::new("metadata.namespace", "must be set"));
    }

    let served_name = spec.served_name.clone().unwrap_or_else(|| name.clone());
    if !is_served_name(&served_name) {
        problems.push(Invalid::new(
            "spec.servedName",
            format!("must be 1-128 characters of letters, digits and . _ : / -, starting with a letter or digit, got {served_name:?}"),
        ));
    }

    let source = match validate_source(model) {
        Ok(s) => Some(s),
        Err(mut p) => {
            problems.append(&mut p);
            None
        }
    };

    let adapters = validate_adapters(&spec.adapters, &served_name, source.as_ref(), &mut problems);

    // A GPU count selects the `cuda` backend for engine selection; 0 means CPU.
    let resources = spec.resources.clone().unwrap_or_default();
    let gpus = resources.gpus.unwrap_or(0);
    if !(0..=16).contains(&gpus) {
        problems.push(Invalid::new(
            "spec.resources.gpus",
            format!("must be between 0 and 16, got {gpus}"),
        ));
    }
    let gpu_resource = resources
        .gpu_resource_name
        .clone()
        .unwrap_or_else(|| settings.default_gpu_resource.clone());
    if !is_resource_name(&gpu_resource) {
        problems.push(Invalid::new(
            "spec.resources.gpuResourceName",
            format!(
                "must be an extended resource name such as nvidia.com/gpu, got {gpu_resource:?}"
            ),
        ));
    }
    check_quantity(
        &mut problems,
        "spec.resources.memory",
        resources.memory.as_ref(),
        true,
    );
    check_quantity(
        &mut problems,
        "spec.resources.cpu",
        resources.cpu.as_ref(),
        true,
    );

    let replicas = spec.replicas.clone().unwrap_or_default();
    if replicas.min < 0 {
        problems.push(Invalid::new(
            "spec.replicas.min",
            format!("must be >= 0, got {}", replicas.min),
        ));
    }
    if replicas.max < 1 {
        problems.push(Invalid::new(
            "spec.replicas.max",
            format!("must be >= 1, got {}", replicas.max),
        ));
    }
    if replicas.min > replicas.max {
        problems.push(Invalid::new(
            "spec.replicas",
            format!("min ({}) must be <= max ({})", replicas.min, replicas.max),
        ));
    }

    let autoscaling = validate_autoscaling(spec.autoscaling.as_ref(), &replicas, &mut problems);
    let rollout = validate_rollout(spec.rollout.as_ref(), &mut problems);

    let engine_config = spec.engine_config.clone().unwrap_or_default();
    for (field, value) in [
        (
            "spec.engineConfig.contextLength",
            engine_config.context_length,
        ),
        (
            "spec.engineConfig.maxBatchSize",
            engine_config.max_batch_size,
        ),
        ("spec.engineConfig.threads", engine_config.threads),
    ] {
        if let Some(v) = value.filter(|v| *v < 1) {
            problems.push(Invalid::new(field, format!("must be >= 1, got {v}")));
        }
    }
    // The settings the node will run, defaults filled in, checked as the node checks them.
    let speculation = crate::model::node_config::speculation(engine_config.speculation.as_ref());
    if let Some((field, reason)) = speculation.check() {
        let field = match field {
            "draftTokens" => "spec.engineConfig.speculation.draftTokens",
            "ngramMin" => "spec.engineConfig.speculation.ngramMin",
            "ngramMax" => "spec.engineConfig.speculation.ngramMax",
            "draftModel" => "spec.engineConfig.speculation.draftModel",
            _ => "spec.engineConfig.speculation.maxBatch",
        };
        problems.push(Invalid::new(field, reason));
    }
    if let Some(draft) = speculation.draft_model.as_deref() {
        // The draft runs in the node pods that serve this Model: those of a pool it shares.
        let field = "spec.engineConfig.speculation.draftModel";
        if spec.pool.is_none() {
            problems.push(Invalid::new(
                field,
                "a draft model runs in the node pods that serve this Model: put both Models in \
                 one ModelPool (spec.pool)",
            ));
        } else if draft == served_name {
            problems.push(Invalid::new(field, "names this Model itself"));
        }
    }

    if engine_config.temperature_fallback.is_some()
        && !spec.modalities.is_empty()
        && !spec
            .modalities
            .contains(&gantry_crd::engine_plugin::Modality::Transcription)
    {
        problems.push(Invalid::new(
            "spec.engineConfig.temperatureFallback",
            "applies to speech recognition: the Model's modalities do not include transcription",
        ));
    }

    let cache = spec.cache.clone().unwrap_or_default();
    if cache.type_ == CacheType::PersistentVolumeClaim && cache.size.is_none() {
        problems.push(Invalid::new(
            "spec.cache.size",
            "is required when spec.cache.type is PersistentVolumeClaim",
        ));
    }
    check_quantity(&mut problems, "spec.cache.size", cache.size.as_ref(), true);

    if let Some(pin) = &spec.engine
        && !crate::acceptance::is_engine_id(pin)
    {
        problems.push(Invalid::new(
            "spec.engine",
            format!("must be an engine id (lower-case letters, digits, _ and -), got {pin:?}"),
        ));
    }
    if let Some(pool) = &spec.pool {
        check_pool_member(model, pool, source.as_ref(), &adapters, &mut problems);
    }
    // A Model's node pods serve that one model, and a node loads lazily only
    // when it serves several (it refuses the config otherwise). Pool members always load lazily.
    if spec.load == gantry_crd::LoadPolicy::Lazy && spec.pool.is_none() {
        problems.push(Invalid::new(
            "spec.load",
            "`lazy` needs a node serving several models; a Model's node pods serve one, so use `eager`",
        ));
    }
    if spec.format != ModelFormat::Gguf && source.as_ref().is_some_and(|s| s.quantization.is_some())
    {
        problems.push(Invalid::new(
            "spec.source.quantization",
            "only applies to format gguf",
        ));
    }

    match source {
        Some(source) if problems.is_empty() => Ok(ValidModel {
            uid: model.uid().unwrap_or_default(),
            generation: model.metadata.generation,
            served_name,
            source,
            format: spec.format,
            declared_architecture: spec.architecture.clone(),
            pin: spec.engine.clone(),
            modalities: {
                let mut m: Vec<String> = spec
                    .modalities
                    .iter()
                    .map(|m| m.as_str().to_string())
                    .collect();
                m.sort();
                m.dedup();
                m
            },
            backend: if gpus > 0 {
                GpuBackend::Cuda
            } else {
                GpuBackend::Cpu
            },
            gpus,
            gpu_resource,
            memory: resources.memory,
            cpu: resources.cpu,
            scheduling: spec.scheduling.clone().unwrap_or_default(),
            replicas,
            autoscaling,
            rollout,
            engine_config,
            cache,
            load: spec.load,
            pool: spec.pool.clone(),
            adapters,
            owner: Owner {
                kind: "Model",
                name: name.clone(),
            },
            name,
            namespace,
        }),
        _ => Err(problems),
    }
}
