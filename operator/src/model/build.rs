//! Model reconcile, build step (pure, no client): the desired ConfigMap, Deployment, Service,
//! PodDisruptionBudget, cache PersistentVolumeClaim and (HPA mode) HorizontalPodAutoscaler of
//! one Model.
//!
//! Output depends only on the validated Model, the plugins chosen by engine
//! selection and the operator settings, so the same inputs always give
//! byte-identical objects. Each object carries the hash of its own content
//! (`gantry.dev/applied-hash`); the apply step compares it with the live
//! object's to decide whether anything needs writing.

use std::collections::BTreeMap;

use gantry_api::{ModelConfig, NodeConfig};
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, HPAScalingRules, HorizontalPodAutoscaler,
    HorizontalPodAutoscalerBehavior, HorizontalPodAutoscalerSpec, MetricIdentifier, MetricSpec,
    MetricTarget, PodsMetricSource,
};
use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvFromSource, EnvVar, EnvVarSource, HTTPGetAction, ImageVolumeSource, KeyToPath,
    ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    SeccompProfile, SecretEnvSource, SecretKeySelector, SecurityContext, Service, ServicePort,
    ServiceSpec, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::context::Settings;
use crate::model::validate::ValidModel;
use gantry_crd::names::{self, *};
use gantry_crd::{AutoscalingMode, CacheType, EnginePlugin, MountStrategy};

/// Every object a served Model owns.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedObjects {
    pub config_map: ConfigMap,
    /// Hash of the node config, also on the pod template (`gantry.dev/config-hash`).
    pub config_hash: String,
    /// The cache claim, when `cache.type` is `PersistentVolumeClaim`.
    pub pvc: Option<PersistentVolumeClaim>,
    pub deployment: Deployment,
    pub service: Service,
    /// Only when `replicas.min > 1`; otherwise an existing one is removed.
    pub pdb: Option<PodDisruptionBudget>,
    /// Only in `autoscaling.mode: HPA`; otherwise an existing one is removed.
    pub hpa: Option<HorizontalPodAutoscaler>,
    /// `spec.replicas` of a Deployment being created. The built Deployment leaves the field out:
    /// after creation it belongs to the autoscaler (docs/autoscaling.md, "Who owns replicas").
    pub initial_replicas: i32,
}

/// Why objects could not be built. Only serialization can fail, which is a bug, not user input.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot render the node config: {0}")]
    RenderConfig(#[source] serde_yaml::Error),
    #[error("cannot serialize {kind} to hash it: {source}")]
    Hash {
        kind: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl BuildError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            BuildError::RenderConfig(_) => "build_render_config",
            BuildError::Hash { .. } => "build_hash",
        }
    }
}

/// Build every owned object for `model`, mounting `plugins`.
pub fn build(
    model: &ValidModel,
    plugins: &[&EnginePlugin],
    settings: &Settings,
) -> Result<OwnedObjects, BuildError> {
    let (config_map, config_hash) = config_map(model)?;
    let pvc = match model.cache.type_ {
        CacheType::PersistentVolumeClaim => {
            Some(stamp(cache_claim(model), "PersistentVolumeClaim")?)
        }
        CacheType::EmptyDir => None,
    };
    let pdb = if model.replicas.min > 1 {
        Some(stamp(pdb(model), "PodDisruptionBudget")?)
    } else {
        None
    };
    let hpa = match model.autoscaling.mode {
        AutoscalingMode::Hpa => Some(stamp(hpa(model), "HorizontalPodAutoscaler")?),
        AutoscalingMode::Builtin => None,
    };
    Ok(OwnedObjects {
        hpa,
        initial_replicas: initial_replicas(model),
        config_map: stamp(config_map, "ConfigMap")?,
        pvc,
        deployment: stamp(
            deployment(model, plugins, &config_hash, settings),
            "Deployment",
        )?,
        service: stamp(service(model), "Service")?,
        pdb,
        config_hash,
    })
}

