//! Controller context (shared by every reconcile): the API client, operator settings, the
//! EnginePlugin cache, the owned-object and node pod caches, the node report cache, the event
//! recorder, metrics and per-object backoff.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::core::DeserializeGuard;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};

use gantry_api::node_token::InstallToken;

use crate::metrics::Metrics;
use crate::report_cache::Reports;
use crate::watch_cache::Caches;
use gantry_crd::names::NODE_PORT;
use gantry_crd::{EnginePlugin, Model, ModelPool};

/// Operator-wide settings (from flags and environment; see `cli`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Image of the node pods, e.g. `ghcr.io/gantry-dev/gantry-node:0.1.0`.
    pub node_image: String,
    /// GPU resource name when a Model does not set `resources.gpuResourceName`.
    pub default_gpu_resource: String,
    /// Port of the node's HTTP server (status endpoint, probes, OpenAI API).
    pub node_port: u16,
    /// Engine ABI major version the node image supports.
    pub abi_major: u32,
    /// The install token (`GANTRY_NODE_TOKEN`). Set: every Model gets a Secret with its derived
    /// node token, its node pods require it, and the operator sends it to `/v1/status`.
    /// `None`: no Secret and no check (a cluster run without the chart).
    pub node_token: Option<InstallToken>,
    /// Set: every Model gets a NetworkPolicy that admits only these peers to its node pods.
    pub network_policy: Option<NodeNetworkPolicy>,
    /// How a new version of a `process`-isolated EnginePlugin reaches running node pods.
    pub plugin_delivery: PluginDelivery,
}

/// How a new EnginePlugin version reaches running node pods (`--plugin-delivery`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PluginDelivery {
    /// A plugin in `process` isolation mounted by an init container gets its new version in
    /// the running pods: an ephemeral container copies it in and the node shadow-loads it, one
    /// pod first, then a quarter of the pods at a time. Other plugins roll the pods.
    #[default]
    InPlace,
    /// Every new version is a new pod template, which the Deployment rolls out (for clusters
    /// whose policy forbids ephemeral containers).
    Rollout,
}

/// Who may reach a Model's node pods, and where they may connect to (the per-Model
/// NetworkPolicy the build step renders).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeNetworkPolicy {
    /// Namespace of the operator and gateway pods (the operator's own).
    pub peer_namespace: String,
    /// Labels of the operator and gateway pods in that namespace.
    pub peer_labels: BTreeMap<String, String>,
    /// Namespace of the Prometheus that scrapes node pods' `/metrics`, if any.
    pub metrics_namespace: Option<String>,
    /// Where node pods may download models from on TCP 443; empty: anywhere.
    pub download_cidrs: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            node_image: default_node_image(),
            default_gpu_resource: "nvidia.com/gpu".to_string(),
            node_port: NODE_PORT as u16,
            abi_major: gantry_engine_abi::ffi::GANTRY_ABI_MAJOR,
            node_token: None,
            network_policy: None,
            plugin_delivery: PluginDelivery::InPlace,
        }
    }
}

