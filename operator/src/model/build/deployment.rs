//! Model reconcile, build step (pure): the node Deployment — its pod template from
//! `build/pod.rs`, the template annotations that tell a current pod (config hash, plugins,
//! pod-spec hash, node-token hash), the rollout strategy — and the `gantry.dev/plugin-images`
//! record that lets `build::hold_plugin_images` keep the live images of in-place plugins.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{PodSpec, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use super::meta::{labels, metadata};
use super::pod;
use crate::context::{PluginDelivery, Settings};
use crate::model::node_config::short_hash;
use crate::model::validate::ValidModel;
use gantry_api::node_token::ModelToken;
use gantry_crd::EnginePlugin;
use gantry_crd::names::{
    ANNOTATION_CONFIG_HASH, ANNOTATION_NODE_TOKEN_HASH, ANNOTATION_PLUGIN_IMAGES,
    ANNOTATION_PLUGINS, ANNOTATION_POD_SPEC_HASH, owned_name, selector_labels,
};

/// `gantry.dev/pod-spec-hash`: the pod spec's hash without the images of the plugins in
/// `in_place` (which a delivery changes without a new template).
pub(super) fn pod_spec_hash(pod: &PodSpec, in_place: &[(String, &EnginePlugin)]) -> String {
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
pub(super) fn plugin_images_text<K: AsRef<str> + Ord, V: AsRef<str>>(
    images: &BTreeMap<K, V>,
) -> String {
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

pub(super) fn deployment(
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
