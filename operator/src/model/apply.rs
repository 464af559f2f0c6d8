//! Model reconcile, apply step: server-side applies the built objects that differ from what
//! the cluster holds, and removes the Deployment and PDB when the Model must run no pods.
//!
//! An object is written only when it is missing or its `gantry.dev/applied-hash`
//! differs from the desired one, so a steady-state reconcile writes nothing.
//! An object of the same name that this Model does not control is never
//! touched: the step fails with `NotOwned` and the status says so.

use std::fmt::Debug;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::Api;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::CONTROLLER;
use super::build::OwnedObjects;
use super::read::Observed;
use super::validate::ValidModel;
use crate::context::Context;
use crate::names::ANNOTATION_APPLIED_HASH;
use crate::write::{self, Retry, classify};

/// What the cluster holds after the apply step.
#[derive(Clone, Debug, Default)]
pub struct Applied {
    /// The Deployment as the apiserver returned it (or as read, when unchanged).
    pub deployment: Option<Deployment>,
    /// Kinds written, in order (for logs and tests).
    pub writes: Vec<&'static str>,
}

/// Why the apply step failed.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("{kind} {name} exists and is not controlled by this Model; rename or remove it")]
    NotOwned { kind: &'static str, name: String },
    #[error("cannot {verb} {kind} {name}: {source}")]
    Api {
        verb: &'static str,
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl ApplyError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ApplyError::NotOwned { .. } => "apply_not_owned",
            ApplyError::Api { source, .. } => match classify(source) {
                Retry::Permanent => "apply_refused",
                Retry::Transient => "apply_transient",
            },
        }
    }

    pub fn retry(&self) -> Retry {
        match self {
            ApplyError::NotOwned { .. } => Retry::Permanent,
            ApplyError::Api { source, .. } => classify(source),
        }
    }
}

fn controlled_by(obj: &impl Resource, uid: &str) -> bool {
    obj.meta()
        .owner_references
        .iter()
        .flatten()
        .any(|r| r.uid == uid && r.controller == Some(true))
}

fn hash_of(obj: &impl Resource) -> Option<&String> {
    obj.meta()
        .annotations
        .as_ref()?
        .get(ANNOTATION_APPLIED_HASH)
}

/// Apply `desired` if `live` is missing or stale; returns the object as it now stands.
async fn ensure<K>(
    api: &Api<K>,
    kind: &'static str,
    desired: &K,
    live: Option<&K>,
    model: &ValidModel,
    ctx: &Context,
    writes: &mut Vec<&'static str>,
) -> Result<K, ApplyError>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    if let Some(live) = live {
        if !controlled_by(live, &model.uid) {
            return Err(ApplyError::NotOwned {
                kind,
                name: live.name_any(),
            });
        }
        // Same hash: what we applied last is what we would apply now. Fields defaulted or
        // managed by others (status, replicas set by an HPA) do not enter the comparison.
        if hash_of(live).is_some() && hash_of(live) == hash_of(desired) {
            return Ok(live.clone());
        }
    }
    writes.push(kind);
    write::apply(api, desired, &ctx.metrics, CONTROLLER)
        .await
        .map_err(|source| ApplyError::Api {
            verb: "apply",
            kind,
            name: desired.name_any(),
            source,
        })
}

/// Delete `live` if it exists and this Model controls it.
async fn remove<K>(
    api: &Api<K>,
    kind: &'static str,
    live: Option<&K>,
    model: &ValidModel,
    ctx: &Context,
    writes: &mut Vec<&'static str>,
) -> Result<(), ApplyError>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
{
    // Only what this Model controls is ever deleted.
    let Some(live) = live.filter(|l| controlled_by(*l, &model.uid)) else {
        return Ok(());
    };
    writes.push(kind);
    write::delete(api, &live.name_any(), &ctx.metrics, CONTROLLER)
        .await
        .map_err(|source| ApplyError::Api {
            verb: "delete",
            kind,
            name: live.name_any(),
            source,
        })
}

/// Bring the cluster to `desired`. `None` means the Model must run no pods (no engine):
/// the Deployment and PDB go; ConfigMap, Service and cache claim are left as they are.
pub async fn apply(
    model: &ValidModel,
    desired: Option<&OwnedObjects>,
    observed: &Observed,
    ctx: &Context,
) -> Result<Applied, ApplyError> {
    let client = ctx.client.clone();
    let ns = &model.namespace;
    let deployments = Api::<Deployment>::namespaced(client.clone(), ns);
    let pdbs = Api::<PodDisruptionBudget>::namespaced(client.clone(), ns);
    let mut writes = Vec::new();
    let Some(desired) = desired else {
        remove(
            &deployments,
            "Deployment",
            observed.deployment.as_ref(),
            model,
            ctx,
            &mut writes,
        )
        .await?;
        remove(
            &pdbs,
            "PodDisruptionBudget",
            observed.pdb.as_ref(),
            model,
            ctx,
            &mut writes,
        )
        .await?;
        return Ok(Applied {
            deployment: None,
            writes,
        });
    };
    // Order: config and storage before the pods that mount them, the Service after.
    ensure(
        &Api::<ConfigMap>::namespaced(client.clone(), ns),
        "ConfigMap",
        &desired.config_map,
        observed.config_map.as_ref(),
        model,
        ctx,
        &mut writes,
    )
    .await?;
    if let Some(pvc) = &desired.pvc {
        ensure(
            &Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns),
            "PersistentVolumeClaim",
            pvc,
            observed.pvc.as_ref(),
            model,
            ctx,
            &mut writes,
        )
        .await?;
    }
    let deployment = ensure(
        &deployments,
        "Deployment",
        &desired.deployment,
        observed.deployment.as_ref(),
        model,
        ctx,
        &mut writes,
    )
    .await?;
    ensure(
        &Api::<Service>::namespaced(client, ns),
        "Service",
        &desired.service,
        observed.service.as_ref(),
        model,
        ctx,
        &mut writes,
    )
    .await?;
    match &desired.pdb {
        Some(pdb) => {
            ensure(
                &pdbs,
                "PodDisruptionBudget",
                pdb,
                observed.pdb.as_ref(),
                model,
                ctx,
                &mut writes,
            )
            .await?;
        }
        None => {
            remove(
                &pdbs,
                "PodDisruptionBudget",
                observed.pdb.as_ref(),
                model,
                ctx,
                &mut writes,
            )
            .await?;
        }
    }
    Ok(Applied {
        deployment: Some(deployment),
        writes,
    })
}
