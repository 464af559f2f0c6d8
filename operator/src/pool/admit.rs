//! ModelPool reconcile, admit and render steps (pure, no client; after the read step, before
//! build): the pool's pod template as a validated Model, which members the pool serves and
//! which it refuses (and why), the engine plugins its pods mount, and the one node config that
//! lists every admitted member (and the `spec.isolation` of every plugin those pods mount).
//!
//! The same function decides for the pool reconcile (what goes into the config) and for each
//! member's reconcile (what its status says), so the two never disagree.

use std::collections::{BTreeMap, HashSet};

use gantry_api::NodeConfig;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use crate::context::Settings;
use crate::model::node_config::{RenderError, RenderedConfig, isolation, model_config, short_hash};
use crate::model::resolve::{Resolution, resolve};
use crate::model::validate::{self, Invalid, Owner, ValidModel, ValidSource, quantity_bytes};
use crate::node_report::NodeReport;
use gantry_crd::conditions::reason;
use gantry_crd::names::{NODE_CACHE_DIR, POOL_KIND, pool_object_name};
use gantry_crd::{
    EnginePlugin, LoadPolicy, Model, ModelFormat, ModelPool, ModelSource, ModelSpec, PoolRefusal,
};

/// The pool's memory watermark when `memoryWatermarkPercent` is not set: the node's default
/// (node-pod/src/memory.rs `WATERMARK_PERCENT`).
pub const WATERMARK_PERCENT: i32 = 90;

/// The share of the pool's model memory, in percent, past which its pods unload idle members
/// and refuse loads: a member may need at most that much.
pub fn watermark_percent(pool: &ModelPool) -> i32 {
    pool.spec
        .memory_watermark_percent
        .unwrap_or(WATERMARK_PERCENT)
}

/// The pool's pod template: a Model with the pool's resources, scheduling, replicas, rollout
/// and cache and no source, validated by the Model's own rules (the field paths are the same),
/// owned by the pool and named [`pool_object_name`].
pub fn template(pool: &ModelPool, settings: &Settings) -> Result<ValidModel, Vec<Invalid>> {
    let name = pool.name_any();
    let spec = &pool.spec;
    let shape = Model {
        metadata: ObjectMeta {
            name: Some(pool_object_name(&name)),
            namespace: pool.namespace(),
            uid: pool.uid(),
            generation: pool.metadata.generation,
            ..ObjectMeta::default()
        },
        spec: ModelSpec {
            // Only to pass source validation; the template carries no source (below).
            source: ModelSource {
                uri: "file:///pool".to_string(),
                ..ModelSource::default()
            },
            format: ModelFormat::Gguf,
            served_name: None,
            architecture: None,
            engine: None,
            modalities: Vec::new(),
            resources: spec.resources.clone(),
            scheduling: spec.scheduling.clone(),
            replicas: spec.replicas.clone(),
            autoscaling: spec.autoscaling.clone(),
            rollout: spec.rollout.clone(),
            engine_config: spec.engine_config.clone(),
            cache: spec.cache.clone(),
            load: LoadPolicy::Eager,
            pool: None,
            adapters: Vec::new(),
        },
        status: None,
    };
    let mut problems = Vec::new();
    for plugin in &spec.engine_plugins {
        // EnginePlugin names are DNS-1123 subdomains.
        let name_like = !plugin.is_empty()
            && plugin.len() <= 253
            && plugin
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !name_like {
            problems.push(Invalid::new(
                "spec.enginePlugins",
                format!("every entry must be an EnginePlugin name, got {plugin:?}"),
            ));
        }
    }
    if spec
        .autoscaling
        .as_ref()
        .is_some_and(|a| a.mode == gantry_crd::AutoscalingMode::Hpa)
    {
        problems.push(Invalid::new(
            "spec.autoscaling.mode",
            "a pool scales on its summed load and memory pressure, which an HPA cannot read: use Builtin",
        ));
    }
    if let Some(w) = spec.memory_watermark_percent
        && !(50..=99).contains(&w)
    {
        problems.push(Invalid::new(
            "spec.memoryWatermarkPercent",
            format!("must be between 50 and 99, got {w}"),
        ));
    }
    if let Some(q) = &spec.model_memory
        && quantity_bytes(&q.0).is_none_or(|b| b <= 0.0)
    {
        problems.push(Invalid::new(
            "spec.modelMemory",
            format!("must be a positive quantity such as 24Gi, got {:?}", q.0),
        ));
    }
    let template = validate::validate(&shape, settings);
    match template {
        Ok(mut t) if problems.is_empty() => {
            t.owner = Owner {
                kind: POOL_KIND,
                name,
            };
            t.source = ValidSource {
                uri: String::new(),
                node_uri: String::new(),
                claim: None,
                files: Vec::new(),
                quantization: None,
                secret: None,
            };
            Ok(t)
        }
        Ok(_) => Err(problems),
        Err(mut p) => {
            p.append(&mut problems);
            Err(p)
        }
    }
}

