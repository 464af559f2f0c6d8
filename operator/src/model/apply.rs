//! Model reconcile, apply step: server-side applies the built objects that differ from what
//! the cluster holds, removes the Deployment, PDB and HPA when the Model must run no pods, and
//! hands the Deployment's replica count over to the autoscaler at creation.
//!
//! An object is written only when it is missing or its `gantry.dev/applied-hash`
//! differs from the desired one, so a steady-state reconcile writes nothing. "Missing" and
//! "differs" are judged on the cache, and on the writes this operator made whose watch event
//! has not arrived yet (`cache::RecentWrites`), so a reconcile racing its own watch events does
//! not write twice. The node-token Secret is the exception: it is not cached, so every
//! reconcile that builds it (a Model's or a pool's, with an install token) judges it on a
//! metadata GET by name, one request, and a Secret deleted by hand comes back at the next
//! reconcile.
//! An object of the same name that this Model does not control is never
//! touched: the step fails with `NotOwned` and the status says so.

use std::fmt::Debug;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::applied::{applied_hash, controlled_by, owns_replicas};
use super::build::OwnedObjects;
use super::controller::CONTROLLER;
use super::read::Observed;
use super::validate::ValidModel;
use crate::context::Context;
use crate::write::{self, Retry, classify};
use gantry_crd::names::FIELD_MANAGER;

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

/// The recent-write marker of a delete (no applied hash has this form).
const DELETED: &str = "-";

/// Whether `live` (or a write of ours still on its way to the cache) already holds `desired`.
fn current(kind: &str, desired: &ObjectMeta, live: Option<&ObjectMeta>, ctx: &Context) -> bool {
    let Some(hash) = applied_hash(desired) else {
        return false;
    };
    // Same hash: what we applied last is what we would apply now. Fields defaulted or
    // managed by others (status, replicas set by an HPA) do not enter the comparison.
    live.and_then(applied_hash) == Some(hash)
        || ctx.caches.recent.holds(
            kind,
            desired.namespace.as_deref().unwrap_or_default(),
            desired.name.as_deref().unwrap_or_default(),
            hash,
        )
}

/// Apply `desired` if `live` is missing or stale; returns the applied object, or `None` when
/// `live` already holds it.
async fn ensure<K>(
    api: &Api<K>,
    kind: &'static str,
    desired: &K,
    live: Option<&ObjectMeta>,
    model: &ValidModel,
    ctx: &Context,
    writes: &mut Vec<&'static str>,
) -> Result<Option<K>, ApplyError>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    if let Some(live) = live
        && !controlled_by(live, &model.uid)
    {
        return Err(ApplyError::NotOwned {
            kind,
            name: live.name.clone().unwrap_or_default(),
        });
    }
    if current(kind, desired.meta(), live, ctx) {
        return Ok(None);
    }
    writes.push(kind);
    let applied = write::apply(api, desired, &ctx.metrics, CONTROLLER)
        .await
        .map_err(|source| ApplyError::Api {
            verb: "apply",
            kind,
            name: desired.name_any(),
            source,
        })?;
    if let Some(hash) = applied_hash(desired.meta()) {
        ctx.caches
            .recent
            .wrote(kind, &model.namespace, &desired.name_any(), hash);
    }
    Ok(Some(applied))
}

/// Whether `gantry-operator` is the only manager of the Deployment's `spec.replicas` (a
/// Deployment created before the autoscaler existed, or one whose hand-over failed). Applying
/// the built Deployment, which leaves `replicas` out, would then remove the field and the
/// Deployment would fall back to 1 replica.
pub fn operator_alone_owns_replicas(live: &Deployment) -> bool {
    let owners: Vec<&str> = live
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|e| owns_replicas(e))
        .map(|e| e.manager.as_deref().unwrap_or_default())
        .collect();
    owners.contains(&FIELD_MANAGER) && owners.iter().all(|m| *m == FIELD_MANAGER)
}

async fn hand_over_replicas(
    api: &Api<Deployment>,
    name: &str,
    replicas: i32,
    ctx: &Context,
    writes: &mut Vec<&'static str>,
) -> Result<(), ApplyError> {
    writes.push("Deployment/replicas");
    write::apply_replicas(api, name, replicas, &ctx.metrics, CONTROLLER)
        .await
        .map(drop)
        .map_err(|source| ApplyError::Api {
            verb: "hand over replicas of",
            kind: "Deployment",
            name: name.to_string(),
            source,
        })
}