/// Replicas of a new Deployment: `replicas.min` (at least 1 for an HPA, which cannot start
/// from zero).
pub fn initial_replicas(model: &ValidModel) -> i32 {
    match model.autoscaling.mode {
        AutoscalingMode::Builtin => model.replicas.min,
        AutoscalingMode::Hpa => model.replicas.min.max(1),
    }
}

/// Metric names the HPA reads through a metrics adapter: the node's own gauges, per pod.
pub const HPA_METRIC_WAITING: &str = "gantry_num_requests_waiting";
pub const HPA_METRIC_KV_USAGE: &str = "gantry_kv_cache_usage_perc";

/// `autoscaling/v2` HPA on the node pods' waiting requests and KV-cache usage. The node
/// exports KV usage as a fraction (0-1), so the percent target becomes a milli-quantity
/// (80 % → `800m`). Both metrics are selected by the node's `model` label, which is the
/// served name.
fn hpa(model: &ValidModel) -> HorizontalPodAutoscaler {
    let a = &model.autoscaling;
    let pods_metric = |name: &str, target: Quantity| MetricSpec {
        type_: "Pods".to_string(),
        pods: Some(PodsMetricSource {
            metric: MetricIdentifier {
                name: name.to_string(),
                selector: Some(LabelSelector {
                    match_labels: Some(BTreeMap::from([(
                        "model".to_string(),
                        model.served_name.clone(),
                    )])),
                    ..LabelSelector::default()
                }),
            },
            target: MetricTarget {
                type_: "AverageValue".to_string(),
                average_value: Some(target),
                ..MetricTarget::default()
            },
        }),
        ..MetricSpec::default()
    };
    HorizontalPodAutoscaler {
        metadata: metadata(model, owned_name(&model.name)),
        spec: HorizontalPodAutoscalerSpec {
            scale_target_ref: CrossVersionObjectReference {
                api_version: Some("apps/v1".to_string()),
                kind: "Deployment".to_string(),
                name: owned_name(&model.name),
            },
            // Validation refuses min 0 in HPA mode; max(1) keeps the object valid regardless.
            min_replicas: Some(model.replicas.min.max(1)),
            max_replicas: model.replicas.max,
            metrics: Some(vec![
                pods_metric(
                    HPA_METRIC_WAITING,
                    Quantity(a.target_queue_depth.to_string()),
                ),
                pods_metric(
                    HPA_METRIC_KV_USAGE,
                    Quantity(format!("{}m", a.target_vram_utilization * 10)),
                ),
            ]),
            behavior: Some(HorizontalPodAutoscalerBehavior {
                scale_down: Some(HPAScalingRules {
                    stabilization_window_seconds: Some(a.scale_down_stabilization_seconds),
                    ..HPAScalingRules::default()
                }),
                // Scale up at once, as the built-in autoscaler does.
                scale_up: Some(HPAScalingRules {
                    stabilization_window_seconds: Some(0),
                    ..HPAScalingRules::default()
                }),
            }),
        },
        ..HorizontalPodAutoscaler::default()
    }
}

/// The in-cluster base URL of a Model's node pods.
pub fn endpoint(model: &ValidModel) -> String {
    format!(
        "http://{}.{}.svc:{NODE_PORT}/v1",
        owned_name(&model.name),
        model.namespace
    )
}

/// The node's model config (YAML) for one Model: the node's own type, so the node reads
/// exactly what is rendered here.
pub fn node_config(model: &ValidModel) -> NodeConfig {
    let positive = |v: Option<i32>| v.and_then(|v| u32::try_from(v).ok());
    NodeConfig {
        models: vec![ModelConfig {
            id: model.served_name.clone(),
            source: Some(model.source.node_uri.clone()),
            format: model.format.as_str().to_string(),
            quantization: model.source.quantization.clone(),
            files: model.source.files.clone(),
            engine: model.pin.clone(),
            context_length: positive(model.engine_config.context_length),
            max_batch_size: positive(model.engine_config.max_batch_size),
            threads: positive(model.engine_config.threads),
            load: match model.load {
                gantry_crd::LoadPolicy::Eager => gantry_api::LoadPolicy::Eager,
                gantry_crd::LoadPolicy::Lazy => gantry_api::LoadPolicy::Lazy,
            },
            ..ModelConfig::default()
        }],
        cache_dir: Some(NODE_CACHE_DIR.into()),
        ..NodeConfig::default()
    }
}

