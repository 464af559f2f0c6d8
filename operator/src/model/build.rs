//! Model reconcile, build step (pure, no client): the desired ConfigMap, Deployment, Service,
//! PodDisruptionBudget, cache PersistentVolumeClaim, (HPA mode) HorizontalPodAutoscaler, and —
//! when the operator runs with an install token / network policies — the node-token Secret and
//! the NetworkPolicy of one Model.
//!
//! Output depends only on the validated Model, its rendered node config
//! (`model::node_config`), the plugins chosen by engine selection and the
//! operator settings, so the same inputs always give
//! byte-identical objects. Each object carries the hash of its own content
//! (`gantry.dev/applied-hash`); the apply step compares it with the live
//! object's to decide whether anything needs writing.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, HPAScalingRules, HorizontalPodAutoscaler,
    HorizontalPodAutoscalerBehavior, HorizontalPodAutoscalerSpec, MetricIdentifier, MetricSpec,
    MetricTarget, PodsMetricSource,
};
use k8s_openapi::api::core::v1::{
    ConfigMap, PersistentVolumeClaim, PersistentVolumeClaimSpec, PodTemplateSpec, Secret, Service,
    ServicePort, ServiceSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
    NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use serde::Serialize;

use crate::context::{NodeNetworkPolicy, PluginDelivery, Settings};
use crate::model::node_config::{self, RenderError, RenderedConfig, short_hash};
use crate::model::validate::ValidModel;
use gantry_api::node_token::{ModelToken, NODE_TOKEN_SECRET_KEY};
use gantry_crd::names::*;
use gantry_crd::{AutoscalingMode, CacheType, EnginePlugin};

pub mod pod;

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
    /// The Model's node token (`settings.node_token` set): the pods read it through a
    /// `secretKeyRef`, so the token never appears in the Deployment.
    pub node_token_secret: Option<Secret>,
    /// Who may reach the node pods (`settings.network_policy` set).
    pub network_policy: Option<NetworkPolicy>,
    /// `spec.replicas` of a Deployment being created. The built Deployment leaves the field out:
    /// after creation it belongs to the autoscaler (docs/autoscaling.md, "Who owns replicas").
    pub initial_replicas: i32,
}

/// Why objects could not be built. Only serialization can fail, which is a bug, not user input.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Render(#[from] RenderError),
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
            BuildError::Render(e) => e.metric_label(),
            BuildError::Hash { .. } => "build_hash",
        }
    }
}

/// Build every owned object for `model`, mounting `plugins`: renders the node config (its
/// `isolation` covering `plugins`), then [`assemble`]s. The reconcile has rendered it already
/// (the observe step needs its hash), for every plugin the pods may mount, and calls
/// [`assemble`] directly; the two agree wherever no plugin sets `spec.isolation` or the
/// architecture is still pending.
pub fn build(
    model: &ValidModel,
    plugins: &[&EnginePlugin],
    settings: &Settings,
) -> Result<OwnedObjects, BuildError> {
    let config = node_config::render(model, plugins)?;
    assemble(model, &config, plugins, settings)
}

