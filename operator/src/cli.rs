//! Command line (outside the reconcile path): `gantry-operator run` and `gantry-operator crdgen`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use gantry_api::node_token::InstallToken;

use crate::context::{NodeNetworkPolicy, Settings, default_node_image};
use crate::controller::{self, RunConfig, run};
use crate::crdgen::generate::{self, GenerateError};
use crate::leader::LeaseConfig;

#[derive(Debug, Parser)]
#[command(
    name = "gantry-operator",
    version,
    about = "Gantry operator: Model and EnginePlugin controllers, and the OpenAI gateway"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the components (controllers, gateway) against the cluster in KUBECONFIG or the
    /// in-cluster config.
    Run(Box<RunArgs>),
    /// Print the CRDs as YAML, or write them into one or more directories.
    Crdgen {
        /// Directory to write `gantry.dev_*.yaml` into (repeatable). Without it, print to stdout.
        #[arg(long)]
        out: Vec<PathBuf>,
    },
    /// Print the Kubernetes API permissions the operator needs (the Helm chart grants exactly these).
    Rbac {
        /// `json` (what the chart test reads) or `markdown` (the table in docs/security.md).
        #[arg(long, value_enum, default_value_t = RbacFormat::Json)]
        format: RbacFormat,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum RbacFormat {
    Json,
    Markdown,
}

/// A part of the operator process that `run` can start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Component {
    /// The Model and EnginePlugin controllers (behind leader election).
    Controller,
    /// The OpenAI gateway (active-active, no leader election).
    Gateway,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Components to run in this process, comma-separated.
    #[arg(
        long,
        env = "GANTRY_COMPONENTS",
        value_delimiter = ',',
        default_value = "controller,gateway"
    )]
    pub components: Vec<Component>,
    /// Image of the node pods.
    #[arg(long, env = "GANTRY_NODE_IMAGE", default_value_t = default_node_image())]
    pub node_image: String,
    /// GPU resource name for Models that do not set one.
    #[arg(long, env = "GANTRY_GPU_RESOURCE", default_value = "nvidia.com/gpu")]
    pub gpu_resource: String,
    /// Address of the metrics and health server.
    #[arg(long, env = "GANTRY_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,
    /// Reconciles in flight at once, per controller. A reconcile reads only caches; its time
    /// is its writes, so this bounds the writes in flight (docs/operator.md).
    #[arg(long, env = "GANTRY_CONCURRENCY", default_value_t = 16)]
    pub concurrency: u16,
    /// API requests per second the operator may start, watches, writes and autoscaler
    /// together (0: no limit). 100 lets 1,000 new Models (five writes each) converge in under
    /// a minute without crowding a small API server.
    #[arg(long, env = "GANTRY_API_QPS", default_value_t = 100)]
    pub api_qps: u32,
    /// Run without leader election (one replica only).
    #[arg(long, env = "GANTRY_NO_LEADER_ELECTION")]
    pub no_leader_election: bool,
    /// Namespace of the leader Lease (the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "gantry-system")]
    pub lease_namespace: String,
    /// Name of the leader Lease.
    #[arg(long, env = "GANTRY_LEASE_NAME", default_value = "gantry-operator")]
    pub lease_name: String,
    /// This replica's identity in the Lease (default: the pod name, else the hostname).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// The install token: each Model's node pods require a token derived from it, which the
    /// controller writes into a Secret beside the Model and the gateway sends (docs/security.md).
    /// Unset: node pods accept any caller.
    #[arg(long, env = "GANTRY_NODE_TOKEN", hide_env_values = true)]
    pub node_token: Option<InstallToken>,
    /// Give every Model a NetworkPolicy: node pods admit only this process's pods (selected by
    /// `--network-policy-peer-labels` in the `POD_NAMESPACE`) and reach only DNS and TCP 443.
    #[arg(long, env = "GANTRY_NODE_NETWORK_POLICY")]
    pub node_network_policy: bool,
    /// Labels of the operator and gateway pods, `key=value,...` (with `--node-network-policy`).
    #[arg(
        long,
        env = "GANTRY_NETWORK_POLICY_PEER_LABELS",
        value_delimiter = ',',
        value_parser = parse_label,
        default_value = "app.kubernetes.io/name=gantry"
    )]
    pub network_policy_peer_labels: Vec<(String, String)>,
    /// Namespace of the Prometheus that scrapes node pods (with `--node-network-policy`).
    #[arg(long, env = "GANTRY_NETWORK_POLICY_METRICS_NAMESPACE")]
    pub network_policy_metrics_namespace: Option<String>,
    /// How a new EnginePlugin version reaches running node pods: `in-place` (a plugin in
    /// `process` isolation is copied into the running pods and shadow-loaded, no pod restarts)
    /// or `rollout` (a new pod template for every version).
    #[arg(
        long,
        env = "GANTRY_PLUGIN_DELIVERY",
        value_enum,
        default_value = "in-place"
    )]
    pub plugin_delivery: crate::context::PluginDelivery,
    /// CIDRs node pods may download models from on TCP 443, comma-separated (default: any).
    #[arg(long, env = "GANTRY_NODE_DOWNLOAD_CIDRS", value_delimiter = ',')]
    pub node_download_cidrs: Vec<String>,
    #[command(flatten)]
    pub autoscaler: crate::autoscale::AutoscalerArgs,
    #[command(flatten)]
    pub gateway: gantry_gateway::GatewayArgs,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("expected key=value, got {s:?}")),
    }
}