/// `controller: true` makes the garbage collector delete the object with its Model and lets
/// the apply step tell our objects from a user's of the same name; `blockOwnerDeletion` keeps
/// a foreground deletion of the Model waiting until they are gone.
fn owner_reference(model: &ValidModel) -> OwnerReference {
    OwnerReference {
        api_version: format!("{API_GROUP}/{API_VERSION}"),
        kind: "Model".to_string(),
        name: model.name.clone(),
        uid: model.uid.clone(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn metadata(model: &ValidModel, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(model.namespace.clone()),
        labels: Some(object_labels(&model.name)),
        owner_references: Some(vec![owner_reference(model)]),
        ..ObjectMeta::default()
    }
}

/// Set `gantry.dev/applied-hash` to the sha256 of the object as built (without the annotation).
// The hash covers the whole object as built, so any change in any field (labels included)
// re-applies it, and nothing outside the build step can change it.
fn stamp<K>(mut obj: K, kind: &'static str) -> Result<K, BuildError>
where
    K: Serialize + kube::Resource,
{
    let bytes = serde_json::to_vec(&obj).map_err(|source| BuildError::Hash { kind, source })?;
    let hash = short_hash(&bytes);
    obj.annotations_mut()
        .insert(ANNOTATION_APPLIED_HASH.to_string(), hash);
    Ok(obj)
}

/// 16 hex digits of sha256: collisions between two versions of one object are not a concern.
fn short_hash(bytes: &[u8]) -> String {
    hex::encode(&Sha256::digest(bytes)[..8])
}

fn config_yaml(model: &ValidModel) -> Result<String, BuildError> {
    serde_yaml::to_string(&node_config(model)).map_err(BuildError::RenderConfig)
}

/// Hash of the node config: on the pod template, and how the status step tells pods running
/// the current config from pods still rolling out.
pub fn config_hash(model: &ValidModel) -> Result<String, BuildError> {
    Ok(short_hash(config_yaml(model)?.as_bytes()))
}

fn config_map(model: &ValidModel) -> Result<(ConfigMap, String), BuildError> {
    let yaml = config_yaml(model)?;
    let hash = short_hash(yaml.as_bytes());
    let cm = ConfigMap {
        metadata: metadata(model, owned_name(&model.name)),
        data: Some(BTreeMap::from([(NODE_CONFIG_FILE.to_string(), yaml)])),
        ..ConfigMap::default()
    };
    Ok((cm, hash))
}

/// The claim outlives pods (weights survive restarts) but not the Model. Its spec is immutable
/// once bound except for growth; a shrink or class change is refused by the apiserver and
/// surfaces as `Degraded=True, ApplyFailed`.
fn cache_claim(model: &ValidModel) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: metadata(model, cache_claim_name(&model.name)),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![model.cache.access_mode.as_str().to_string()]),
            storage_class_name: model.cache.storage_class.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: model
                    .cache
                    .size
                    .clone()
                    .map(|s| BTreeMap::from([("storage".to_string(), s)])),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    }
}