/// Every owned object for `model` running the rendered node `config`, mounting `plugins`.
pub fn assemble(
    model: &ValidModel,
    config: &RenderedConfig,
    plugins: &[&EnginePlugin],
    settings: &Settings,
) -> Result<OwnedObjects, BuildError> {
    let config_map = config_map(model, config);
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
    let token = settings
        .node_token
        .as_ref()
        .map(|t| t.for_model(&model.namespace, &model.name));
    let node_token_secret = match &token {
        Some(t) => Some(stamp(node_token_secret(model, t), "Secret")?),
        None => None,
    };
    let network_policy = match &settings.network_policy {
        Some(p) => Some(stamp(network_policy(model, p), "NetworkPolicy")?),
        None => None,
    };
    Ok(OwnedObjects {
        hpa,
        node_token_secret,
        network_policy,
        initial_replicas: initial_replicas(model),
        config_map: stamp(config_map, "ConfigMap")?,
        pvc,
        deployment: stamp(
            deployment(model, plugins, &config.hash, token.as_ref(), settings),
            "Deployment",
        )?,
        service: stamp(service(model), "Service")?,
        pdb,
        config_hash: config.hash.clone(),
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

/// `controller: true` makes the garbage collector delete the object with its Model and lets
/// the apply step tell our objects from a user's of the same name; `blockOwnerDeletion` keeps
/// a foreground deletion of the Model waiting until they are gone.
fn owner_reference(model: &ValidModel) -> OwnerReference {
    OwnerReference {
        api_version: format!("{API_GROUP}/{API_VERSION}"),
        kind: model.owner.kind.to_string(),
        name: model.owner.name.clone(),
        uid: model.uid.clone(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// [`object_labels`], and on a pool's objects and pods the pool's name.
fn labels(model: &ValidModel) -> BTreeMap<String, String> {
    let mut labels = object_labels(&model.name);
    if model.owner.kind == POOL_KIND {
        labels.insert(LABEL_POOL.to_string(), model.owner.name.clone());
    }
    labels
}

fn metadata(model: &ValidModel, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(model.namespace.clone()),
        labels: Some(labels(model)),
        owner_references: Some(vec![owner_reference(model)]),
        ..ObjectMeta::default()
    }
}

/// `gantry.dev/pod-spec-hash`: the pod spec's hash without the images of the plugins in
/// `in_place` (which a delivery changes without a new template).
fn pod_spec_hash(
    pod: &k8s_openapi::api::core::v1::PodSpec,
    in_place: &[(String, &EnginePlugin)],
) -> String {
    let mut pod = pod.clone();
    for c in pod.init_containers.iter_mut().flatten() {
        if in_place.iter().any(|(slot, _)| *slot == c.name) {
            c.image = None;
        }
    }
    // A PodSpec always serializes; an empty hash would only make every pod look current.
    short_hash(&serde_json::to_vec(&pod).unwrap_or_default())
}

/// `gantry.dev/plugin-images` as written: compact JSON, keys sorted.
fn plugin_images_text<K: AsRef<str> + Ord, V: AsRef<str>>(images: &BTreeMap<K, V>) -> String {
    let map: serde_json::Map<String, serde_json::Value> = images
        .iter()
        .map(|(k, v)| (k.as_ref().to_string(), v.as_ref().into()))
        .collect();
    serde_json::Value::Object(map).to_string()
}

/// The `gantry.dev/plugin-images` of a Deployment (empty when absent or unreadable).
pub fn plugin_images(deployment: &Deployment) -> BTreeMap<String, String> {
    deployment
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_PLUGIN_IMAGES))
        .and_then(|text| serde_json::from_str(text).ok())
        .unwrap_or_default()
}

/// Keep the live template's images of in-place plugins when they are all that changed.
///
/// When `desired` differs from `live` only in the images of plugins that take new versions in
/// place (`gantry.dev/plugin-images`), applying it would roll every pod to load a plugin the
/// running pods can shadow-load. Then `desired`'s Deployment becomes the live one exactly (the
/// template keeps the old images, so nothing is written and nothing rolls) and this returns
/// `true`: the deliver step brings the new images to the pods. Any other change (config,
/// node image, another plugin set) rolls as usual, with the new images in the new template.
pub fn hold_plugin_images(
    desired: &mut OwnedObjects,
    live: Option<&Deployment>,
) -> Result<bool, BuildError> {
    let Some(live) = live else {
        return Ok(false);
    };
    let live_hash = crate::cache::applied_hash(&live.metadata);
    if live_hash.is_none() || live_hash == crate::cache::applied_hash(&desired.deployment.metadata)
    {
        return Ok(false);
    }
    let held = plugin_images(live);
    let mut images = plugin_images(&desired.deployment);
    let mut variant = desired.deployment.clone();
    let mut changed = false;
    let containers = variant
        .spec
        .template
        .spec
        .as_mut()
        .and_then(|s| s.init_containers.as_mut());
    for c in containers.into_iter().flatten() {
        if let (Some(now), Some(old)) = (images.get_mut(&c.name), held.get(&c.name))
            && now != old
        {
            c.image = Some(old.clone());
            *now = old.clone();
            changed = true;
        }
    }
    if !changed {
        return Ok(false);
    }
    let annotations = variant.annotations_mut();
    annotations.remove(ANNOTATION_APPLIED_HASH);
    annotations.insert(
        ANNOTATION_PLUGIN_IMAGES.to_string(),
        plugin_images_text(&images),
    );
    let variant = stamp(variant, "Deployment")?;
    if crate::cache::applied_hash(&variant.metadata) != live_hash {
        return Ok(false);
    }
    desired.deployment = variant;
    Ok(true)
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

/// The Model's node token, under `token`. Only the node pods' kubelet reads it (env
/// `GANTRY_NODE_TOKEN`); anyone who may read Secrets in the Model's namespace learns this
/// Model's token and no other (it is derived from the install token, which stays in the
/// operator's namespace).
fn node_token_secret(model: &ValidModel, token: &ModelToken) -> Secret {
    Secret {
        metadata: metadata(model, node_token_secret_name(&model.name)),
        type_: Some("Opaque".to_string()),
        data: Some(BTreeMap::from([(
            NODE_TOKEN_SECRET_KEY.to_string(),
            ByteString(token.as_str().as_bytes().to_vec()),
        )])),
        ..Secret::default()
    }
}

/// The label every namespace carries with its own name (set by the apiserver since 1.22).
const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";

fn namespace_peer(namespace: &str, pods: Option<&BTreeMap<String, String>>) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                LABEL_NAMESPACE_NAME.to_string(),
                namespace.to_string(),
            )])),
            ..LabelSelector::default()
        }),
        pod_selector: pods.map(|labels| LabelSelector {
            match_labels: Some(labels.clone()),
            ..LabelSelector::default()
        }),
        ..NetworkPolicyPeer::default()
    }
}

