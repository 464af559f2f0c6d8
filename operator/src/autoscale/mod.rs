//! The built-in autoscaler (beside the reconcile path, on the leader only): every interval it
//! reads each Builtin-mode Model's ready node pods' reports (`GET /v1/status`: waiting,
//! running, KV use; from the node report cache the reconcilers share, at most one interval
//! old), decides a replica count ([`decide`], pure) and writes only two things, both under the
//! field manager `gantry-autoscaler`: the node Deployment's `spec.replicas` and the Model's
//! `status.autoscaling`.
//!
//! Guarantees: the user's spec is never written; HPA-mode Models are left to their
//! HorizontalPodAutoscaler (only `status.autoscaling` says so, once); the status is written
//! only when the decision's reason or count changes, so a steady load writes nothing; a node
//! pod that does not answer holds the count (never a scale-down on missing data). Assumption:
//! the reconciler's apply leaves `spec.replicas` out after creation (`model::apply`), so the
//! two never fight over it. docs/autoscaling.md describes the algorithm.
//!
//! This file holds the entry ([`run`], on the leader); `autoscaler` is the per-interval loop
//! and its writes, `target` what it looks at (Models and pools, their Deployment and ready
//! pods), `fetch` what it asks the pods, `config` its flags.

mod autoscaler;
mod config;
pub mod decide;
mod fetch;
mod target;

use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use kube::runtime::reflector::store::WriterDropped;

use crate::context::Settings;
use crate::metrics::Metrics;
use crate::node_report::HttpNodeStatus;
use crate::report_cache::Reports;
use crate::watch_cache::{Caches, until_listed};
use gantry_crd::{Model, ModelPool};

pub use autoscaler::{Autoscaler, CONTROLLER, Outcome, ScaleError};
pub use config::{AutoscalerArgs, AutoscalerConfig};
pub use target::scale_up_requested_at;

/// Why the autoscaler stopped (it otherwise runs until aborted).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot build the autoscaler's node status client")]
    NodeStatusClient(#[source] reqwest::Error),
    #[error("{watch} watch ended")]
    WatchEnded {
        watch: &'static str,
        #[source]
        source: WriterDropped,
    },
}

/// What the autoscaler reads, all shared with the controllers: the Model and ModelPool stores,
/// the owned-object and node pod caches, and the node report cache.
pub struct Sources {
    pub models: Store<DeserializeGuard<Model>>,
    pub pools: Store<DeserializeGuard<ModelPool>>,
    pub caches: Caches,
    pub reports: Arc<Reports>,
}

/// Runs [`Autoscaler::tick`] every interval over the controller's caches (Models, the
/// operator's Deployments and node pods: the autoscaler keeps no copies of its own) until the
/// task is aborted (the controller does so when it stops leading).
pub async fn run(
    client: Client,
    config: AutoscalerConfig,
    settings: Settings,
    metrics: Arc<Metrics>,
    sources: Sources,
) -> Result<(), RunError> {
    let Sources {
        models,
        pools,
        caches,
        reports,
    } = sources;
    let node_status = HttpNodeStatus::with_timeout(settings.node_port, config.metrics_timeout)
        .map_err(RunError::NodeStatusClient)?
        .with_install_token(settings.node_token.clone());
    let ended =
        |watch: &'static str| move |source: WriterDropped| RunError::WatchEnded { watch, source };
    // The Model controller waits on this store too: see `until_listed`.
    until_listed(&models).await.map_err(ended("Model"))?;
    caches
        .wait_until_ready()
        .await
        .map_err(ended("owned objects"))?;
    tracing::info!(interval_s = config.interval.as_secs(), "autoscaler running");
    let mut autoscaler = Autoscaler::new(client, Arc::new(node_status), metrics, settings)
        .with_reports(reports, config.interval);
    let mut ticks = tokio::time::interval(config.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        // The stores' own objects, borrowed for the interval: no copy of a Model is made.
        // (One that did not deserialize is the reconciler's to report.)
        let model_state = models.state();
        let models: Vec<&Model> = model_state
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .collect();
        let deployments = caches.deployments.state();
        let pods = caches.pods.state();
        autoscaler
            .tick(&models, &deployments, &pods, Timestamp::now())
            .await;
        let pools: Vec<ModelPool> = pools
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok().cloned())
            .collect();
        autoscaler
            .tick_pools(&pools, &deployments, &pods, Timestamp::now())
            .await;
    }
}
