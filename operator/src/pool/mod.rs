//! ModelPool reconcile: the pipeline driver for pools (and, in `member`, the status of pool
//! members). It
//! calls each step once, in this order — template (validate) → read → admit → render → build →
//! apply → deliver → status — with the Model pipeline's own build, apply and deliver steps, on
//! a template that is the pool's pod shape owned by the pool.
//!
//! The pool's node config lists every admitted member (`load: lazy`, sorted); its hash is
//! in the ConfigMap only, so a member joining or leaving patches the ConfigMap alone and the
//! pods reload it in place (docs/node.md, "Config reload"). What a running pod cannot reload
//! (plugins, resources, the rest of the config) is on the pod template and rolls the pods.
//! Owned objects carry an ownerReference to the pool, so deleting the pool deletes them.
//! A member's own reconcile (`model::reconcile_model`) calls [`member_status`] instead of building
//! pods.
//!
//! This file holds the controller's entry and the pool pipeline; `plan` runs its read, admit,
//! render and build steps (shared with a member's reconcile), `member` folds a member's status,
//! `admit` and `status` are the pool's own steps, `controller` its name and resync.

pub mod admit;
pub mod controller;
pub mod member;
pub mod plan;
pub mod status;

use std::sync::Arc;

use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;

use crate::context::Context;
use crate::model::apply::{self, Applied};
use crate::model::deliver;
use crate::model::error::Error;
use crate::model::validate;
use crate::write::{RETRY_REFUSED, Retry};
use gantry_crd::ModelPool;

pub use controller::{CONTROLLER, RESYNC};
pub use member::member_status;
pub use plan::{Plan, plan};

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
) -> futures::future::BoxFuture<'static, Result<Action, Error>> {
    Box::pin(reconcile_guarded(obj, ctx))
}

async fn reconcile_guarded(
    obj: Arc<DeserializeGuard<ModelPool>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
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

/// The pipeline for one pool.
pub async fn reconcile_pool(pool: &ModelPool, ctx: &Context) -> Result<Action, Error> {
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
    // As for a Model: a refused copy container is said in status before the error goes to the
    // error policy; a transient failure is retried without touching status.
    let (deliveries, deliver_error) = match plan.desired.as_ref() {
        Some(desired) if apply_error.is_none() => {
            let mounted = plan.admission.mounted();
            match deliver::deliver_plugins(&plan.template, desired, &mounted, &plan.observed, ctx)
                .await
            {
                Ok(progress) => (progress, None),
                Err(e) if e.retry() == Retry::Permanent => (Vec::new(), Some(e)),
                Err(e) => return Err(e.into()),
            }
        }
        _ => (Vec::new(), None),
    };
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
        deliveries: &deliveries,
        deliver_error: deliver_error.as_ref(),
        now: ctx.now(),
    });
    status::publish(pool, folded, ctx).await?;
    if let Some(e) = apply_error {
        return Err(e.into());
    }
    if let Some(e) = deliver_error {
        return Err(e.into());
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
    error: &Error,
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
