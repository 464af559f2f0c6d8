//! Model reconcile: the pipeline driver. It calls each step once, in this order — read →
//! validate → render → observe → resolve → build (validate to build are pure) → apply →
//! deliver → status — then decides when to look again, and the error policy decides, per error kind,
//! when to try again after a failure.
//!
//! Guarantees: the user's `spec` is never written; owned objects carry an
//! ownerReference to the Model, so deleting the Model deletes them through the
//! garbage collector (no finalizer: nothing outside the cluster needs cleanup);
//! a reconcile of an unchanged world makes no write. Assumption: the
//! EnginePlugin cache has listed everything before the first reconcile
//! (`controller::run` waits for it).

pub mod applied;
pub mod apply;
pub mod build;
pub mod controller;
pub mod deliver;
pub mod error;
pub mod node_config;
pub mod observe;
pub mod read;
pub mod resolve;
pub mod status;
pub mod validate;

use std::sync::Arc;

use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;

use crate::context::Context;
use crate::node_report::NodeReport;
use crate::write::{RETRY_REFUSED, Retry};
use gantry_crd::Model;

pub use controller::{CONTROLLER, RESYNC, resync};
pub use error::Error;

fn key(ns: Option<String>, name: &str) -> String {
    format!("Model/{}/{name}", ns.unwrap_or_default())
}

/// Entry point for the controller: unwraps the deserialization guard, times and counts.
///
/// Boxed, so the reconcile's async call tree is compiled once, in this crate, however many
/// callers (the controller, the tests) await it: release builds share no generic instances
/// between crates.
pub fn reconcile(
    obj: Arc<DeserializeGuard<Model>>,
    ctx: Arc<Context>,
) -> futures::future::BoxFuture<'static, Result<Action, Error>> {
    Box::pin(reconcile_guarded(obj, ctx))
}

async fn reconcile_guarded(
    obj: Arc<DeserializeGuard<Model>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let model = match &obj.0 {
        Ok(model) => model,
        Err(invalid) => {
            // One malformed object must not stall the others: report it and wait for an edit.
            crate::malformed::report(&ctx, CONTROLLER, "Model", invalid).await;
            return Ok(Action::await_change());
        }
    };
    let result = reconcile_model(model, &ctx).await;
    match &result {
        Ok(_) => ctx.reset_backoff(&key(model.namespace(), &model.name_any())),
        Err(e) => ctx.metrics.reconcile_failed(CONTROLLER, e.metric_label()),
    }
    result
}

/// The pipeline for one Model.
pub async fn reconcile_model(model: &Model, ctx: &Context) -> Result<Action, Error> {
    if model.metadata.deletion_timestamp.is_some() {
        // Owned objects go with the Model through ownerReferences; nothing to do.
        return Ok(Action::await_change());
    }
    let observed = read::read(model, ctx).await;

    let valid = match validate::validate(model, &ctx.settings) {
        Ok(valid) => valid,
        Err(problems) => {
            tracing::info!(model = %model.name_any(), problems = %validate::message(&problems), "invalid spec");
            let status = status::fold_invalid(model, &problems, ctx.now());
            status::publish(model, status, ctx).await?;
            // Nothing will change until the user edits the spec.
            return Ok(Action::await_change());
        }
    };

    if let Some(pool) = &valid.pool {
        // A pool member gets no pods of its own: its pool's reconcile serves it.
        return crate::pool::member::member_status(model, &valid, pool, ctx).await;
    }
    // The config names the isolation of every plugin the pods may mount, whatever the
    // architecture: selection without it, so the hash is known before the reports are read.
    let may_mount = resolve::resolve(&valid, None, &observed.plugins, ctx.settings.abi_major);
    let config = node_config::render(&valid, &may_mount.mounted())?;
    let observation = observe::observe(
        &valid,
        &config.hash,
        &observed.reports,
        model.status.as_ref(),
    );
    let architecture = observation.architecture.as_deref();
    let resolution = resolve::resolve(
        &valid,
        architecture,
        &observed.plugins,
        ctx.settings.abi_major,
    );
    let mounted = resolution.mounted();
    let desired = if mounted.is_empty() {
        None
    } else {
        let mut objects = build::assemble(&valid, &config, &mounted, &ctx.settings)?;
        // A new image of a plugin the pods take in place does not roll them.
        build::hold_plugin_images(&mut objects, observed.deployment.as_ref())?;
        Some(objects)
    };

    let (applied, apply_error) = match apply::apply(&valid, desired.as_ref(), &observed, ctx).await
    {
        Ok(applied) => (applied, None),
        // A refusal is reported in status before the error goes to the error policy;
        // a transient failure is retried without touching status (no churn).
        Err(e) if e.retry() == Retry::Permanent => (
            apply::Applied {
                deployment: observed.deployment.clone(),
                writes: Vec::new(),
            },
            Some(e),
        ),
        Err(e) => return Err(e.into()),
    };
    if !applied.writes.is_empty() {
        tracing::info!(model = %model.name_any(), writes = ?applied.writes, "applied");
    }
    let (deliveries, deliver_error) = match &desired {
        Some(d) if apply_error.is_none() => {
            match deliver::deliver_plugins(&valid, d, &mounted, &observed, ctx).await {
                Ok(progress) => (progress, None),
                Err(e) if e.retry() == Retry::Permanent => (Vec::new(), Some(e)),
                Err(e) => return Err(e.into()),
            }
        }
        _ => (Vec::new(), None),
    };

    // Pods being removed (no engine) no longer speak for the Model.
    let reports: &[&NodeReport] = if desired.is_some() {
        &observation.current
    } else {
        &[]
    };
    let facts = status::Facts {
        model,
        valid: &valid,
        architecture,
        resolution: &resolution,
        deployment: applied.deployment.as_ref(),
        reports,
        apply_error: apply_error.as_ref(),
        deliveries: &deliveries,
        deliver_error: deliver_error.as_ref(),
        now: ctx.now(),
    };
    let folded = status::fold(&facts);
    let no_pods = desired.is_none();
    status::publish(model, folded, ctx).await?;
    if let Some(e) = apply_error {
        return Err(e.into());
    }
    if let Some(e) = deliver_error {
        return Err(e.into());
    }
    Ok(if no_pods {
        // No pods: only a Model or EnginePlugin change can alter the outcome.
        Action::await_change()
    } else {
        Action::requeue(resync(&valid.uid))
    })
}

/// Per error kind: refusals wait long (a change or an admin must fix them), transient errors
/// back off exponentially per object.
pub fn error_policy(obj: Arc<DeserializeGuard<Model>>, error: &Error, ctx: Arc<Context>) -> Action {
    let (ns, name) = match &obj.0 {
        Ok(m) => (m.namespace(), m.name_any()),
        Err(invalid) => (
            invalid.metadata.namespace.clone(),
            invalid.metadata.name.clone().unwrap_or_default(),
        ),
    };
    tracing::warn!(model = %name, error = %error, kind = error.metric_label(), "reconcile failed");
    match error.retry() {
        Retry::Permanent => Action::requeue(RETRY_REFUSED),
        Retry::Transient => Action::requeue(ctx.backoff(&key(ns, &name))),
    }
}
