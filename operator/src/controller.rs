//! Controller runtime (`gantry-operator run`; wraps every reconcile): leader election, the
//! EnginePlugin cache, the owned-object and node pod caches with their watches, the node
//! report poller, the Model and EnginePlugin controllers, the built-in autoscaler (leader
//! only) and the metrics server.
//!
//! Start-up order matters: (1) win the Lease, (2) list every EnginePlugin, owned object and
//! node pod into the caches, (3) start the controllers. Reconciling a Model before step (2)
//! completes could see "no plugins" and remove its pods, or "no Deployment" and reset its
//! replica count. docs/operator.md ("How the operator scales") says what each watch costs.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;

use crate::node_pod::NodePod;
use futures::StreamExt;
use futures::channel::mpsc;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::store::WriterDropped;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::autoscale::{self, AutoscalerConfig};
use crate::context::{Context, Settings};
use crate::leader::{LeaderElector, LeaseConfig, LeaseError};
use crate::metrics::{self, Metrics};
use crate::node_report::HttpNodeStatus;
use crate::report_cache::{self, PluginRef, PollConfig, Reports};
use crate::watch_cache::{self, Caches, Kind, ModelRef, Writers};
use crate::{model, plugin, pool};
use gantry_crd::names::{FIELD_MANAGER, LABEL_MANAGED_BY, LABEL_NAME, NODE_APP_NAME};
use gantry_crd::{EnginePlugin, Model, ModelPool};

/// How the controller runs.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub settings: Settings,
    pub metrics_addr: SocketAddr,
    /// `None`: no leader election (a single replica, or local development).
    pub lease: Option<LeaseConfig>,
    /// Reconciles in flight at once, per controller.
    pub concurrency: u16,
    /// How often node pods are asked for their status.
    pub reports: PollConfig,
    /// Requests per second the API client may start (all controllers, watches and the
    /// autoscaler together); 0: no limit. Applies to the client [`run`] builds.
    pub api_qps: u32,
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
    #[error("a watch of owned objects or node pods ended before listing")]
    CacheWatch(#[source] WriterDropped),
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
    let kube_config = kube::Config::infer()
        .await
        .map_err(|e| RunError::Client(kube::Error::InferConfig(e)))?;
    let builder = kube::client::ClientBuilder::try_from(kube_config).map_err(RunError::Client)?;
    let client = match config.api_qps {
        0 => builder.build(),
        qps => builder
            .with_layer(&tower::limit::RateLimitLayer::new(
                u64::from(qps),
                std::time::Duration::from_secs(1),
            ))
            .build(),
    };
    run_with_client(client, config).await
}

/// [`run`] with a given client (the end-to-end test points it at its own cluster).
///
/// Boxed so that the controller's whole async call tree is compiled once, here: release builds
/// do not share generic instances between crates, and a caller awaiting the bare future would
/// compile it again (the end-to-end test took over three minutes of CPU to build).
pub fn run_with_client(
    client: Client,
    config: RunConfig,
) -> futures::future::BoxFuture<'static, Result<(), RunError>> {
    Box::pin(run_controllers(client, config))
}

