//! Model reconcile, build step (pure): the objects the node pods read — the ConfigMap with the
//! rendered node config, the model cache PersistentVolumeClaim (`cache.type:
//! PersistentVolumeClaim`) and the Secret with the Model's node token (install token set).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    ConfigMap, PersistentVolumeClaim, PersistentVolumeClaimSpec, Secret, VolumeResourceRequirements,
};

use super::meta::metadata;
use crate::model::node_config::RenderedConfig;
use crate::model::validate::ValidModel;
use gantry_api::node_token::{ModelToken, NODE_TOKEN_SECRET_KEY};
use gantry_crd::names::{NODE_CONFIG_FILE, cache_claim_name, node_token_secret_name, owned_name};

pub(super) fn config_map(model: &ValidModel, config: &RenderedConfig) -> ConfigMap {
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
pub(super) fn cache_claim(model: &ValidModel) -> PersistentVolumeClaim {
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

/// The Model's node token, under `token`. Only the node pods' kubelet reads it (env
/// `GANTRY_NODE_TOKEN`); anyone who may read Secrets in the Model's namespace learns this
/// Model's token and no other (it is derived from the install token, which stays in the
/// operator's namespace).
pub(super) fn node_token_secret(model: &ValidModel, token: &ModelToken) -> Secret {
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
