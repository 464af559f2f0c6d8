//! Controller runtime (`gantry-operator run`; wraps every reconcile): leader election, the
//! EnginePlugin cache, the Model and EnginePlugin controllers, the built-in autoscaler (leader
//! only) and the metrics server.
//!
//! Start-up order matters: (1) win the Lease, (2) list every EnginePlugin
//! into the cache, (3) start the controllers. Reconciling a Model before step
//! (2) completes could see "no plugins" and remove its pods.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::store::WriterDropped;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};

use crate::autoscale::{self, AutoscalerConfig};
use crate::context::{Context, Settings};
use crate::leader::{LeaderElector, LeaseConfig, LeaseError};
use crate::metrics::{self, Metrics};
use crate::node_report::HttpNodeStatus;
use crate::{model, plugin};
use gantry_crd::names::{FIELD_MANAGER, LABEL_MANAGED_BY};
use gantry_crd::{EnginePlugin, Model};

/// How the controller runs.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub settings: Settings,
    pub metrics_addr: SocketAddr,
    /// `None`: no leader election (a single replica, or local development).
    pub lease: Option<LeaseConfig>,
    /// Reconciles in flight at once, per controller.
    pub concurrency: u16,
    /// The built-in autoscaler, run on the leader; `None` switches it off.
    pub autoscaler: Option<AutoscalerConfig>,
}

/// Why the controller could not start, or stopped leading.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG)")]
    Client(#[source] kube::Error),
    #[error("cannot register metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("the EnginePlugin watch ended before listing")]
    PluginWatch(#[source] WriterDropped),
    #[error("cannot build the node status HTTP client")]
    NodeStatusClient(#[source] reqwest::Error),
    /// The Lease was lost: the process should exit and restart as a follower.
    #[error(transparent)]
    Lease(#[from] LeaseError),
}

/// Names and generations of the cached EnginePlugins: changes only when a plugin is added,
/// removed or its spec edited (status writes do not bump the generation).
fn plugin_fingerprint(store: &Store<DeserializeGuard<EnginePlugin>>) -> BTreeMap<String, i64> {
    store
        .state()
        .iter()
        .map(|p| (p.name_any(), p.meta().generation.unwrap_or_default()))
        .collect()
}

/// Run until SIGTERM/SIGINT, or until the Lease is lost (an error: the process should exit
/// and restart as a follower).
pub async fn run(config: RunConfig) -> Result<(), RunError> {
    let client = Client::try_default().await.map_err(RunError::Client)?;
    run_with_client(client, config).await
}

/// [`run`] with a given client (the end-to-end test points it at its own cluster).
pub async fn run_with_client(client: Client, config: RunConfig) -> Result<(), RunError> {
    let metrics = Arc::new(Metrics::new().map_err(RunError::Metrics)?);
    let metrics_server = tokio::spawn(metrics::serve(config.metrics_addr, metrics.clone()));

    let mut elector = config
        .lease
        .clone()
        .map(|lease| LeaderElector::new(client.clone(), lease));
    if let Some(elector) = &mut elector {
        tracing::info!(lease = %elector.config().name, identity = %elector.config().identity, "waiting for leadership");
        elector.acquire().await;
        tracing::info!("leader: starting controllers");
    }
    metrics.leader.set(1);

    // The EnginePlugin cache, and a trigger that re-reconciles every Model when the set of
    // plugins or any plugin's spec changes.
    let plugins_api = Api::<DeserializeGuard<EnginePlugin>>::all(client.clone());
    let (plugin_store, writer) = reflector::store();
    let (trigger_tx, trigger_rx) = futures::channel::mpsc::channel::<()>(1);
    let watch_store = plugin_store.clone();
    let plugin_watch = tokio::spawn(async move {
        let mut trigger_tx = trigger_tx;
        let mut last = BTreeMap::new();
        let mut stream = std::pin::pin!(
            reflector::reflector(writer, watcher(plugins_api, watcher::Config::default()))
                .default_backoff()
        );
        while let Some(event) = stream.next().await {
            if let Err(e) = event {
                tracing::warn!(error = %e, "EnginePlugin watch");
                continue;
            }
            let now = plugin_fingerprint(&watch_store);
            if now != last {
                last = now;
                // A full channel already holds a pending "reconcile all".
                let _ = trigger_tx.try_send(());
            }
        }
    });
    plugin_store
        .wait_until_ready()
        .await
        .map_err(RunError::PluginWatch)?;

    // Only the leader scales: two autoscalers would each keep their own history.
    let autoscaler = config.autoscaler.map(|a| {
        let (client, settings, metrics) =
            (client.clone(), config.settings.clone(), metrics.clone());
        tokio::spawn(async move {
            if let Err(e) = autoscale::run(client, a, settings, metrics).await {
                tracing::error!(error = %e, "autoscaler stopped");
            }
        })
    });

    let node_status = HttpNodeStatus::new(config.settings.node_port)
        .map_err(RunError::NodeStatusClient)?
        .with_install_token(config.settings.node_token.clone());
    let ctx = Arc::new(Context::new(
        client.clone(),
        config.settings.clone(),
        plugin_store,
        Arc::new(node_status),
        metrics.clone(),
    ));

    // Owned objects are watched only if they carry our manager label.
    let owned = watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}"));
    let controller_config = controller::Config::default().concurrency(config.concurrency);
    let models = Controller::new(
        Api::<DeserializeGuard<Model>>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(Api::<Deployment>::all(client.clone()), owned.clone())
    .owns(Api::<ConfigMap>::all(client.clone()), owned.clone())
    .owns(Api::<Service>::all(client.clone()), owned.clone())
    .owns(
        Api::<PodDisruptionBudget>::all(client.clone()),
        owned.clone(),
    )
    .owns(
        Api::<HorizontalPodAutoscaler>::all(client.clone()),
        owned.clone(),
    )
    .owns(Api::<PersistentVolumeClaim>::all(client.clone()), owned)
    .reconcile_all_on(trigger_rx)
    .with_config(controller_config.clone())
    .shutdown_on_signal()
    .run(model::reconcile, model::error_policy, ctx.clone())
    .for_each(|result| async move {
        if let Err(e) = result {
            tracing::debug!(error = %e, "model controller");
        }
    });
    let plugins = Controller::new(
        Api::<DeserializeGuard<EnginePlugin>>::all(client.clone()),
        watcher::Config::default(),
    )
    .with_config(controller_config)
    .shutdown_on_signal()
    .run(plugin::reconcile, plugin::error_policy, ctx)
    .for_each(|result| async move {
        if let Err(e) = result {
            tracing::debug!(error = %e, "engineplugin controller");
        }
    });
    let controllers = futures::future::join(models, plugins);

    let outcome = match &mut elector {
        Some(elector) => {
            tokio::select! {
                _ = controllers => Ok(()),
                lost = elector.hold(&metrics) => Err(RunError::Lease(lost)),
            }
        }
        None => {
            controllers.await;
            Ok(())
        }
    };
    if outcome.is_ok()
        && let Some(elector) = &mut elector
    {
        elector.release().await;
    }
    plugin_watch.abort();
    if let Some(autoscaler) = autoscaler {
        autoscaler.abort();
    }
    metrics_server.abort();
    outcome
}