/// ClusterIP on the named port; only ready pods are endpoints, which is what the gateway routes to.
fn service(model: &ValidModel) -> Service {
    Service {
        metadata: metadata(model, owned_name(&model.name)),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_string()),
            selector: Some(selector_labels(&model.name)),
            ports: Some(vec![ServicePort {
                name: Some(NODE_PORT_NAME.to_string()),
                port: NODE_PORT,
                target_port: Some(IntOrString::String(NODE_PORT_NAME.to_string())),
                protocol: Some("TCP".to_string()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn pdb(model: &ValidModel) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: metadata(model, owned_name(&model.name)),
        spec: Some(PodDisruptionBudgetSpec {
            // One node pod at a time: voluntary disruptions never take more than one
            // replica of a model away.
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&model.name)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }
}

/// Restricted Pod Security Standard, container level.
fn restricted_container_security() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_string()]),
            ..Capabilities::default()
        }),
        seccomp_profile: Some(runtime_default_seccomp()),
        ..SecurityContext::default()
    }
}

fn runtime_default_seccomp() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".to_string(),
        ..SeccompProfile::default()
    }
}

fn http_probe(path: &str, period: i32, failures: i32, timeout: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String(NODE_PORT_NAME.to_string()),
            scheme: Some("HTTP".to_string()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(timeout),
        ..Probe::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_string(),
        mount_path: path.to_string(),
        read_only: Some(read_only),
        ..VolumeMount::default()
    }
}