/// A member the pool serves.
#[derive(Clone, Debug)]
pub struct Member {
    /// The Model's name.
    pub name: String,
    /// Validated, with the pool's backend and GPU count.
    pub valid: ValidModel,
    /// Engine selection for it among the pool's allowed plugins.
    pub resolution: Resolution,
    /// The architecture selection went by (a pool pod's report, else `spec.architecture`).
    pub architecture: Option<String>,
}

/// Who is in and who is out.
#[derive(Clone, Debug, Default)]
pub struct Admission {
    /// Admitted members, in the order given (oldest first).
    pub members: Vec<Member>,
    /// Refused members, in the order given.
    pub refused: Vec<PoolRefusal>,
}

impl Admission {
    /// The plugins the pool's pods mount: every admitted member's, once each, by name.
    pub fn mounted(&self) -> Vec<&EnginePlugin> {
        let mut by_name: BTreeMap<String, &EnginePlugin> = BTreeMap::new();
        for m in &self.members {
            for p in m.resolution.mounted() {
                by_name.entry(p.name_any()).or_insert(p);
            }
        }
        by_name.into_values().collect()
    }

    /// The admitted member named `name`.
    pub fn member(&self, name: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.name == name)
    }

    /// Why `name` was refused, if it was.
    pub fn refusal(&self, name: &str) -> Option<&PoolRefusal> {
        self.refused.iter().find(|r| r.name == name)
    }
}

/// The plugins a pool may mount: `spec.enginePlugins`, or all when it is empty.
pub fn allowed_plugins(pool: &ModelPool, plugins: Vec<EnginePlugin>) -> Vec<EnginePlugin> {
    if pool.spec.engine_plugins.is_empty() {
        return plugins;
    }
    plugins
        .into_iter()
        .filter(|p| pool.spec.engine_plugins.contains(&p.name_any()))
        .collect()
}

/// Bytes the pool's pods have for models: `spec.modelMemory`, else `resources.memory` on a
/// CPU pool; `None` when the pool does not say (every member fits then, and the node's own
/// policy refuses what cannot load).
pub fn capacity_bytes(pool: &ModelPool, template: &ValidModel) -> Option<f64> {
    match (&pool.spec.model_memory, &template.memory) {
        (Some(q), _) => quantity_bytes(&q.0),
        (None, Some(m)) if template.gpus == 0 => quantity_bytes(&m.0),
        _ => None,
    }
}

fn refusal(name: &str, reason: &str, message: String) -> PoolRefusal {
    PoolRefusal {
        name: name.to_string(),
        reason: reason.to_string(),
        message,
    }
}

