//! The in-cluster OpenAI gateway (data-plane edge, `gantry-operator run --components gateway`):
//! one endpoint for every Model, in front of the node pods.
//!
//! Request path: [`proxy`] (auth from [`auth`], body, `model`, routing key from [`affinity`])
//! → [`routes`] (the key's last replica from [`placement`] or its place on the ring, within a
//! load bound, else the least loaded; held while none is ready, asking [`scale`] for one)
//! → upstream node → response relayed unbuffered. Discovery feeds [`routes`]: [`kube_source`] (Models + EndpointSlices
//! reflectors) in a cluster, [`static_source`] (a YAML file) elsewhere; [`probe`] polls every
//! replica's `/v1/status` for readiness and queue depth. The gateway keeps no state worth
//! electing a leader for: replicas run active-active. docs/gateway.md describes it for users.
//!
//! The gateway shares only the custom resources, object names and condition reasons with the
//! operator (through `gantry-crd`); the `gantry-operator` binary starts it through [`serve`].
#![forbid(unsafe_code)]

pub mod affinity;
pub mod auth;
pub mod error;
pub mod kube_source;
pub mod metrics;
pub mod placement;
pub mod probe;
pub mod proxy;
pub mod routes;
pub mod scale;
pub mod static_source;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};

use gantry_api::node_token::InstallToken;

use crate::auth::{ApiKeys, KeySource};
use crate::metrics::GatewayMetrics;
use crate::routes::RouteTable;
use crate::scale::{KubeScaler, RecordingScaler, ScaleRequests, Scaler};

/// The gateway's flags (flattened into `gantry-operator run`).
#[derive(Clone, Debug, clap::Args)]
pub struct GatewayArgs {
    /// Address the gateway serves the OpenAI routes, `/healthz`, `/readyz` and `/metrics` on.
    #[arg(long, env = "GANTRY_GATEWAY_ADDR", default_value = "0.0.0.0:8080")]
    pub gateway_addr: SocketAddr,
    /// Route from this YAML file (model id -> node base URLs) instead of watching the cluster.
    #[arg(long, env = "GANTRY_GATEWAY_ENDPOINTS_FILE")]
    pub endpoints_file: Option<PathBuf>,
    /// Watch Models and EndpointSlices in this namespace only (default: all namespaces).
    #[arg(long, env = "GANTRY_GATEWAY_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// The gateway's own namespace (where `--api-keys-secret` lives).
    #[arg(
        long = "gateway-namespace",
        env = "POD_NAMESPACE",
        default_value = "gantry-system"
    )]
    pub namespace: String,
    /// Connection limits and the body limit (the same flags and defaults as the node's).
    #[command(flatten)]
    pub edge: gantry_edge::EdgeArgs,
    /// How long a request waits for a first ready replica (scale from zero) before a 503.
    #[arg(
        long,
        env = "GANTRY_GATEWAY_HOLD_TIMEOUT_SECONDS",
        default_value_t = 600
    )]
    pub hold_timeout_seconds: u64,
    /// Requests held at once, all models (503 with Retry-After beyond).
    #[arg(long, env = "GANTRY_GATEWAY_MAX_HELD", default_value_t = 256)]
    pub max_held: usize,
    /// Requests held at once for one model (503 with Retry-After beyond).
    #[arg(long, env = "GANTRY_GATEWAY_MAX_HELD_PER_MODEL", default_value_t = 64)]
    pub max_held_per_model: usize,
    /// Retries on another replica before the first response byte (connect errors and 503).
    #[arg(long, env = "GANTRY_GATEWAY_MAX_RETRIES", default_value_t = 2)]
    pub max_retries: usize,
    /// How often each replica's `/v1/status` is polled, in milliseconds.
    #[arg(long, env = "GANTRY_GATEWAY_PROBE_INTERVAL_MS", default_value_t = 1000)]
    pub probe_interval_ms: u64,
    /// Require API keys from this Secret (in the gateway's namespace); see docs/gateway.md.
    #[arg(
        long,
        env = "GANTRY_GATEWAY_API_KEYS_SECRET",
        conflicts_with = "api_keys_file"
    )]
    pub api_keys_secret: Option<String>,
    /// Require API keys from this YAML file (same format as the Secret's entries).
    #[arg(long, env = "GANTRY_GATEWAY_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Session and prompt-prefix affinity (docs/gateway.md, "Routing").
    #[command(flatten)]
    pub routing: crate::affinity::RoutingArgs,
}

