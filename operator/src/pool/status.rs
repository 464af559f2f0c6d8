//! ModelPool reconcile, status step (after deliver): folds the admission, the Deployment, the
//! in-place plugin deliveries to the pool's pods and the pods' reports into `ModelPool.status`
//! (pure), then writes it only when it changed.
//!
//! `Progressing` and `Degraded` come from the Model's own rollout fold
//! (`model::status::rollout`), so a pool says `PluginUpdating` and `PluginUpdateHalted` as a
//! Model does. As for Models, nothing here changes on its own (no timestamps besides
//! `lastTransitionTime`, no rates), so a still pool folds to the stored status and is not written.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;

use super::admit::Admission;
use super::controller::CONTROLLER;
use crate::context::Context;
use crate::model::apply::ApplyError;
use crate::model::deliver::{DeliverError, DeliveryProgress};
use crate::model::status::StatusError;
use crate::model::status::fold::kept;
use crate::model::status::fold_rollout;
use crate::node_report::NodeReport;
use crate::write;
use gantry_crd::conditions::{self, Decided, FALSE, TRUE, pool as cond, reason};
use gantry_crd::names::{NODE_PORT, pool_object_name};
use gantry_crd::{ModelPool, ModelPoolStatus, PoolMember, PoolPod};

/// Everything the fold looks at.
#[derive(Clone, Copy, Debug)]
pub struct Facts<'a> {
    pub pool: &'a ModelPool,
    pub admission: &'a Admission,
    /// The hash of the node config the pool's pods should run.
    pub config_hash: &'a str,
    /// The Deployment after the apply step (`None`: no members, no pods).
    pub deployment: Option<&'a Deployment>,
    /// Reports of the pool's pods, sorted by pod name.
    pub reports: &'a [NodeReport],
    pub apply_error: Option<&'a ApplyError>,
    /// The in-place plugin deliveries to the pool's pods (deliver step), one per plugin.
    pub deliveries: &'a [DeliveryProgress],
    /// The apiserver refused a delivery's copy container.
    pub deliver_error: Option<&'a DeliverError>,
    pub now: Timestamp,
}

/// The in-cluster base URL of a pool's pods.
pub fn endpoint(pool: &ModelPool) -> String {
    format!(
        "http://{}.{}.svc:{NODE_PORT}/v1",
        pool_object_name(&pool.name_any()),
        pool.namespace().unwrap_or_default()
    )
}

/// The pod's name of a report's `namespace/name`.
pub(crate) fn pod_name(pod: &str) -> String {
    pod.rsplit_once('/').map_or(pod, |(_, n)| n).to_string()
}

/// One pool pod as its report says.
pub fn pod(report: &NodeReport, config_hash: &str) -> PoolPod {
    let name = pod_name(&report.pod);
    let Ok(s) = &report.status else {
        return PoolPod {
            name,
            ..PoolPod::default()
        };
    };
    let memory = s.memory.clone().unwrap_or_default();
    PoolPod {
        name,
        ready: s.ready,
        config_current: s.config_hash.as_deref() == Some(config_hash),
        loaded: s
            .models
            .iter()
            .filter(|m| m.load.state == gantry_api::LoadState::Loaded)
            .map(|m| m.id.clone())
            .collect(),
        memory_used_bytes: i64::try_from(memory.used_bytes).unwrap_or(i64::MAX),
        memory_limit_bytes: i64::try_from(memory.limit_bytes).unwrap_or(i64::MAX),
        evictions: i64::try_from(memory.evictions_total).unwrap_or(i64::MAX),
        refusals: i64::try_from(memory.refusals_total).unwrap_or(i64::MAX),
    }
}

