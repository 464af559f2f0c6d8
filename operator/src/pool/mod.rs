//! ModelPool reconcile: the pipeline driver for pools, and the status of pool members. It
//! calls each step once, in this order — template (validate) → read → admit → render → build →
//! apply → status — with the Model pipeline's own build and apply steps, on a template that
//! is the pool's pod shape owned by the pool.
//!
//! The pool's node config lists every admitted member (`load: lazy`, sorted); its hash is
//! in the ConfigMap only, so a member joining or leaving patches the ConfigMap alone and the
//! pods reload it in place (docs/node.md, "Config reload"). What a running pod cannot reload
//! (plugins, resources, the rest of the config) is on the pod template and rolls the pods.
//! Owned objects carry an ownerReference to the pool, so deleting the pool deletes them.
//! A member's own reconcile (model/mod.rs) calls [`member_status`] instead of building pods.

pub mod admit;
pub mod status;

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;

use crate::context::Context;
use crate::model::apply::{self, Applied};
use crate::model::build;
use crate::model::node_config::RenderedConfig;
use crate::model::read::{Observed, read_objects};
use crate::model::resolve::Resolution;
use crate::model::validate::{self, ValidModel};
use crate::model::{self, status as model_status};
use crate::node_report::NodeReport;
use crate::write::{RETRY_REFUSED, Retry};
use gantry_crd::conditions::{self, Decided, FALSE, model as cond, reason};
use gantry_crd::{CacheType, Model, ModelPool, ModelStatus, PoolPlacement};

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "modelpool";

/// How often a pool with members (and each member) is looked at again when nothing happens:
/// the pool's status lists what each pod has loaded, which changes with traffic.
pub const RESYNC: Duration = Duration::from_secs(30);

fn key(ns: Option<String>, name: &str) -> String {
    format!("ModelPool/{}/{name}", ns.unwrap_or_default())
}

/// Entry point for the controller: unwraps the deserialization guard, times and counts.
///
/// Boxed, so the reconcile's async call tree is compiled once, in this crate, however many
/// callers (the controller, the tests) await it: release builds share no generic instances
/// between crates.
pub fn reconcile(
    obj: Arc<DeserializeGuard<ModelPool>>,
    ctx: Arc<Context>,
) -> futures::future::BoxFuture<'static, Result<Action, model::Error>> {
    Box::pin(reconcile_guarded(obj, ctx))
}

async fn reconcile_guarded(
    obj: Arc<DeserializeGuard<ModelPool>>,
    ctx: Arc<Context>,
) -> Result<Action, model::Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let pool = match &obj.0 {
        Ok(pool) => pool,
        Err(invalid) => {
            crate::malformed::report(&ctx, CONTROLLER, "ModelPool", invalid).await;
            return Ok(Action::await_change());
        }
    };
    let result = reconcile_pool(pool, &ctx).await;
    match &result {
        Ok(_) => ctx.reset_backoff(&key(pool.namespace(), &pool.name_any())),
        Err(e) => ctx.metrics.reconcile_failed(CONTROLLER, e.metric_label()),
    }
    result
}

/// Everything one pool reconcile decided, up to the objects to apply.
pub struct Plan {
    pub template: ValidModel,
    pub observed: Observed,
    pub admission: admit::Admission,
    pub config: admit::PoolConfig,
    /// `None`: no member can be served; the pool runs no pods.
    pub desired: Option<build::OwnedObjects>,
}

/// The read, admit, render and build steps for `pool` with its pod `template`.
pub async fn plan(
    pool: &ModelPool,
    template: ValidModel,
    ctx: &Context,
) -> Result<Plan, model::Error> {
    let ns = pool.namespace().unwrap_or_default();
    let wants_claim = template.cache.type_ == CacheType::PersistentVolumeClaim;
    let observed = read_objects(&ns, &template.name, wants_claim, ctx).await;
    let plugins = admit::allowed_plugins(pool, ctx.engine_plugins());
    let members = ctx.pool_members(&ns, &pool.name_any());
    let admission = admit::admit(
        pool,
        &template,
        &members,
        &observed.reports,
        &plugins,
        &ctx.settings,
    );
    let config = admit::render(pool, &admission)?;
    let mounted = admission.mounted();
    let desired = if admission.members.is_empty() || mounted.is_empty() {
        None
    } else {
        // The pod template carries the hash of what a pod cannot reload; the ConfigMap the
        // whole config.
        let pod_config = RenderedConfig {
            yaml: config.config.yaml.clone(),
            hash: config.pod_hash.clone(),
        };
        let mut objects = build::assemble(&template, &pod_config, &mounted, &ctx.settings)?;
        // As for a Model: a new image of a plugin the pods take in place does not roll them.
        build::hold_plugin_images(&mut objects, observed.deployment.as_ref())?;
        Some(objects)
    };
    Ok(Plan {
        template,
        observed,
        admission,
        config,
        desired,
    })
}

