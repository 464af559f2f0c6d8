//! The gateway's flags and settings (read once at start-up, before any request): the
//! `gantry-operator run` flags in [`GatewayArgs`] and the tunables every request reads in
//! [`GatewaySettings`] (hold bounds, retries, probe interval, node token, routing keys).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use gantry_api::node_token::InstallToken;

use crate::auth::KeySource;

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