/// Tunables of a running gateway.
#[derive(Clone, Debug)]
pub struct GatewaySettings {
    /// Largest request body (413 beyond); the node's default is the same.
    pub max_body_bytes: usize,
    /// Connection cap and timeouts of the gateway's own listener.
    pub edge: gantry_edge::EdgeArgs,
    pub hold_timeout: Duration,
    pub max_held: usize,
    pub max_held_per_model: usize,
    pub max_retries: usize,
    pub probe_interval: Duration,
    /// The install token (`GANTRY_NODE_TOKEN`): each Model's node token is derived from it and
    /// sent as `X-Gantry-Node-Token`; static endpoints get it as is. `None`: no token is sent.
    pub node_token: Option<InstallToken>,
    /// Routing keys and the load bound of keyed picks.
    pub affinity: crate::affinity::Affinity,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            max_body_bytes: gantry_edge::DEFAULT_MAX_BODY_BYTES,
            edge: gantry_edge::EdgeArgs::default(),
            hold_timeout: Duration::from_secs(600),
            max_held: 256,
            max_held_per_model: 64,
            max_retries: 2,
            probe_interval: Duration::from_secs(1),
            node_token: None,
            affinity: crate::affinity::Affinity::default(),
        }
    }
}

impl GatewayArgs {
    /// The settings these flags give; an invalid routing flag is an error naming it.
    pub fn settings(&self) -> Result<GatewaySettings, String> {
        Ok(GatewaySettings {
            max_body_bytes: self.edge.max_body_bytes,
            edge: self.edge.clone(),
            hold_timeout: Duration::from_secs(self.hold_timeout_seconds),
            max_held: self.max_held,
            max_held_per_model: self.max_held_per_model,
            max_retries: self.max_retries,
            probe_interval: Duration::from_millis(self.probe_interval_ms.max(50)),
            // Set by `gantry-operator run --node-token`, shared with the controller.
            node_token: None,
            affinity: self.routing.affinity()?,
        })
    }

    pub fn key_source(&self) -> Option<KeySource> {
        match (&self.api_keys_file, &self.api_keys_secret) {
            (Some(p), _) => Some(KeySource::File(p.clone())),
            (None, Some(name)) => Some(KeySource::Secret {
                namespace: self.namespace.clone(),
                name: name.clone(),
            }),
            (None, None) => None,
        }
    }
}

/// Shared by every request.
pub struct GatewayState {
    pub table: Arc<RouteTable>,
    pub client: reqwest::Client,
    pub metrics: Arc<GatewayMetrics>,
    pub keys: Option<Arc<ApiKeys>>,
    pub scale: ScaleRequests,
    pub settings: GatewaySettings,
    /// Requests held now, all models.
    held: AtomicUsize,
}

impl std::fmt::Debug for GatewayState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GatewayState")
    }
}

/// Where routes come from.
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

/// The gateway's router over `state`.
pub fn router(state: Arc<GatewayState>) -> Router {
    let max_body = state.settings.max_body_bytes;
    let routes = Router::new()
        .route("/v1/models", get(proxy::models))
        .route(
            "/v1/chat/completions",
            post(|s, h, b| proxy::proxy(s, "/v1/chat/completions", h, b)),
        )
        .route(
            "/v1/completions",
            post(|s, h, b| proxy::proxy(s, "/v1/completions", h, b)),
        )
        .route(
            "/v1/embeddings",
            post(|s, h, b| proxy::proxy(s, "/v1/embeddings", h, b)),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async { crate::error::GatewayError::no_route() })
        .with_state(state);
    gantry_edge::layers(routes, max_body)
}

async fn readyz(State(s): State<Arc<GatewayState>>) -> impl IntoResponse {
    if s.table.is_synced() {
        (StatusCode::OK, "ready")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "discovery has not synced yet",
        )
    }
}

async fn metrics(State(s): State<Arc<GatewayState>>) -> impl IntoResponse {
    s.metrics
        .placements
        .set(i64::try_from(s.table.placements()).unwrap_or(i64::MAX));
    match s.metrics.encode() {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            text,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            e.to_string(),
        ),
    }
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