fn empty_dir(name: &str, size_limit: Option<Quantity>) -> Volume {
    Volume {
        name: name.to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit,
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// `plugin-{i}-{engine}-{backend}`, a valid container and volume name (DNS label, ≤ 63).
fn plugin_slot_name(index: usize, plugin: &EnginePlugin) -> String {
    let engine: String = plugin
        .spec
        .engine_id
        .chars()
        .map(|c| if c == '_' { '-' } else { c })
        .collect();
    let mut name = format!(
        "plugin-{index}-{engine}-{}",
        plugin.spec.gpu_backend.as_str()
    );
    name.truncate(63);
    name.trim_end_matches('-').to_string()
}

/// Where a plugin lives on the node: `/opt/gantry/engines/{engineId}/{gpuBackend}`.
fn plugin_target(plugin: &EnginePlugin) -> String {
    format!(
        "{NODE_PLUGINS_DIR}/{}/{}",
        plugin.spec.engine_id,
        plugin.spec.gpu_backend.as_str()
    )
}

fn env_from_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_string(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn env_from_secret(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_string(),
                key: key.to_string(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn deployment(
    model: &ValidModel,
    plugins: &[&EnginePlugin],
    config_hash: &str,
    settings: &Settings,
) -> Deployment {
    const CONFIG: &str = "config";
    const ENGINES: &str = "engines";
    const CACHE: &str = "cache";
    const TMP: &str = "tmp";
    const SOURCE: &str = "model-source";

    let mut volumes = vec![
        Volume {
            name: CONFIG.to_string(),
            config_map: Some(ConfigMapVolumeSource {
                name: owned_name(&model.name),
                items: Some(vec![KeyToPath {
                    key: NODE_CONFIG_FILE.to_string(),
                    path: NODE_CONFIG_FILE.to_string(),
                    ..KeyToPath::default()
                }]),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        },
        empty_dir(ENGINES, Some(Quantity("2Gi".to_string()))),
        match model.cache.type_ {
            CacheType::EmptyDir => empty_dir(CACHE, model.cache.size.clone()),
            CacheType::PersistentVolumeClaim => Volume {
                name: CACHE.to_string(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: cache_claim_name(&model.name),
                    read_only: Some(false),
                }),
                ..Volume::default()
            },
        },
        // The root filesystem is read-only; the node may still need scratch space.
        empty_dir(TMP, Some(Quantity("1Gi".to_string()))),
    ];
    let image_volumes = plugins
        .iter()
        .any(|p| p.spec.mount_strategy == MountStrategy::ImageVolume);
    let mut node_mounts = vec![
        mount(CONFIG, NODE_CONFIG_DIR, true),
        // Read-only unless image volumes are nested inside it: the runtime must be able to
        // create their mount points.
        mount(ENGINES, NODE_PLUGINS_DIR, !image_volumes),
        mount(CACHE, NODE_CACHE_DIR, false),
        mount(TMP, "/tmp", false),
    ];
    if let Some(claim) = &model.source.claim {
        volumes.push(Volume {
            name: SOURCE.to_string(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.clone(),
                read_only: Some(true),
            }),
            ..Volume::default()
        });
        node_mounts.push(mount(SOURCE, &format!("{NODE_MODELS_DIR}/{claim}"), true));
    }

    // Engine selection never hands over two plugins with the same engine id and backend, so
    // each plugin gets its own `/opt/gantry/engines/{engineId}/{gpuBackend}` directory.
    let mut init_containers = Vec::new();
    for (i, plugin) in plugins.iter().enumerate() {
        let slot = plugin_slot_name(i, plugin);
        let target = plugin_target(plugin);
        match plugin.spec.mount_strategy {
            MountStrategy::InitContainer => init_containers.push(Container {
                name: slot,
                image: Some(plugin.spec.image.clone()),
                image_pull_policy: Some("IfNotPresent".to_string()),
                command: Some(vec![
                    PLUGIN_COPIER.to_string(),
                    plugin.spec.library_path(),
                    target,
                ]),
                volume_mounts: Some(vec![mount(ENGINES, NODE_PLUGINS_DIR, false)]),
                resources: Some(ResourceRequirements {
                    requests: Some(BTreeMap::from([
                        ("cpu".to_string(), Quantity("10m".to_string())),
                        ("memory".to_string(), Quantity("32Mi".to_string())),
                    ])),
                    limits: Some(BTreeMap::from([(
                        "memory".to_string(),
                        Quantity("128Mi".to_string()),
                    )])),
                    ..ResourceRequirements::default()
                }),
                security_context: Some(restricted_container_security()),
                ..Container::default()
            }),
            MountStrategy::ImageVolume => {
                volumes.push(Volume {
                    name: slot.clone(),
                    image: Some(ImageVolumeSource {
                        reference: Some(plugin.spec.image.clone()),
                        pull_policy: Some("IfNotPresent".to_string()),
                    }),
                    ..Volume::default()
                });
                node_mounts.push(VolumeMount {
                    sub_path: Some(
                        plugin
                            .spec
                            .library_path()
                            .trim_start_matches('/')
                            .to_string(),
                    ),
                    ..mount(&slot, &target, true)
                });
            }
        }
    }

    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    if let Some(cpu) = &model.cpu {
        // CPU is requested, not limited: CFS throttling stalls token generation.
        requests.insert("cpu".to_string(), cpu.clone());
    }
    if let Some(mem) = &model.memory {
        requests.insert("memory".to_string(), mem.clone());
        limits.insert("memory".to_string(), mem.clone());
    }
    if model.gpus > 0 {
        let gpus = Quantity(model.gpus.to_string());
        requests.insert(model.gpu_resource.clone(), gpus.clone());
        limits.insert(model.gpu_resource.clone(), gpus);
    }

    let mut env = vec![
        EnvVar {
            name: "GANTRY_BACKEND".to_string(),
            value: Some(model.backend.as_str().to_string()),
            ..EnvVar::default()
        },
        env_from_field("POD_NAME", "metadata.name"),
        env_from_field("POD_NAMESPACE", "metadata.namespace"),
    ];
    // The token never enters the ConfigMap: only a reference to the Secret reaches the pod.
    if let Some((secret, key)) = &model.source.secret {
        env.push(env_from_secret("GANTRY_SOURCE_TOKEN", secret, key));
        if model.source.is_hugging_face() {
            env.push(env_from_secret("HF_TOKEN", secret, key));
        }
    }
    // S3 credentials and endpoint come as the standard `AWS_*` keys of the same Secret
    // (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optional `AWS_SESSION_TOKEN`,
    // `AWS_ENDPOINT_URL`, `AWS_REGION`): the whole Secret is exposed as environment.
    let env_from = match &model.source.secret {
        Some((secret, _)) if model.source.is_s3() => Some(vec![EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: secret.clone(),
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        }]),
        _ => None,
    };

    let node = Container {
        name: "node".to_string(),
        image: Some(settings.node_image.clone()),
        image_pull_policy: Some("IfNotPresent".to_string()),
        command: Some(vec!["gantry-node".to_string()]),
        args: Some(vec![
            "serve".to_string(),
            "--config".to_string(),
            format!("{NODE_CONFIG_DIR}/{NODE_CONFIG_FILE}"),
            "--plugins-dir".to_string(),
            NODE_PLUGINS_DIR.to_string(),
            "--listen".to_string(),
            format!("0.0.0.0:{NODE_PORT}"),
        ]),
        env: Some(env),
        env_from,
        ports: Some(vec![ContainerPort {
            name: Some(NODE_PORT_NAME.to_string()),
            container_port: NODE_PORT,
            protocol: Some("TCP".to_string()),
            ..ContainerPort::default()
        }]),
        // Start-up covers download and eager load: up to an hour before liveness takes over.
        startup_probe: Some(http_probe("/readyz", 10, 360, 2)),
        readiness_probe: Some(http_probe("/readyz", 5, 3, 2)),
        liveness_probe: Some(http_probe("/healthz", 10, 3, 5)),
        resources: Some(ResourceRequirements {
            requests: (!requests.is_empty()).then_some(requests),
            limits: (!limits.is_empty()).then_some(limits),
            ..ResourceRequirements::default()
        }),
        security_context: Some(restricted_container_security()),
        volume_mounts: Some(node_mounts),
        ..Container::default()
    };

    // The EnginePlugin reconcile finds the pods that should report a plugin by this annotation.
    let plugin_names: Vec<String> = plugins.iter().map(|p| p.name_any()).collect();
    let scheduling = &model.scheduling;
    let pod = PodSpec {
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        // The node drains in-flight streams on SIGTERM.
        termination_grace_period_seconds: Some(60),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            fs_group: Some(65532),
            seccomp_profile: Some(runtime_default_seccomp()),
            ..PodSecurityContext::default()
        }),
        node_selector: (!scheduling.node_selector.is_empty())
            .then(|| scheduling.node_selector.clone()),
        tolerations: (!scheduling.tolerations.is_empty()).then(|| scheduling.tolerations.clone()),
        affinity: scheduling.affinity.clone(),
        runtime_class_name: scheduling.runtime_class_name.clone(),
        init_containers: (!init_containers.is_empty()).then_some(init_containers),
        containers: vec![node],
        volumes: Some(volumes),
        ..PodSpec::default()
    };

    // GPU pods roll one down, one up (no spare GPU needed); CPU pods surge first (no downtime).
    let rolling = if model.gpus > 0 {
        RollingUpdateDeployment {
            max_surge: Some(IntOrString::Int(0)),
            max_unavailable: Some(IntOrString::Int(1)),
        }
    } else {
        RollingUpdateDeployment {
            max_surge: Some(IntOrString::Int(1)),
            max_unavailable: Some(IntOrString::Int(0)),
        }
    };

    Deployment {
        metadata: metadata(model, owned_name(&model.name)),
        spec: DeploymentSpec {
            // Left out: the apply step sets it once at creation and hands it to the autoscaler
            // (or the HPA), so a re-apply never resets the count.
            replicas: None,
            revision_history_limit: Some(3),
            progress_deadline_seconds: Some(3900),
            selector: LabelSelector {
                match_labels: Some(selector_labels(&model.name)),
                ..LabelSelector::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".to_string()),
                rolling_update: Some(rolling),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(names::object_labels(&model.name)),
                    annotations: Some(BTreeMap::from([
                        (ANNOTATION_CONFIG_HASH.to_string(), config_hash.to_string()),
                        (ANNOTATION_PLUGINS.to_string(), plugin_names.join(",")),
                    ])),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            ..DeploymentSpec::default()
        },
        ..Deployment::default()
    }
}
