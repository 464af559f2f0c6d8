//! Gateway start-up and shutdown (around the request path): loads API keys, starts discovery
//! (an endpoints file or the kube reflectors) feeding the [`RouteTable`], the prober and the
//! key refresh, then serves [`crate::router()`] until shutdown.
//!
//! The `gantry-operator` binary calls [`serve`] with a [`GatewayConfig`] built from its flags.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use gantry_api::node_token::InstallToken;

use crate::auth::{self, ApiKeys, KeySource};
use crate::metrics::GatewayMetrics;
use crate::route_table::RouteTable;
use crate::router::router;
use crate::scale::{self, KubeScaler, RecordingScaler, ScaleRequests, Scaler};
use crate::settings::GatewaySettings;
use crate::state::GatewayState;
use crate::{kube_source, probe, static_source};

/// Where the route table comes from.
#[derive(Clone)]
pub enum Discovery {
    /// `--endpoints-file`.
    File(PathBuf),
    /// Models and EndpointSlices, in one namespace or all.
    Kube {
        client: kube::Client,
        namespace: Option<String>,
    },
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Discovery::File(p) => write!(f, "File({})", p.display()),
            Discovery::Kube { namespace, .. } => write!(f, "Kube({namespace:?})"),
        }
    }
}

/// The HTTP client to nodes: a warm keep-alive pool, no overall timeout (streams run long).
pub fn upstream_client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        // Below the node's idle timeout (60 s by default), so the gateway never reuses a
        // connection the node is closing.
        .pool_idle_timeout(Duration::from_secs(30))
        .tcp_nodelay(true)
        .http1_only()
        .user_agent(scale::GATEWAY_FIELD_MANAGER)
        .build()
}

/// Everything a gateway needs to start.
pub struct GatewayConfig {
    pub settings: GatewaySettings,
    pub discovery: Discovery,
    pub keys: Option<KeySource>,
    /// For the API keys Secret (needed with `KeySource::Secret`).
    pub client: Option<kube::Client>,
    /// `None`: the Deployment annotation when discovery is kube, a no-op recorder otherwise.
    pub scaler: Option<Arc<dyn Scaler>>,
}

impl std::fmt::Debug for GatewayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayConfig")
            .field("settings", &self.settings)
            .field("discovery", &self.discovery)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

/// Why the gateway could not start, or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot register gateway metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("cannot build the upstream HTTP client")]
    UpstreamClient(#[source] reqwest::Error),
    #[error("cannot load API keys")]
    Keys(#[source] auth::KeysError),
    #[error(transparent)]
    EndpointsFile(#[from] static_source::EndpointsFileError),
    #[error("gateway server")]
    Serve(#[source] std::io::Error),
}

/// Serve on `listener` until `shutdown` resolves. Start-up fails on a bad endpoints file or
/// key set; after that, bad edits are logged and the last good state kept.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: GatewayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let metrics = Arc::new(GatewayMetrics::new().map_err(ServeError::Metrics)?);
    let client = upstream_client().map_err(ServeError::UpstreamClient)?;
    let mut tasks = tokio::task::JoinSet::new();

    let keys = match &config.keys {
        Some(source) => {
            let keys = Arc::new(ApiKeys::default());
            auth::load(&keys, source, config.client.as_ref())
                .await
                .map_err(ServeError::Keys)?;
            tasks.spawn(auth::refresh(
                keys.clone(),
                source.clone(),
                config.client.clone(),
            ));
            Some(keys)
        }
        None => None,
    };

    let ttl = config.settings.affinity.placement_ttl;
    let (table, scaler): (Arc<RouteTable>, Arc<dyn Scaler>) = match &config.discovery {
        Discovery::File(path) => {
            let table = Arc::new(
                RouteTable::new(false)
                    .with_placement_ttl(ttl)
                    .with_default_node_token(
                        config
                            .settings
                            .node_token
                            .as_ref()
                            .map(InstallToken::as_node_token),
                    ),
            );
            let text = static_source::load(path, &table).await?;
            tasks.spawn(static_source::watch(
                path.clone(),
                table.clone(),
                text,
                Duration::from_secs(1),
            ));
            let scaler = config
                .scaler
                .clone()
                .unwrap_or_else(|| Arc::new(RecordingScaler::default()));
            (table, scaler)
        }
        Discovery::Kube { client, namespace } => {
            let table = Arc::new(RouteTable::new(true).with_placement_ttl(ttl));
            tasks.spawn(kube_source::run(
                client.clone(),
                namespace.clone(),
                table.clone(),
                config.settings.node_token.clone(),
            ));
            let scaler = config
                .scaler
                .clone()
                .unwrap_or_else(|| Arc::new(KubeScaler::new(client.clone())));
            (table, scaler)
        }
    };
    tasks.spawn(probe::run(
        table.clone(),
        client.clone(),
        config.settings.probe_interval,
    ));

    let state = Arc::new(GatewayState {
        table,
        client,
        metrics,
        keys,
        scale: ScaleRequests::new(scaler),
        settings: config.settings,
        held: AtomicUsize::new(0),
    });
    tracing::info!(addr = ?listener.local_addr().ok(), discovery = ?config.discovery, "gateway serving");
    let edge = state.settings.edge.clone();
    let edge_metrics = Some(state.metrics.edge.clone());
    let served = gantry_edge::serve(listener, router(state), edge, edge_metrics, shutdown).await;
    tasks.abort_all();
    served.map_err(ServeError::Serve)
}