/// Decide every member of `pool` (given oldest first): valid, fits the pool's memory, served
/// by one of its allowed `plugins`, and its served name not taken by an older member.
pub fn admit(
    pool: &ModelPool,
    template: &ValidModel,
    members: &[Model],
    reports: &[NodeReport],
    plugins: &[EnginePlugin],
    settings: &Settings,
) -> Admission {
    let capacity = capacity_bytes(pool, template);
    let percent = watermark_percent(pool);
    let mut out = Admission::default();
    let mut served: HashSet<String> = HashSet::new();
    for model in members {
        let name = model.name_any();
        let mut valid = match validate::validate(model, settings) {
            Ok(v) => v,
            Err(problems) => {
                out.refused.push(refusal(
                    &name,
                    reason::INVALID_SPEC,
                    validate::message(&problems),
                ));
                continue;
            }
        };
        // The member runs in the pool's pods: their backend and devices, lazily loaded.
        valid.backend = template.backend;
        valid.gpus = template.gpus;
        valid.load = LoadPolicy::Lazy;
        if valid.engine_config == gantry_crd::EngineConfig::default() {
            valid.engine_config = template.engine_config.clone();
        }
        if let (Some(cap), Some(need)) = (
            capacity,
            valid.memory.as_ref().and_then(|m| quantity_bytes(&m.0)),
        ) {
            let watermark = cap * f64::from(percent) / 100.0;
            if need > watermark {
                out.refused.push(refusal(
                    &name,
                    reason::DOES_NOT_FIT,
                    format!(
                        "spec.resources.memory ({} bytes) is more than the pool's pods can ever hold: {percent} % of the pool's model memory {} bytes is {} bytes",
                        need.round(),
                        cap.round(),
                        watermark.round()
                    ),
                ));
                continue;
            }
        }
        // The pool's pods serve every member's id and each of its adapters' ids: one node
        // config, in which every id names one thing.
        let ids: Vec<&String> = std::iter::once(&valid.served_name)
            .chain(valid.adapters.iter().map(|a| &a.id))
            .collect();
        if let Some(taken) = ids.iter().find(|id| served.contains(id.as_str())) {
            let what = if *taken == &valid.served_name {
                "served name"
            } else {
                "adapter id"
            };
            out.refused.push(refusal(
                &name,
                reason::SERVED_NAME_TAKEN,
                format!("{what} {taken:?} is already served by an older member of the pool"),
            ));
            continue;
        }
        let architecture = reports
            .iter()
            .filter_map(|r| r.model(&valid.served_name))
            .find_map(|m| m.architecture.clone())
            .or_else(|| valid.declared_architecture.clone());
        let resolution = resolve(&valid, architecture.as_deref(), plugins, settings.abi_major);
        if let Resolution::Unresolved(candidates) = &resolution {
            let why: Vec<String> = candidates
                .iter()
                .map(|c| format!("{}: {}", c.plugin, c.reason))
                .collect();
            out.refused.push(refusal(
                &name,
                reason::ENGINE_UNRESOLVED,
                if why.is_empty() {
                    "no EnginePlugin the pool allows (spec.enginePlugins) exists".to_string()
                } else {
                    format!(
                        "no engine plugin the pool allows can serve it: {}",
                        why.join("; ")
                    )
                },
            ));
            continue;
        }
        served.insert(valid.served_name.clone());
        served.extend(valid.adapters.iter().map(|a| a.id.clone()));
        out.members.push(Member {
            name,
            valid,
            resolution,
            architecture,
        });
    }
    out
}

/// The pool's node config and hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Every admitted member, sorted by served name: the ConfigMap's YAML and its hash, which
    /// the pool's pods report back once they run it (`configHash` in `/v1/status`).
    pub config: RenderedConfig,
    /// The hash of what in the config a running pod cannot reload (everything but the model
    /// list). It goes on the pod template, so a member joining or leaving rolls no pod.
    pub pod_hash: String,
}

/// Render the node config of `pool` listing `admission`'s members.
pub fn render(pool: &ModelPool, admission: &Admission) -> Result<PoolConfig, RenderError> {
    let mut models: Vec<_> = admission
        .members
        .iter()
        .map(|m| model_config(&m.valid))
        .collect();
    models.sort_by(|a, b| a.id.cmp(&b.id));
    // The isolation of the plugins the pods mount is node-wide: it stays in the pod hash below.
    let mut node = NodeConfig {
        models,
        cache_dir: Some(NODE_CACHE_DIR.into()),
        isolation: isolation(&admission.mounted()),
        ..NodeConfig::default()
    };
    node.scheduler.memory_watermark_percent = u64::try_from(watermark_percent(pool)).unwrap_or(90);
    let yaml = serde_yaml::to_string(&node).map_err(RenderError::Yaml)?;
    let hash = short_hash(yaml.as_bytes());
    node.models.clear();
    let fixed = serde_yaml::to_string(&node).map_err(RenderError::Yaml)?;
    Ok(PoolConfig {
        config: RenderedConfig { yaml, hash },
        pod_hash: short_hash(fixed.as_bytes()),
    })
}