async fn run_controllers(client: Client, config: RunConfig) -> Result<(), RunError> {
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
    let (pool_trigger_tx, pool_trigger_rx) = futures::channel::mpsc::channel::<()>(1);
    let watch_store = plugin_store.clone();
    let plugin_watch = tokio::spawn(async move {
        let (mut trigger_tx, mut pool_trigger_tx) = (trigger_tx, pool_trigger_tx);
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
                let _ = pool_trigger_tx.try_send(());
            }
        }
    });
    plugin_store
        .wait_until_ready()
        .await
        .map_err(RunError::PluginWatch)?;

    // The owned-object and node pod caches, and the reconciles their changes ask for.
    let (caches, writers) = watch_cache::caches();
    let (model_tx, model_rx) = mpsc::channel::<ModelRef>(1024);
    let (plugin_tx, plugin_rx) = mpsc::channel::<PluginRef>(64);
    let watches = start_watches(&client, writers, &caches, &model_tx);
    caches
        .wait_until_ready()
        .await
        .map_err(RunError::CacheWatch)?;
    tracing::info!(objects = caches.len(), "caches listed");

    // The Model store: trimmed, shared by the controller, the autoscaler and the poller.
    let (model_store, model_writer) = reflector::store();
    let model_stream = watcher(
        Api::<DeserializeGuard<Model>>::all(client.clone()),
        list_config(),
    )
    .default_backoff()
    .modify(watch_cache::trim_model)
    .reflect(model_writer)
    .applied_objects()
    // A status write (ours or the autoscaler's) changes nothing a reconcile decides on.
    .predicate_filter(spec_or_deletion, Default::default());

    // The ModelPool store: a pool reconcile reads its members from the Model store, a member's
    // reconcile its pool from this one.
    let (pool_store, pool_writer) = reflector::store();
    let pool_stream = watcher(
        Api::<DeserializeGuard<ModelPool>>::all(client.clone()),
        list_config(),
    )
    .default_backoff()
    .reflect(pool_writer)
    .applied_objects()
    .predicate_filter(spec_or_deletion, Default::default());

    let node_status = HttpNodeStatus::new(config.settings.node_port)
        .map_err(RunError::NodeStatusClient)?
        .with_install_token(config.settings.node_token.clone());
    let reports = Arc::new(Reports::new(Arc::new(node_status)));
    let poller = tokio::spawn(report_cache::poll(
        reports.clone(),
        caches.pods.clone(),
        model_store.clone(),
        config.reports,
        model_tx,
        plugin_tx,
    ));

    // Only the leader scales: two autoscalers would each keep their own history.
    let autoscaler = config.autoscaler.map(|a| {
        let (client, settings, metrics) =
            (client.clone(), config.settings.clone(), metrics.clone());
        let sources = autoscale::Sources {
            models: model_store.clone(),
            pools: pool_store.clone(),
            caches: caches.clone(),
            reports: reports.clone(),
        };
        tokio::spawn(async move {
            if let Err(e) = autoscale::run(client, a, settings, metrics, sources).await {
                tracing::error!(error = %e, "autoscaler stopped");
            }
        })
    });

    let measure = tokio::spawn(measure_caches(
        metrics.clone(),
        caches.clone(),
        model_store.clone(),
        pool_store.clone(),
        plugin_store.clone(),
        reports.clone(),
    ));

    let ctx = Arc::new(
        Context::new(
            client.clone(),
            config.settings.clone(),
            plugin_store,
            caches,
            reports,
            metrics.clone(),
        )
        .with_stores(model_store.clone(), pool_store.clone()),
    );

    let controller_config = controller::Config::default().concurrency(config.concurrency);
    let ctx_pools = ctx.clone();
    let models = Controller::for_stream(model_stream, model_store)
        .reconcile_on(model_rx)
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
    .reconcile_on(plugin_rx)
    .with_config(controller_config)
    .shutdown_on_signal()
    .run(plugin::reconcile, plugin::error_policy, ctx.clone())
    .for_each(|result| async move {
        if let Err(e) = result {
            tracing::debug!(error = %e, "engineplugin controller");
        }
    });
    // A Model joining, leaving or changing inside a pool re-renders the pool's config. This is
    // a second watch of Models (metadata and spec, no trimming needed for the mapper): the
    // first one feeds the Model controller's stream and cannot be shared across controllers.
    let pools = Controller::for_stream(pool_stream, pool_store)
        .watches(
            Api::<DeserializeGuard<Model>>::all(client.clone()),
            list_config(),
            |m: DeserializeGuard<Model>| {
                let model = m.0.as_ref().ok()?;
                let pool = model.spec.pool.as_deref()?;
                Some(ObjectRef::new(pool).within(model.metadata.namespace.as_deref()?))
            },
        )
        .reconcile_all_on(pool_trigger_rx)
        .with_config(controller::Config::default().concurrency(config.concurrency))
        .shutdown_on_signal()
        .run(pool::reconcile, pool::error_policy, ctx_pools)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "modelpool controller");
            }
        });
    let controllers = futures::future::join3(models, plugins, pools);

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
    poller.abort();
    measure.abort();
    for watch in watches {
        watch.abort();
    }
    if let Some(autoscaler) = autoscaler {
        autoscaler.abort();
    }
    metrics_server.abort();
    outcome
}

/// How often the `gantry_operator_cache_*` gauges are measured.
const MEASURE_CACHES: std::time::Duration = std::time::Duration::from_secs(30);

/// Measure what every controller cache holds, every [`MEASURE_CACHES`], into the
/// `gantry_operator_cache_*` gauges (the operator's memory by store; docs/operator.md).
async fn measure_caches(
    metrics: Arc<Metrics>,
    caches: Caches,
    models: Store<DeserializeGuard<Model>>,
    pools: Store<DeserializeGuard<ModelPool>>,
    plugins: Store<DeserializeGuard<EnginePlugin>>,
    reports: Arc<Reports>,
) {
    let mut tick = tokio::time::interval(MEASURE_CACHES);
    loop {
        tick.tick().await;
        let mut stores = caches.footprint();
        stores.push(guarded("models", &models));
        stores.push(guarded("modelpools", &pools));
        stores.push(guarded("engineplugins", &plugins));
        let (n, bytes) = reports.footprint();
        stores.push(("node_reports", n, bytes));
        metrics.caches_hold(&stores);
    }
}