/// The Deployment's `spec.replicas` belongs to the autoscaler (Builtin) or the HPA, never to
/// this apply after creation:
/// - create: apply with `replicas: initial`, then apply the same count under
///   `gantry-autoscaler`, so the field has a second owner;
/// - update: the built object has no `replicas`, so server-side apply leaves the count alone
///   as long as another manager owns it. If the operator alone owns it (an older operator
///   created it), hand it over first with the live count.
async fn ensure_deployment(
    api: &Api<Deployment>,
    desired: &OwnedObjects,
    live: Option<&Deployment>,
    model: &ValidModel,
    ctx: &Context,
    writes: &mut Vec<&'static str>,
) -> Result<Deployment, ApplyError> {
    let name = desired.deployment.name_any();
    match live {
        None => {
            let mut first = desired.deployment.clone();
            first.spec.replicas = Some(desired.initial_replicas);
            // Written a moment ago and not in the cache yet: the write is on its way.
            if current("Deployment", first.meta(), None, ctx) {
                return Ok(first);
            }
            let created = ensure(api, "Deployment", &first, None, model, ctx, writes).await?;
            hand_over_replicas(api, &name, desired.initial_replicas, ctx, writes).await?;
            Ok(created.unwrap_or(first))
        }
        Some(live) => {
            let stale = !current(
                "Deployment",
                desired.deployment.meta(),
                Some(&live.metadata),
                ctx,
            );
            if stale
                && controlled_by(&live.metadata, &model.uid)
                && operator_alone_owns_replicas(live)
            {
                let replicas = live.spec.replicas.unwrap_or(1);
                hand_over_replicas(api, &name, replicas, ctx, writes).await?;
            }
            let applied = ensure(
                api,
                "Deployment",
                &desired.deployment,
                Some(&live.metadata),
                model,
                ctx,
                writes,
            )
            .await?;
            Ok(applied.unwrap_or_else(|| live.clone()))
        }
    }
}

/// The node-token Secret is not cached (Secrets are never listed or watched: either
/// permission would read every Secret's data), so no delete event tells of one removed by
/// hand. Every reconcile that builds it reads its metadata by name, one GET, and applies it
/// when it is missing or stale; a current one is not written.
async fn ensure_secret(
    api: &Api<Secret>,
    secret: &Secret,
    model: &ValidModel,
    ctx: &Context,
    writes: &mut Vec<&'static str>,
) -> Result<(), ApplyError> {
    let name = secret.name_any();
    let live = api
        .get_metadata_opt(&name)
        .await
        .map_err(|source| ApplyError::Api {
            verb: "get",
            kind: "Secret",
            name: name.clone(),
            source,
        })?;
    // The GET is the apiserver's answer now, not a cache that may lag a write of ours: a
    // Secret missing there is missing, even if this operator applied it moments ago.
    ctx.caches
        .recent
        .seen("Secret", &model.namespace, &name, None);
    ensure(
        api,
        "Secret",
        secret,
        live.as_ref().map(|l| &l.metadata),
        model,
        ctx,
        writes,
    )
    .await?;
    Ok(())
}

/// Delete `live` if it exists and this Model controls it.
async fn remove<K>(
    api: &Api<K>,
    kind: &'static str,
    live: Option<&ObjectMeta>,
    model: &ValidModel,
    ctx: &Context,
    writes: &mut Vec<&'static str>,
) -> Result<(), ApplyError>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
{
    // Only what this Model controls is ever deleted.
    let Some(live) = live.filter(|l| controlled_by(l, &model.uid)) else {
        return Ok(());
    };
    let name = live.name.clone().unwrap_or_default();
    // Deleted a moment ago; the delete event is on its way.
    if ctx
        .caches
        .recent
        .holds(kind, &model.namespace, &name, DELETED)
    {
        return Ok(());
    }
    writes.push(kind);
    write::delete(api, &name, &ctx.metrics, CONTROLLER)
        .await
        .map_err(|source| ApplyError::Api {
            verb: "delete",
            kind,
            name: name.clone(),
            source,
        })?;
    ctx.caches
        .recent
        .wrote(kind, &model.namespace, &name, DELETED);
    Ok(())
}

/// Bring the cluster to `desired`. `None` means the Model must run no pods (no engine):
/// the Deployment and PDB go; ConfigMap, Service, cache claim, node-token Secret and
/// NetworkPolicy are left as they are. A Secret or NetworkPolicy the operator no longer builds
/// (it was restarted without an install token or network policies) is left too: it goes with
/// the Model.
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
            observed.deployment.as_ref().map(|d| &d.metadata),
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
        remove(
            &Api::<HorizontalPodAutoscaler>::namespaced(client.clone(), ns),
            "HorizontalPodAutoscaler",
            observed.hpa.as_ref(),
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
    // Order: config, token and storage before the pods that use them, the pods' NetworkPolicy
    // before the pods too (a pod never runs unfenced), the Service after.
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
    if let Some(secret) = &desired.node_token_secret {
        ensure_secret(
            &Api::<Secret>::namespaced(client.clone(), ns),
            secret,
            model,
            ctx,
            &mut writes,
        )
        .await?;
    }
    if let Some(policy) = &desired.network_policy {
        ensure(
            &Api::<NetworkPolicy>::namespaced(client.clone(), ns),
            "NetworkPolicy",
            policy,
            observed.network_policy.as_ref(),
            model,
            ctx,
            &mut writes,
        )
        .await?;
    }
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
    let deployment = ensure_deployment(
        &deployments,
        desired,
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
    let hpas = Api::<HorizontalPodAutoscaler>::namespaced(ctx.client.clone(), ns);
    match &desired.hpa {
        Some(hpa) => {
            ensure(
                &hpas,
                "HorizontalPodAutoscaler",
                hpa,
                observed.hpa.as_ref(),
                model,
                ctx,
                &mut writes,
            )
            .await?;
        }
        None => {
            remove(
                &hpas,
                "HorizontalPodAutoscaler",
                observed.hpa.as_ref(),
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