/// The pipeline for one pool.
pub async fn reconcile_pool(pool: &ModelPool, ctx: &Context) -> Result<Action, model::Error> {
    if pool.metadata.deletion_timestamp.is_some() {
        // Owned objects go with the pool through ownerReferences.
        return Ok(Action::await_change());
    }
    let template = match admit::template(pool, &ctx.settings) {
        Ok(t) => t,
        Err(problems) => {
            let message = validate::message(&problems);
            tracing::info!(pool = %pool.name_any(), problems = %message, "invalid pool spec");
            status::publish(pool, status::fold_invalid(pool, message, ctx.now()), ctx).await?;
            return Ok(Action::await_change());
        }
    };
    let plan = plan(pool, template, ctx).await?;
    let (applied, apply_error) =
        match apply::apply(&plan.template, plan.desired.as_ref(), &plan.observed, ctx).await {
            Ok(applied) => (applied, None),
            Err(e) if e.retry() == Retry::Permanent => (
                Applied {
                    deployment: plan.observed.deployment.clone(),
                    writes: Vec::new(),
                },
                Some(e),
            ),
            Err(e) => return Err(e.into()),
        };
    if !applied.writes.is_empty() {
        tracing::info!(pool = %pool.name_any(), writes = ?applied.writes, "applied");
    }
    let reports = if plan.desired.is_some() {
        plan.observed.reports.as_slice()
    } else {
        &[]
    };
    let folded = status::fold(&status::Facts {
        pool,
        admission: &plan.admission,
        config_hash: &plan.config.config.hash,
        deployment: applied.deployment.as_ref(),
        reports,
        apply_error: apply_error.as_ref(),
        now: ctx.now(),
    });
    status::publish(pool, folded, ctx).await?;
    if let Some(e) = apply_error {
        return Err(e.into());
    }
    if let Some(desired) = plan.desired.as_ref() {
        let mounted = plan.admission.mounted();
        let progress =
            model::deliver_plugins(&plan.template, desired, &mounted, &plan.observed, ctx).await?;
        // The pool's status has no delivery condition yet: the halt is logged, and the
        // EnginePlugin's `status.updates` lists the pod that refused.
        for p in progress.iter().filter(|p| p.halted.is_some()) {
            let (pod, why) = p.halted.clone().unwrap_or_default();
            tracing::warn!(pool = %pool.name_any(), plugin = %p.plugin, version = %p.version, pod = %pod, "in-place plugin delivery halted: {why}");
        }
    }
    Ok(if plan.desired.is_some() {
        Action::requeue(RESYNC)
    } else {
        // No member: only a Model or pool change can alter that.
        Action::await_change()
    })
}

/// Per error kind, as for Models: refusals wait long, transient errors back off.
pub fn error_policy(
    obj: Arc<DeserializeGuard<ModelPool>>,
    error: &model::Error,
    ctx: Arc<Context>,
) -> Action {
    let (ns, name) = match &obj.0 {
        Ok(p) => (p.namespace(), p.name_any()),
        Err(invalid) => (
            invalid.metadata.namespace.clone(),
            invalid.metadata.name.clone().unwrap_or_default(),
        ),
    };
    tracing::warn!(pool = %name, error = %error, kind = error.metric_label(), "reconcile failed");
    match error.retry() {
        Retry::Permanent => Action::requeue(RETRY_REFUSED),
        Retry::Transient => Action::requeue(ctx.backoff(&key(ns, &name))),
    }
}

/// A status that says the member is not served, and why (its pool is missing, or refused it).
fn refused_status(
    model: &Model,
    pool: &str,
    why: &'static str,
    message: String,
    ctx: &Context,
) -> ModelStatus {
    let previous = model.status.clone().unwrap_or_default();
    let generation = model.metadata.generation;
    let decided = [
        Decided::new(cond::READY, FALSE, why, message.clone()),
        Decided::new(cond::DEGRADED, conditions::TRUE, why, message),
    ];
    ModelStatus {
        observed_generation: generation,
        conditions: conditions::with_times(&decided, &previous.conditions, generation, ctx.now()),
        pool: Some(PoolPlacement {
            name: pool.to_string(),
            ..PoolPlacement::default()
        }),
        endpoint: None,
        replicas: None,
        autoscaling: None,
        ..previous
    }
}