/// [`watch_cache::footprint`] of a store of guarded objects (those that deserialized).
fn guarded<K>(
    name: &'static str,
    store: &Store<DeserializeGuard<K>>,
) -> (&'static str, usize, usize)
where
    K: kube::Resource<DynamicType = ()> + serde::Serialize + Clone + 'static,
{
    let state = store.state();
    let bytes = watch_cache::serialized_size(state.iter().filter_map(|g| g.0.as_ref().ok()));
    (name, state.len(), bytes)
}

/// Objects per page of a watch's initial list. Each object is trimmed as it leaves its page,
/// so this bounds how many untrimmed objects (a node pod with its spec and managed fields is
/// ~10 KB parsed) are alive at once; kube's default of 500 makes the start-up peak, which the
/// allocator keeps, several times the size of the trimmed caches.
const LIST_PAGE: u32 = 50;

fn list_config() -> watcher::Config {
    watcher::Config::default().page_size(LIST_PAGE)
}

/// What a Model reconcile decides on besides its status: the spec (its generation), the
/// object's identity and whether it is being deleted.
fn spec_or_deletion<K: Resource>(m: &K) -> Option<u64> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    m.meta().uid.hash(&mut h);
    m.meta().generation.hash(&mut h);
    m.meta().deletion_timestamp.is_some().hash(&mut h);
    Some(h.finish())
}

/// One label-selected watch of `K` into its store.
fn spawn_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: reflector::store::Writer<K>,
    kind: Kind<K>,
    caches: &Caches,
    trigger: &mpsc::Sender<ModelRef>,
) -> tokio::task::JoinHandle<()>
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let events = watcher(api, config).default_backoff();
    tokio::spawn(watch_cache::drive(
        events,
        writer,
        kind,
        caches.recent.clone(),
        trigger.clone(),
    ))
}

/// Start the watches that fill `caches`: the operator's own objects (by the manager label),
/// metadata only but for Deployments, and the node pods.
fn start_watches(
    client: &Client,
    w: Writers,
    caches: &Caches,
    trigger: &mpsc::Sender<ModelRef>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let managed = format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}");
    let owned = list_config().labels(&managed);
    let node_pods = list_config().labels(&format!("{managed},{LABEL_NAME}={NODE_APP_NAME}"));
    fn meta<K: Resource<DynamicType = ()>>(name: &'static str) -> Kind<PartialObjectMeta<K>> {
        Kind {
            name,
            trim: watch_cache::trim_partial::<K>,
            owner: watch_cache::owner_model::<PartialObjectMeta<K>>,
        }
    }
    let c = client;
    vec![
        spawn_watch(
            Api::<PartialObjectMeta<ConfigMap>>::all(c.clone()),
            owned.clone(),
            w.config_maps,
            meta("ConfigMap"),
            caches,
            trigger,
        ),
        spawn_watch(
            Api::<PartialObjectMeta<Service>>::all(c.clone()),
            owned.clone(),
            w.services,
            meta("Service"),
            caches,
            trigger,
        ),
        spawn_watch(
            Api::<PartialObjectMeta<PodDisruptionBudget>>::all(c.clone()),
            owned.clone(),
            w.pdbs,
            meta("PodDisruptionBudget"),
            caches,
            trigger,
        ),
        spawn_watch(
            Api::<PartialObjectMeta<HorizontalPodAutoscaler>>::all(c.clone()),
            owned.clone(),
            w.hpas,
            meta("HorizontalPodAutoscaler"),
            caches,
            trigger,
        ),
        spawn_watch(
            Api::<PartialObjectMeta<PersistentVolumeClaim>>::all(c.clone()),
            owned.clone(),
            w.pvcs,
            meta("PersistentVolumeClaim"),
            caches,
            trigger,
        ),
        spawn_watch(
            Api::<PartialObjectMeta<NetworkPolicy>>::all(c.clone()),
            owned.clone(),
            w.network_policies,
            meta("NetworkPolicy"),
            caches,
            trigger,
        ),
        spawn_watch(
            Api::<Deployment>::all(c.clone()),
            owned,
            w.deployments,
            Kind {
                name: "Deployment",
                trim: watch_cache::trim_deployment,
                owner: watch_cache::owner_model::<Deployment>,
            },
            caches,
            trigger,
        ),
        spawn_watch(
            Api::<NodePod>::all(c.clone()),
            node_pods,
            w.pods,
            Kind {
                name: "Pod",
                trim: watch_cache::trim_pod,
                owner: watch_cache::pod_model,
            },
            caches,
            trigger,
        ),
    ]
}