/// The node image matching this operator's version.
pub fn default_node_image() -> String {
    format!(
        "ghcr.io/gantry-dev/gantry-node:{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// The clock, injectable so that tests can pin `lastTransitionTime`.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// Everything a reconcile needs besides the object itself.
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    /// Every EnginePlugin, kept current by a reflector. The Model controller starts only once
    /// this cache has listed everything, so an empty cache never means "no plugins" by mistake.
    pub plugins: Store<DeserializeGuard<EnginePlugin>>,
    /// Owned objects and node pods, kept current by watches (see `watch_cache`): the read step
    /// never asks the API server.
    pub caches: Caches,
    /// The node pods' last status answers (see `report_cache`).
    pub reports: Arc<Reports>,
    /// Who the Events say wrote them (see [`Context::recorder`]).
    reporter: Reporter,
    pub metrics: Arc<Metrics>,
    pub clock: Clock,
    /// Every Model and every ModelPool, kept current by the controllers' reflectors: a pool
    /// reconcile reads its members here, a member's reconcile its pool.
    pub models: Store<DeserializeGuard<Model>>,
    pub pools: Store<DeserializeGuard<ModelPool>>,
    /// Consecutive transient failures per object, for exponential backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    /// An Event recorder for one status write, as kube intends it (created per reconcile).
    /// kube's `Recorder` keeps every Event it published for six minutes to count repeats as a
    /// series; one recorder shared by all reconciles held ~10 MB at 1,000 Models (3,000
    /// Events, measured with heaptrack in the operator-scale benchmark). A status write
    /// publishes an Event only when a condition changes, so a repeat within one write is the
    /// only series there is; a condition that flaps makes a new Event each time instead.
    pub fn recorder(&self) -> Recorder {
        Recorder::new(self.client.clone(), self.reporter.clone())
    }

    pub fn new(
        client: Client,
        settings: Settings,
        plugins: Store<DeserializeGuard<EnginePlugin>>,
        caches: Caches,
        reports: Arc<Reports>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let reporter = Reporter {
            controller: gantry_crd::names::FIELD_MANAGER.to_string(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Context {
            reporter,
            client,
            settings,
            plugins,
            caches,
            reports,
            metrics,
            clock: Arc::new(Timestamp::now),
            models: reflector::store().0,
            pools: reflector::store().0,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Read Models and ModelPools from these stores (the controllers' reflectors).
    pub fn with_stores(
        mut self,
        models: Store<DeserializeGuard<Model>>,
        pools: Store<DeserializeGuard<ModelPool>>,
    ) -> Self {
        self.models = models;
        self.pools = pools;
        self
    }

    /// The Models in `namespace` whose `spec.pool` is `pool`, oldest first (then by name): of
    /// two members with one served name the older keeps it.
    pub fn pool_members(&self, namespace: &str, pool: &str) -> Vec<Model> {
        let mut members: Vec<Model> = self
            .models
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .filter(|m| {
                m.metadata.namespace.as_deref() == Some(namespace)
                    && m.spec.pool.as_deref() == Some(pool)
                    && m.metadata.deletion_timestamp.is_none()
            })
            .cloned()
            .collect();
        members.sort_by(|a, b| {
            (&a.metadata.creation_timestamp, &a.metadata.name)
                .partial_cmp(&(&b.metadata.creation_timestamp, &b.metadata.name))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        members
    }

    /// The ModelPool `name` in `namespace`, if it exists and deserialized.
    pub fn pool(&self, namespace: &str, name: &str) -> Option<ModelPool> {
        self.pools
            .get(&ObjectRef::new(name).within(namespace))
            .and_then(|g| g.0.as_ref().ok().cloned())
    }

    /// Replace the clock (tests).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub fn now(&self) -> Timestamp {
        (self.clock)()
    }

    /// Every EnginePlugin that deserialized, sorted by name: metadata and spec, which is what
    /// engine resolution, acceptance and pool admission read. The status is left out: it names
    /// every node pod that loaded the plugin (150 KB at 1,000 pods), and every reconcile in
    /// flight would hold a copy of it.
    pub fn engine_plugins(&self) -> Vec<EnginePlugin> {
        let mut plugins: Vec<EnginePlugin> = self
            .plugins
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .map(|p| EnginePlugin {
                metadata: p.metadata.clone(),
                spec: p.spec.clone(),
                status: None,
            })
            .collect();
        plugins.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        plugins
    }

    /// Record one more transient failure of `key` and return how long to wait:
    /// 5 s, 10 s, 20 s, ... capped at 5 minutes.
    pub fn backoff(&self, key: &str) -> Duration {
        let mut failures = self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = failures.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        let secs = 5u64.saturating_mul(1u64 << (*n - 1).min(6));
        Duration::from_secs(secs.min(300))
    }

    /// A reconcile of `key` succeeded: the next failure starts the backoff over.
    pub fn reset_backoff(&self, key: &str) {
        self.failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(key);
    }
}