/// The status of a pool member `valid` (spec.pool set): it owns no pods; the pool's pods
/// that list it speak for it. A member that moved into a pool loses its own Deployment.
pub async fn member_status(
    model: &Model,
    valid: &ValidModel,
    pool_name: &str,
    ctx: &Context,
) -> Result<Action, model::Error> {
    let ns = valid.namespace.clone();
    // Pods of its own from before it joined go; its ConfigMap and Service stay until the
    // Model is deleted (they are inert without pods).
    let own = model::read::read(model, ctx).await;
    if own.deployment.is_some() {
        apply::apply(valid, None, &own, ctx).await?;
    }
    let Some(pool) = ctx.pool(&ns, pool_name) else {
        let status = refused_status(
            model,
            pool_name,
            reason::POOL_NOT_FOUND,
            format!(
                "spec.pool names the ModelPool `{pool_name}`, which does not exist in namespace `{ns}`"
            ),
            ctx,
        );
        model_status::publish(model, status, ctx).await?;
        return Ok(Action::await_change());
    };
    let template = match admit::template(&pool, &ctx.settings) {
        Ok(t) => t,
        Err(problems) => {
            let status = refused_status(
                model,
                pool_name,
                reason::INVALID_SPEC,
                format!(
                    "the ModelPool `{pool_name}` is invalid: {}",
                    validate::message(&problems)
                ),
                ctx,
            );
            model_status::publish(model, status, ctx).await?;
            return Ok(Action::await_change());
        }
    };
    let plan = plan(&pool, template, ctx).await?;
    let name = model.name_any();
    let Some(member) = plan.admission.member(&name) else {
        let (why, message) = match plan.admission.refusal(&name) {
            Some(r) => (
                conditions_reason(&r.reason),
                format!("the ModelPool `{pool_name}` refuses it: {}", r.message),
            ),
            None => (
                reason::POOL_NOT_FOUND,
                format!("the ModelPool `{pool_name}` does not list it yet"),
            ),
        };
        let status = refused_status(model, pool_name, why, message, ctx);
        model_status::publish(model, status, ctx).await?;
        return Ok(Action::requeue(RESYNC));
    };
    // The pool's pods running a config that lists the member speak for it.
    let listing: Vec<&NodeReport> = plan
        .observed
        .reports
        .iter()
        .filter(|r| r.model(&valid.served_name).is_some())
        .collect();
    let resolution: &Resolution = &member.resolution;
    let facts = model_status::Facts {
        model,
        valid: &member.valid,
        architecture: member.architecture.as_deref(),
        resolution,
        deployment: plan.observed.deployment.as_ref(),
        reports: &listing,
        apply_error: None,
        deliveries: &[],
        deliver_error: None,
        now: ctx.now(),
    };
    let mut folded = model_status::fold(&facts);
    folded.endpoint = plan
        .observed
        .deployment
        .is_some()
        .then(|| status::endpoint(&pool));
    folded.pool = Some(PoolPlacement {
        name: pool_name.to_string(),
        listed_by: listing.iter().map(|r| pod_name(&r.pod)).collect(),
        loaded_on: listing
            .iter()
            .filter(|r| {
                r.model(&valid.served_name)
                    .is_some_and(|m| m.load.state == gantry_api::LoadState::Loaded)
            })
            .map(|r| pod_name(&r.pod))
            .collect(),
    });
    model_status::publish(model, folded, ctx).await?;
    Ok(Action::requeue(RESYNC))
}

/// The pod's name of a report's `namespace/name`.
pub(crate) fn pod_name(pod: &str) -> String {
    pod.rsplit_once('/').map_or(pod, |(_, n)| n).to_string()
}

/// The reason constant for a refusal reason string (always one of ours).
fn conditions_reason(r: &str) -> &'static str {
    [
        reason::INVALID_SPEC,
        reason::ENGINE_UNRESOLVED,
        reason::DOES_NOT_FIT,
        reason::SERVED_NAME_TAKEN,
    ]
    .into_iter()
    .find(|k| *k == r)
    .unwrap_or(reason::INVALID_SPEC)
}
