//! Model reconcile, build step (pure): what every owned object carries in its metadata — its
//! name and namespace, the Gantry labels (and a pool's name on a pool's objects), and the
//! controller reference to the Model or ModelPool that owns it.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::model::validate::ValidModel;
use gantry_crd::names::{API_GROUP, API_VERSION, LABEL_POOL, POOL_KIND, object_labels};

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
pub(super) fn labels(model: &ValidModel) -> BTreeMap<String, String> {
    let mut labels = object_labels(&model.name);
    if model.owner.kind == POOL_KIND {
        labels.insert(LABEL_POOL.to_string(), model.owner.name.clone());
    }
    labels
}

pub(super) fn metadata(model: &ValidModel, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(model.namespace.clone()),
        labels: Some(labels(model)),
        owner_references: Some(vec![owner_reference(model)]),
        ..ObjectMeta::default()
    }
}