/// Fold the pool's facts into its status.
///
/// `Degraded` takes a refused apply first, then a stuck rollout, then a halted delivery;
/// a member the pool refuses is not the pool's fault (`status.refused` and the member say it).
pub fn fold(f: &Facts<'_>) -> ModelPoolStatus {
    let previous = f.pool.status.clone().unwrap_or_default();
    let generation = f.pool.metadata.generation;
    let replicas = crate::model::status::replica_counts(f.deployment);
    let ready = if let Some(e) = f.apply_error {
        Decided::new(cond::READY, FALSE, reason::APPLY_FAILED, e.to_string())
    } else if f.admission.members.is_empty() {
        Decided::new(
            cond::READY,
            FALSE,
            reason::NO_MEMBERS,
            "no Model the pool can serve names it in spec.pool; the pool runs no node pods",
        )
    } else if f.deployment.is_some() && replicas.desired == 0 {
        crate::model::status::scaled_to_zero()
    } else if replicas.ready > 0 {
        // A pool serves once one pod does; the others add capacity.
        Decided::new(
            cond::READY,
            TRUE,
            reason::READY,
            format!("{}/{} node pods ready", replicas.ready, replicas.desired),
        )
    } else {
        Decided::new(
            cond::READY,
            FALSE,
            reason::REPLICAS_NOT_READY,
            format!("{}/{} node pods ready", replicas.ready, replicas.desired),
        )
    };
    let rollout = fold_rollout(f.deployment, f.deliveries, f.deliver_error, "pool");
    let degraded = if let Some(e) = f.apply_error {
        Decided::new(cond::DEGRADED, TRUE, reason::APPLY_FAILED, e.to_string())
    } else if let Some(d) = rollout.degraded {
        d
    } else {
        Decided::new(cond::DEGRADED, FALSE, reason::AS_EXPECTED, "")
    };
    let decided = [ready, rollout.progressing, degraded];
    let models: Vec<PoolMember> = f
        .admission
        .members
        .iter()
        .map(|m| PoolMember {
            name: m.name.clone(),
            served_name: m.valid.served_name.clone(),
            plugins: m
                .resolution
                .mounted()
                .iter()
                .map(|p| p.name_any())
                .collect(),
        })
        .collect();
    ModelPoolStatus {
        observed_generation: generation,
        conditions: conditions::with_times(&decided, &previous.conditions, generation, f.now),
        model_count: i32::try_from(models.len()).unwrap_or(i32::MAX),
        models,
        refused_count: i32::try_from(f.admission.refused.len()).unwrap_or(i32::MAX),
        refused: f.admission.refused.clone(),
        pods: f.reports.iter().map(|r| pod(r, f.config_hash)).collect(),
        replicas: Some(replicas),
        // The autoscaler's field: never part of what this manager applies.
        autoscaling: None,
        endpoint: f.deployment.is_some().then(|| endpoint(f.pool)),
    }
}

/// Status for a pool whose spec failed validation; the last good objects keep running, and
/// `Progressing` stays as it was.
pub fn fold_invalid(pool: &ModelPool, message: String, now: Timestamp) -> ModelPoolStatus {
    let previous = pool.status.clone().unwrap_or_default();
    let message = format!("the spec cannot be served as written: {message}");
    let decided = [
        Decided::new(cond::READY, FALSE, reason::INVALID_SPEC, message.clone()),
        kept(&previous.conditions, cond::PROGRESSING),
        Decided::new(cond::DEGRADED, TRUE, reason::INVALID_SPEC, message),
    ];
    ModelPoolStatus {
        observed_generation: pool.metadata.generation,
        conditions: conditions::with_times(
            &decided,
            &previous.conditions,
            pool.metadata.generation,
            now,
        ),
        autoscaling: None,
        ..previous
    }
}

/// The recent-write kind of a pool's status.
const STATUS_KIND: &str = "ModelPool/status";

/// Write `status` if it differs from the stored one and from the one written a moment ago.
pub async fn publish(
    pool: &ModelPool,
    status: ModelPoolStatus,
    ctx: &Context,
) -> Result<bool, StatusError> {
    let document = serde_json::to_value(&status).ok();
    // `autoscaling` belongs to the autoscaler's field manager and is not compared.
    let ours = ModelPoolStatus {
        autoscaling: None,
        ..pool.status.clone().unwrap_or_default()
    };
    if serde_json::to_value(&ours).ok() == document {
        return Ok(false);
    }
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let digest = crate::model::status::status_digest(document.as_ref());
    if ctx.caches.recent.holds(STATUS_KIND, &ns, &name, &digest) {
        return Ok(false);
    }
    let api = Api::<ModelPool>::namespaced(ctx.client.clone(), &ns);
    write::apply_status(&api, &name, &status, &ctx.metrics, CONTROLLER)
        .await
        .map_err(|source| StatusError::Patch {
            model: format!("ModelPool {ns}/{name}"),
            source,
        })?;
    ctx.caches.recent.wrote(STATUS_KIND, &ns, &name, &digest);
    Ok(true)
}
