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
//!
//! This file assembles and stamps the objects, and keeps the live images of in-place plugins
//! ([`hold_plugin_images`]); each object is built by the child that knows its kind:
//! `deployment` (its pod template in `pod`), `inputs` (ConfigMap, cache claim, node-token
//! Secret), `network` (Service, NetworkPolicy), `scaling` (HPA, PDB, first replica count), with
//! the metadata every object carries from `meta`.

mod deployment;
mod inputs;
mod meta;
mod network;
pub mod pod;
mod scaling;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use serde::Serialize;

use crate::context::Settings;
use crate::model::applied::applied_hash;
use crate::model::node_config::{self, RenderError, RenderedConfig, short_hash};
use crate::model::validate::ValidModel;
use gantry_crd::names::{ANNOTATION_APPLIED_HASH, ANNOTATION_PLUGIN_IMAGES};
use gantry_crd::{AutoscalingMode, CacheType, EnginePlugin};

pub use deployment::plugin_images;
pub use scaling::{HPA_METRIC_KV_USAGE, HPA_METRIC_WAITING, initial_replicas};

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
    let config_map = inputs::config_map(model, config);
    let pvc = match model.cache.type_ {
        CacheType::PersistentVolumeClaim => {
            Some(stamp(inputs::cache_claim(model), "PersistentVolumeClaim")?)
        }
        CacheType::EmptyDir => None,
    };
    let pdb = if model.replicas.min > 1 {
        Some(stamp(scaling::pdb(model), "PodDisruptionBudget")?)
    } else {
        None
    };
    let hpa = match model.autoscaling.mode {
        AutoscalingMode::Hpa => Some(stamp(scaling::hpa(model), "HorizontalPodAutoscaler")?),
        AutoscalingMode::Builtin => None,
    };
    let token = settings
        .node_token
        .as_ref()
        .map(|t| t.for_model(&model.namespace, &model.name));
    let node_token_secret = match &token {
        Some(t) => Some(stamp(inputs::node_token_secret(model, t), "Secret")?),
        None => None,
    };
    let network_policy = match &settings.network_policy {
        Some(p) => Some(stamp(network::network_policy(model, p), "NetworkPolicy")?),
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
            deployment::deployment(model, plugins, &config.hash, token.as_ref(), settings),
            "Deployment",
        )?,
        service: stamp(network::service(model), "Service")?,
        pdb,
        config_hash: config.hash.clone(),
    })
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
    let live_hash = applied_hash(&live.metadata);
    if live_hash.is_none() || live_hash == applied_hash(&desired.deployment.metadata) {
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
        deployment::plugin_images_text(&images),
    );
    let variant = stamp(variant, "Deployment")?;
    if applied_hash(&variant.metadata) != live_hash {
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