fn tcp(port: i32) -> NetworkPolicyPort {
    NetworkPolicyPort {
        port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".to_string()),
        ..NetworkPolicyPort::default()
    }
}

/// Default-deny for the node pods: ingress on the node port only from the operator and gateway
/// pods (and Prometheus, when named); egress only to DNS and TCP 443 (model downloads). The
/// kubelet's probes are not subject to NetworkPolicy.
fn network_policy(model: &ValidModel, p: &NodeNetworkPolicy) -> NetworkPolicy {
    let mut ingress = vec![NetworkPolicyIngressRule {
        from: Some(vec![namespace_peer(
            &p.peer_namespace,
            Some(&p.peer_labels),
        )]),
        ports: Some(vec![tcp(NODE_PORT)]),
    }];
    if let Some(ns) = &p.metrics_namespace {
        ingress.push(NetworkPolicyIngressRule {
            from: Some(vec![namespace_peer(ns, None)]),
            ports: Some(vec![tcp(NODE_PORT)]),
        });
    }
    let dns = NetworkPolicyEgressRule {
        to: None,
        ports: Some(vec![
            NetworkPolicyPort {
                protocol: Some("UDP".to_string()),
                ..tcp(53)
            },
            tcp(53),
        ]),
    };
    let downloads = NetworkPolicyEgressRule {
        to: (!p.download_cidrs.is_empty()).then(|| {
            p.download_cidrs
                .iter()
                .map(|cidr| NetworkPolicyPeer {
                    ip_block: Some(IPBlock {
                        cidr: cidr.clone(),
                        except: None,
                    }),
                    ..NetworkPolicyPeer::default()
                })
                .collect()
        }),
        ports: Some(vec![tcp(443)]),
    };
    NetworkPolicy {
        metadata: metadata(model, owned_name(&model.name)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&model.name)),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".to_string(), "Egress".to_string()]),
            ingress: Some(ingress),
            egress: Some(vec![dns, downloads]),
        }),
    }
}

fn config_map(model: &ValidModel, config: &RenderedConfig) -> ConfigMap {
    ConfigMap {
        metadata: metadata(model, owned_name(&model.name)),
        data: Some(BTreeMap::from([(
            NODE_CONFIG_FILE.to_string(),
            config.yaml.clone(),
        )])),
        ..ConfigMap::default()
    }
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

fn deployment(
    model: &ValidModel,
    plugins: &[&EnginePlugin],
    config_hash: &str,
    token: Option<&ModelToken>,
    settings: &Settings,
) -> Deployment {
    // The EnginePlugin reconcile finds the pods that should report a plugin by this annotation.
    let plugin_names: Vec<String> = plugins.iter().map(|p| p.name_any()).collect();
    let pod = pod::pod_spec(model, plugins, token.is_some(), settings);
    let in_place = pod::in_place_slots(plugins);
    let mut annotations = BTreeMap::from([
        (ANNOTATION_CONFIG_HASH.to_string(), config_hash.to_string()),
        (ANNOTATION_PLUGINS.to_string(), plugin_names.join(",")),
        (
            ANNOTATION_POD_SPEC_HASH.to_string(),
            pod_spec_hash(&pod, &in_place),
        ),
    ]);
    if let Some(t) = token {
        // A new token (rotated install token) must reach running pods: env is read at start.
        annotations.insert(
            ANNOTATION_NODE_TOKEN_HASH.to_string(),
            short_hash(t.as_str().as_bytes()),
        );
    }

    // `spec.rollout`: Surge (default) starts new pods before removing old ones, so even one
    // replica rolls without downtime; InPlace removes first, for clusters without a spare GPU.
    let rolling = RollingUpdateDeployment {
        max_surge: Some(IntOrString::Int(model.rollout.max_surge)),
        max_unavailable: Some(IntOrString::Int(model.rollout.max_unavailable)),
    };

    let mut meta = metadata(model, owned_name(&model.name));
    // Which template images may stay behind while a new version is delivered in place.
    if settings.plugin_delivery == PluginDelivery::InPlace && !in_place.is_empty() {
        let images: BTreeMap<&str, &str> = in_place
            .iter()
            .map(|(slot, p)| (slot.as_str(), p.spec.image.as_str()))
            .collect();
        meta.annotations = Some(BTreeMap::from([(
            ANNOTATION_PLUGIN_IMAGES.to_string(),
            plugin_images_text(&images),
        )]));
    }

    Deployment {
        metadata: meta,
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
                    labels: Some(labels(model)),
                    annotations: Some(annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            ..DeploymentSpec::default()
        },
        ..Deployment::default()
    }
}