impl RunArgs {
    /// The per-Model NetworkPolicy settings, when `--node-network-policy` is on.
    pub fn node_network_policy(&self) -> Option<NodeNetworkPolicy> {
        self.node_network_policy.then(|| NodeNetworkPolicy {
            peer_namespace: self.lease_namespace.clone(),
            peer_labels: self.network_policy_peer_labels.iter().cloned().collect(),
            metrics_namespace: self
                .network_policy_metrics_namespace
                .clone()
                .filter(|n| !n.is_empty()),
            download_cidrs: self
                .node_download_cidrs
                .iter()
                .filter(|c| !c.is_empty())
                .cloned()
                .collect(),
        })
    }
}

pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GANTRY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn identity(given: Option<String>) -> String {
    given
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| format!("gantry-operator-{}", std::process::id()))
}

/// Why a command failed; `main` prints it with its causes ([`error_chain`]) and exits 1.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Crdgen(#[from] GenerateError),
    /// Printing to stdout failed (a closed pipe is not an error).
    #[error(transparent)]
    Stdout(std::io::Error),
    #[error(transparent)]
    RbacJson(#[from] serde_json::Error),
    #[error(transparent)]
    Run(#[from] ComponentError),
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
}

/// Why `run` could not start a component, or why one ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum ComponentError {
    #[error("cannot build a Kubernetes client for the gateway")]
    GatewayClient(#[source] kube::Error),
    #[error("the gateway needs --endpoints-file or a cluster")]
    NoDiscovery,
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Gateway(#[from] gantry_gateway::ServeError),
    #[error(transparent)]
    Controller(#[from] controller::RunError),
    #[error("component task panicked")]
    Panicked(#[source] tokio::task::JoinError),
    #[error("--components named nothing to run")]
    NothingToRun,
    #[error("gateway settings: {0}")]
    GatewaySettings(String),
}

/// An error and its causes on one line, `outer: cause: root cause`: how `main` and the
/// component log report an error.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Run the parsed command on a new multi-threaded Tokio runtime, blocking until it ends.
///
/// The runtime lives here rather than in `main` so that the operator's async call tree is
/// compiled once, in this library: release builds do not share generic instances between
/// crates, and a binary that awaited [`dispatch`] itself compiled the whole tree again
/// (over two minutes of CPU per build).
pub fn run_blocking(cli: Cli) -> Result<ExitCode, CommandError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(CommandError::Runtime)?;
    runtime.block_on(dispatch(cli))
}

/// Run the parsed command.
pub async fn dispatch(cli: Cli) -> Result<ExitCode, CommandError> {
    match cli.command {
        Command::Crdgen { out } if out.is_empty() => {
            let yaml = generate::render_all()?;
            // `crdgen | head` closing the pipe early is not an error.
            match std::io::Write::write_all(&mut std::io::stdout().lock(), yaml.as_bytes()) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    Err(CommandError::Stdout(e))
                }
                _ => Ok(ExitCode::SUCCESS),
            }
        }
        Command::Crdgen { out } => {
            for dir in out {
                for path in generate::write_dir(&dir)? {
                    eprintln!("wrote {path}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Rbac { format } => {
            let text = match format {
                RbacFormat::Json => serde_json::to_string_pretty(&crate::rbac::to_json())? + "\n",
                RbacFormat::Markdown => crate::rbac::to_markdown(),
            };
            print!("{text}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Run(args) => {
            run_components(*args).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Start the chosen components. An error in any of them ends the process at once; a clean end
/// (after SIGTERM) waits up to [`COMPONENT_DRAIN`] for the others to finish.
async fn run_components(args: RunArgs) -> Result<(), ComponentError> {
    let mut tasks = tokio::task::JoinSet::new();
    if args.components.contains(&Component::Gateway) {
        let g = args.gateway.clone();
        let needs_client = g.endpoints_file.is_none() || g.api_keys_secret.is_some();
        let client = if needs_client {
            Some(
                kube::Client::try_default()
                    .await
                    .map_err(ComponentError::GatewayClient)?,
            )
        } else {
            None
        };
        let discovery = match (&g.endpoints_file, &client) {
            (Some(path), _) => gantry_gateway::Discovery::File(path.clone()),
            (None, Some(c)) => gantry_gateway::Discovery::Kube {
                client: c.clone(),
                namespace: g.watch_namespace.clone(),
            },
            (None, None) => return Err(ComponentError::NoDiscovery),
        };
        let mut settings = g.settings().map_err(ComponentError::GatewaySettings)?;
        settings.node_token = args.node_token.clone();
        let config = gantry_gateway::GatewayConfig {
            settings,
            discovery,
            keys: g.key_source(),
            client,
            scaler: None,
        };
        // One descriptor per client connection: raise the soft limit before listening.
        gantry_edge::prepare(&g.edge);
        let listener = tokio::net::TcpListener::bind(g.gateway_addr)
            .await
            .map_err(|source| ComponentError::Listen {
                addr: g.gateway_addr,
                source,
            })?;
        let gateway = gantry_gateway::serve(listener, config, shutdown_signal());
        tasks.spawn(async move { gateway.await.map_err(ComponentError::Gateway) });
    }
    if args.components.contains(&Component::Controller) {
        if args.node_token.is_none() {
            tracing::warn!(
                "no GANTRY_NODE_TOKEN: node pods will accept requests from anyone who can reach them"
            );
        }
        let settings = Settings {
            network_policy: args.node_network_policy(),
            node_image: args.node_image,
            default_gpu_resource: args.gpu_resource,
            node_token: args.node_token,
            plugin_delivery: args.plugin_delivery,
            ..Settings::default()
        };
        let lease = (!args.no_leader_election).then(|| {
            LeaseConfig::new(
                args.lease_namespace,
                args.lease_name,
                identity(args.identity),
            )
        });
        let controller = run(RunConfig {
            settings,
            metrics_addr: args.metrics_addr,
            lease,
            concurrency: args.concurrency,
            reports: Default::default(),
            api_qps: args.api_qps,
            autoscaler: args.autoscaler.config(),
        });
        tasks.spawn(async move { controller.await.map_err(ComponentError::Controller) });
    }
    match tasks.join_next().await {
        Some(done) => done.map_err(ComponentError::Panicked)??,
        None => return Err(ComponentError::NothingToRun),
    }
    // One component ended cleanly (SIGTERM): give the others their own drain, chiefly the
    // gateway's in-flight streams when the controller stops first. Bounded, because a follower
    // still waiting for the Lease never ends by itself.
    let rest = async {
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::error!(error = %error_chain(&e), "component ended with an error")
                }
                Err(e) => tracing::error!(error = %e, "component task panicked"),
            }
        }
    };
    if tokio::time::timeout(COMPONENT_DRAIN, rest).await.is_err() {
        tracing::warn!(
            seconds = COMPONENT_DRAIN.as_secs(),
            "components still running after the drain period; exiting"
        );
    }
    Ok(())
}

/// How long the remaining components may take to finish after the first one ends; below
/// Kubernetes' default 30 s termination grace period.
const COMPONENT_DRAIN: std::time::Duration = std::time::Duration::from_secs(25);
