//! EnginePlugin reconcile: validate (Accepted) → read the node pods that mount the plugin and
//! their status reports (from the caches: no API request) → fold Loaded, loadedBy and
//! loadErrors → write status only when it changed. EnginePlugins own nothing, so there is no
//! build or apply step and no finalizer. The report poller wakes a plugin whose pods' answers
//! changed; the resync is a safety net.

pub mod controller;
pub mod status;

use std::sync::Arc;

use crate::node_pod::NodePod;
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;

use crate::context::Context;
use crate::model::controller::resync;
use crate::write::{RETRY_REFUSED, Retry};
use gantry_crd::EnginePlugin;
use gantry_crd::names::ANNOTATION_PLUGINS;

pub use controller::CONTROLLER;

/// A failed EnginePlugin reconcile, by step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Status(#[from] status::StatusError),
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Status(e) => e.metric_label(),
        }
    }

    pub fn retry(&self) -> Retry {
        match self {
            Error::Status(e) => e.retry(),
        }
    }
}

/// Entry point for the controller.
///
/// Boxed, so the reconcile's async call tree is compiled once, in this crate, however many
/// callers (the controller, the tests) await it: release builds share no generic instances
/// between crates.
pub fn reconcile(
    obj: Arc<DeserializeGuard<EnginePlugin>>,
    ctx: Arc<Context>,
) -> futures::future::BoxFuture<'static, Result<Action, Error>> {
    Box::pin(reconcile_guarded(obj, ctx))
}

async fn reconcile_guarded(
    obj: Arc<DeserializeGuard<EnginePlugin>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let plugin = match &obj.0 {
        Ok(p) => p,
        Err(invalid) => {
            crate::malformed::report(&ctx, CONTROLLER, "EnginePlugin", invalid).await;
            return Ok(Action::await_change());
        }
    };
    let result = reconcile_plugin(plugin, &ctx).await;
    match &result {
        Ok(_) => ctx.reset_backoff(&format!("EnginePlugin/{}", plugin.name_any())),
        Err(e) => ctx.metrics.reconcile_failed(CONTROLLER, e.metric_label()),
    }
    result
}

/// The pipeline for one EnginePlugin.
pub async fn reconcile_plugin(plugin: &EnginePlugin, ctx: &Context) -> Result<Action, Error> {
    let all = ctx.engine_plugins();
    let accepted = crate::acceptance::accept(plugin, &all, ctx.settings.abi_major);

    // Read: the node pods (any namespace) whose template mounts this plugin.
    let name = plugin.name_any();
    let mut mounting: Vec<Arc<NodePod>> = ctx
        .caches
        .pods
        .state()
        .into_iter()
        .filter(|p| {
            p.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_PLUGINS))
                .is_some_and(|list| list.split(',').any(|n| n == name))
        })
        .collect();
    mounting.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    let reports = ctx.reports.of(&mounting).await;

    let folded = status::fold(
        plugin,
        &accepted,
        &reports,
        ctx.settings.abi_major,
        ctx.now(),
    );
    status::publish(plugin, folded, ctx).await?;
    // Report changes wake a plugin through the poller; the requeue is the same safety net as
    // a Model's.
    Ok(Action::requeue(resync(&plugin.uid().unwrap_or_default())))
}

/// Transient errors back off per object; refusals wait long.
pub fn error_policy(
    obj: Arc<DeserializeGuard<EnginePlugin>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    let name = match &obj.0 {
        Ok(p) => p.name_any(),
        Err(invalid) => invalid.metadata.name.clone().unwrap_or_default(),
    };
    tracing::warn!(plugin = %name, error = %error, kind = error.metric_label(), "reconcile failed");
    match error.retry() {
        Retry::Permanent => Action::requeue(RETRY_REFUSED),
        Retry::Transient => Action::requeue(ctx.backoff(&format!("EnginePlugin/{name}"))),
    }
}
