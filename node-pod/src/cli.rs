//! Command line (outside the request path): `gantry-node serve`, `gantry-node engines list|info`
//! and `gantry-node devices`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use gantry_engine_abi::{Backend, EngineConfig};

use std::sync::Arc;

mod engines_bench;

use engines_bench::engines_bench;

use crate::config_file::{ConfigFile, Overrides};
use crate::engine_host::{EngineRegistry, PluginState, default_plugins_dir};
use crate::node::Node;
use crate::store::StoreSetup;
use gantry_api::config::NodeConfig;

#[derive(Debug, Parser)]
#[command(
    name = "gantry-node",
    version,
    about = "Gantry node: engine host and OpenAI-compatible server"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve models through the OpenAI API.
    Serve(Box<ServeArgs>),
    /// Inspect the engine plugins this node can load.
    #[command(subcommand)]
    Engines(EnginesCommand),
    /// The GPUs this process sees, as the memory policy reads them (no GPU is a normal answer).
    Devices(DevicesArgs),
    /// Run one model's engine plugin for a node in `process` isolation (started by the node,
    /// not by hand).
    #[command(hide = true)]
    EngineWorker {
        /// The Unix socket to serve the node on.
        #[arg(long)]
        socket: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// Print the snapshot as JSON (the form `serve --device-snapshot` reads back).
    #[arg(long)]
    pub json: bool,
    /// Device memory kept out of every VRAM budget, per device, in bytes.
    #[arg(long, env = "GANTRY_VRAM_RESERVE", default_value_t = crate::devices::DEFAULT_VRAM_RESERVE_BYTES)]
    pub vram_reserve: u64,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// YAML file listing the models to serve (see docs/node.md).
    #[arg(long, env = "GANTRY_CONFIG", conflicts_with = "model")]
    pub config: Option<PathBuf>,
    /// Re-read `--config` every S seconds and apply a changed model list without a restart
    /// (0 = no polling; SIGHUP reloads either way).
    #[arg(long, env = "GANTRY_CONFIG_RELOAD_SECONDS", default_value_t = 5)]
    pub config_reload_seconds: u64,
    /// Check the plugin tree every S seconds and put a changed plugin library in force:
    /// by shadow load for a plugin in `process` isolation, at the next restart for an
    /// in-process one (0 = never).
    #[arg(long, env = "GANTRY_PLUGIN_RELOAD_SECONDS", default_value_t = 5)]
    pub plugin_reload_seconds: u64,
    /// Serve one model file (`.gguf`, `.onnx`) or directory; the format follows from the path.
    #[arg(long, env = "GANTRY_MODEL")]
    pub model: Option<PathBuf>,
    /// OpenAI model id for `--model` (default: the file name without extension).
    #[arg(long, env = "GANTRY_MODEL_ID", requires = "model")]
    pub model_id: Option<String>,
    /// Connection limits and the body limit (shared with the gateway).
    #[command(flatten)]
    pub edge: gantry_edge::EdgeArgs,
    /// Address to listen on.
    #[arg(long, env = "GANTRY_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: String,
    /// Directory holding `{engine_id}/{gpu_backend}/manifest.json` (default: `engines/` beside this binary).
    #[arg(long, env = "GANTRY_PLUGINS_DIR")]
    pub plugins_dir: Option<PathBuf>,
    /// Compute backend of this node: `cpu` or `cuda`.
    #[arg(long, env = "GANTRY_BACKEND", default_value = "cpu", value_parser = parse_backend)]
    pub backend: Backend,
    /// Engine threads (0 = all cores).
    #[arg(long, env = "GANTRY_THREADS")]
    pub threads: Option<u32>,
    /// Per-sequence context length for `--model` (default: min(trained, 4096)).
    #[arg(long, env = "GANTRY_CONTEXT_LENGTH")]
    pub context_length: Option<u32>,
    /// Sequences decoded together for `--model`.
    #[arg(long, env = "GANTRY_MAX_BATCH_SIZE")]
    pub max_batch_size: Option<u32>,
    /// A LoRA adapter of `--model`, as `NAME=PATH` (a GGUF LoRA for a GGUF model, a PEFT
    /// directory for a safetensors one), served as `<model id>:NAME`; repeatable.
    #[arg(long = "adapter", value_name = "NAME=PATH")]
    pub adapters: Vec<String>,
    /// Request deadline in seconds (0 = none); overrides the config's default.
    #[arg(long, env = "GANTRY_REQUEST_TIMEOUT")]
    pub request_timeout: Option<u64>,
    /// Device memory limit in bytes handed to engines (0 = no limit beyond the devices': on a
    /// CUDA node the memory policy always budgets the devices' real free memory).
    #[arg(long, env = "GANTRY_VRAM_LIMIT", default_value_t = 0)]
    pub vram_limit: u64,
    /// Device memory kept out of every VRAM budget, per device, in bytes: the CUDA context,
    /// cuBLAS workspaces and allocator slack no engine reports.
    #[arg(long, env = "GANTRY_VRAM_RESERVE", default_value_t = crate::devices::DEFAULT_VRAM_RESERVE_BYTES)]
    pub vram_reserve: u64,
    /// Take device figures from this recorded snapshot (`gantry-node devices --json`)
    /// instead of the CUDA driver: for tests and for replaying a GPU node's numbers.
    #[arg(long, env = "GANTRY_DEVICE_SNAPSHOT")]
    pub device_snapshot: Option<PathBuf>,
    /// RAM the models may hold, in bytes; past 90 % the least-recently-used
    /// idle model is unloaded, and a load that cannot fit is refused with
    /// OOM_RAM (0 = the container's cgroup memory.max, else MemTotal).
    #[arg(long, env = "GANTRY_RAM_LIMIT", default_value_t = 0)]
    pub ram_limit: u64,
    /// Most prompt tokens fed per engine step across prefilling sequences.
    #[arg(long, env = "GANTRY_PREFILL_CHUNK_TOKENS")]
    pub prefill_chunk_tokens: Option<u32>,
    /// Disable the temperature-0 response cache.
    #[arg(long, env = "GANTRY_NO_RESPONSE_CACHE")]
    pub no_response_cache: bool,
    /// Where engine plugins run unless the config names the plugin: `inProcess`, or
    /// `process` (a worker process per loaded model; overrides the config's
    /// `isolation.default`).
    #[arg(long, env = "GANTRY_ISOLATION", value_parser = ["inProcess", "process"])]
    pub isolation: Option<String>,
    /// Where the model store downloads artifacts (overrides the config's `cacheDir`).
    #[arg(long, env = "GANTRY_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Hugging Face endpoint for `hf://` sources (default `https://huggingface.co`).
    #[arg(long, env = "HF_ENDPOINT")]
    pub hf_endpoint: Option<String>,
    /// S3-compatible endpoint for `s3://` sources (default AWS).
    #[arg(long, env = "AWS_ENDPOINT_URL")]
    pub s3_endpoint: Option<String>,
    /// S3 region (default `us-east-1`).
    #[arg(long, env = "AWS_REGION")]
    pub s3_region: Option<String>,
    /// Require this token in `X-Gantry-Node-Token` on every route but /healthz, /readyz and
    /// /metrics (in a cluster: the Model's token from its Secret). Unset: no check.
    #[arg(long, env = "GANTRY_NODE_TOKEN", hide_env_values = true)]
    pub node_token: Option<String>,
}

impl ServeArgs {
    /// The flags that override the config file's node-wide settings.
    fn overrides(&self) -> Overrides {
        Overrides {
            request_timeout: self.request_timeout,
            threads: self.threads,
            prefill_chunk_tokens: self.prefill_chunk_tokens,
            no_response_cache: self.no_response_cache,
            isolation: self.isolation.as_deref().map(|i| match i {
                "process" => gantry_api::config::Isolation::Process,
                _ => gantry_api::config::Isolation::InProcess,
            }),
        }
    }

    /// How the node makes its model store (at start, or at the reload that brings the
    /// first remote model).
    fn store_setup(&self) -> StoreSetup {
        StoreSetup {
            hf_endpoint: self.hf_endpoint.clone(),
            s3_endpoint: self.s3_endpoint.clone(),
            s3_region: self.s3_region.clone(),
            cache_dir: self.cache_dir.clone(),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum EnginesCommand {
    /// One line per discovered plugin with its load status.
    List(EngineArgs),
    /// Everything known about one plugin.
    Info {
        /// Engine id, e.g. `llama_cpp`.
        id: String,
        #[command(flatten)]
        args: EngineArgs,
    },
    /// Benchmark every plugin that supports a model (the node's engine choice by
    /// measurement, without its cache) and say which the rule picks.
    Bench {
        /// The model: a `.gguf` file, or a safetensors directory (or its `model.safetensors`).
        model: PathBuf,
        /// Engine threads.
        #[arg(long, default_value_t = 2)]
        threads: u32,
        #[command(flatten)]
        args: EngineArgs,
    },
}

#[derive(Debug, Args)]
pub struct EngineArgs {
    /// Directory holding `{engine_id}/{gpu_backend}/manifest.json` (default: `engines/` beside this binary).
    #[arg(long, env = "GANTRY_PLUGINS_DIR")]
    pub plugins_dir: Option<PathBuf>,
    /// Compute backend of this node: `cpu` or `cuda`.
    #[arg(long, env = "GANTRY_BACKEND", default_value = "cpu", value_parser = parse_backend)]
    pub backend: Backend,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    Backend::parse(s).ok_or_else(|| format!("backend must be `cpu` or `cuda`, got {s:?}"))
}

pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GANTRY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}

pub(crate) fn registry(args: &EngineArgs) -> EngineRegistry {
    let dir = args.plugins_dir.clone().unwrap_or_else(default_plugins_dir);
    let config = EngineConfig {
        backend: args.backend,
        ..EngineConfig::default()
    };
    EngineRegistry::discover(&dir, &config)
}

fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    // With `--config`, the file (its hash names it in /v1/status) and later versions of it.
    let (config, file) = match (&args.config, &args.model) {
        (Some(path), _) => {
            let file = ConfigFile {
                path: path.clone(),
                overrides: args.overrides(),
            };
            let version = file.read()?;
            (version.config, Some((file, version.hash)))
        }
        (None, Some(model)) => {
            let mut c = NodeConfig::single(model, args.model_id.clone())?;
            let m = &mut c.models[0];
            m.context_length = args.context_length.or(Some(crate::node::DEFAULT_CONTEXT));
            m.max_batch_size = args.max_batch_size;
            for a in &args.adapters {
                let (name, path) = a
                    .split_once('=')
                    .ok_or_else(|| anyhow::anyhow!("--adapter {a:?}: give NAME=PATH"))?;
                m.adapters.push(gantry_api::config::AdapterConfig {
                    name: name.into(),
                    path: Some(path.into()),
                    ..Default::default()
                });
            }
            args.overrides().apply(&mut c);
            c.validate()?;
            (c, None)
        }
        (None, None) => anyhow::bail!("give --config FILE or --model PATH"),
    };
    let engine_config = EngineConfig {
        backend: args.backend,
        n_threads: config.scheduler.threads,
        vram_limit_bytes: args.vram_limit,
        max_batch_size: crate::node::DEFAULT_MAX_BATCH,
        context_length: crate::node::DEFAULT_CONTEXT,
        ..EngineConfig::default()
    };
    let plugins_dir = args.plugins_dir.clone().unwrap_or_else(default_plugins_dir);
    let store_setup = args.store_setup();
    let store = if config.models.iter().any(|m| m.downloads()) {
        Some(store_setup.store_for(&config)?)
    } else {
        None
    };
    gantry_edge::prepare(&args.edge);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        // Listen first: /healthz answers before any plugin or model is loaded.
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let node_token =
            crate::node_token::NodeToken::from_setting(args.node_token.as_deref())?;
        if node_token.is_none() {
            tracing::warn!(
                "no GANTRY_NODE_TOKEN: every route is open to anyone who can reach this port"
            );
        }
        let devices = match &args.device_snapshot {
            Some(p) => crate::devices::NodeDevices::recorded(p, args.vram_reserve)
                .map_err(anyhow::Error::msg)?,
            None => crate::devices::NodeDevices::from_driver(args.vram_reserve),
        };
        let mut node = Node::new(config, plugins_dir, engine_config)
            .with_ram_limit(args.ram_limit)
            .with_devices(devices)
            .with_node_token(node_token)
            .with_store_setup(store_setup)
            .with_config_hash(file.as_ref().map(|(_, hash)| hash.clone()));
        if let Some(store) = store {
            node = node.with_store(store);
        }
        let node = Arc::new(node);
        if let Some((file, _)) = file {
            let every = (args.config_reload_seconds > 0)
                .then(|| std::time::Duration::from_secs(args.config_reload_seconds));
            crate::config_file::spawn_reloads(node.clone(), file, every)
                .context("cannot install the SIGHUP handler for config reloads")?;
        }
        let limits = &node.memory.limits;
        tracing::info!(
            ram_limit = limits.get(crate::memory::Pool::Ram),
            ram_limit_source = node.memory.ram_source.as_str(),
            vram_limit = limits.get(crate::memory::Pool::Vram),
            "memory policy: unload the least-recently-used idle model above {} %",
            limits.watermark_percent()
        );
        let snap = node.devices.snapshot();
        match &snap.note {
            Some(why) => tracing::info!(source = %snap.source, "no GPU: {why}"),
            None => {
                for d in &snap.devices {
                    tracing::info!(device = d.index, name = %d.name, compute_capability = %d.compute_capability, total = d.total_bytes, free = d.free_bytes, source = %snap.source, "GPU");
                }
            }
        }
        node.spawn_device_refresh();
        node.spawn_plugin_watch(
            (args.plugin_reload_seconds > 0)
                .then(|| std::time::Duration::from_secs(args.plugin_reload_seconds)),
        );
        let starter = node.clone();
        tokio::task::spawn_blocking(move || starter.start());
        let served = crate::http::serve(node, listener, args.edge.clone()).await;
        // The workers' sockets and pinned libraries (`process` isolation) go with the node.
        crate::engine_host::worker::client::remove_private_dir();
        served?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(args) => serve(*args),
        Command::EngineWorker { socket } => {
            crate::engine_host::worker::serve::run(&socket)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Devices(args) => {
            let devices = crate::devices::NodeDevices::from_driver(args.vram_reserve);
            let snap = devices.snapshot();
            if args.json {
                println!("{}", serde_json::to_string_pretty(&snap)?);
                return Ok(ExitCode::SUCCESS);
            }
            if let Some(why) = &snap.note {
                println!("no GPU: {why}");
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "source: {}, CUDA driver {}",
                snap.source,
                snap.driver_version.as_deref().unwrap_or("?")
            );
            println!(
                "{:<4} {:<28} {:<4} {:>12} {:>12} {:>5}  UUID",
                "IDX", "NAME", "CC", "TOTAL", "FREE", "UTIL"
            );
            for d in &snap.devices {
                println!(
                    "{:<4} {:<28} {:<4} {:>12} {:>12} {:>5}  {}",
                    d.index,
                    d.name,
                    d.compute_capability,
                    crate::memory::human(d.total_bytes),
                    crate::memory::human(d.free_bytes),
                    d.utilization_percent
                        .map_or("-".to_string(), |u| format!("{u}%")),
                    d.uuid.as_deref().unwrap_or("-")
                );
            }
            let budget = crate::devices::vram_budget(&snap, devices.reserve, 0).unwrap_or(0);
            println!(
                "VRAM budget for models: {} (every device's total less {} reserve, less what is in use now)",
                crate::memory::human(budget),
                crate::memory::human(devices.reserve)
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Engines(EnginesCommand::List(args)) => {
            let reg = registry(&args);
            let rows: Vec<_> = reg.records.iter().map(|r| r.summary()).collect();
            if args.json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<14} {:<9} {:<4} {:<8} {:<18} {:<6} {:<22} {:<8} LICENSE",
                "ID", "VERSION", "ABI", "BACKEND", "FORMATS", "ARCHS", "MODALITIES", "STATUS"
            );
            for s in &rows {
                println!(
                    "{:<14} {:<9} {:<4} {:<8} {:<18} {:<6} {:<22} {:<8} {}",
                    s.id,
                    s.version.as_deref().unwrap_or("-"),
                    s.abi_version.as_deref().unwrap_or("-"),
                    s.gpu_backend.as_deref().unwrap_or("-"),
                    s.formats.join(","),
                    s.architectures.len(),
                    s.modalities.join(","),
                    s.status,
                    s.license.as_deref().unwrap_or("-"),
                );
                if let Some(reason) = &s.reason {
                    println!("    refused: {reason}");
                }
            }
            if rows.is_empty() {
                println!("(no plugins under {})", reg.plugins_dir.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Engines(EnginesCommand::Bench {
            model,
            threads,
            args,
        }) => engines_bench(&model, threads, &args),
        Command::Engines(EnginesCommand::Info { id, args }) => {
            let reg = registry(&args);
            let rec = reg.get(&id).with_context(|| {
                format!(
                    "no plugin with id {id:?} under {}",
                    reg.plugins_dir.display()
                )
            })?;
            let s = rec.summary();
            if args.json {
                println!("{}", serde_json::to_string_pretty(&s)?);
                return Ok(ExitCode::SUCCESS);
            }
            println!("ID:            {}", s.id);
            println!("Version:       {}", s.version.as_deref().unwrap_or("-"));
            println!("ABI:           {}", s.abi_version.as_deref().unwrap_or("-"));
            println!("Backend:       {}", s.gpu_backend.as_deref().unwrap_or("-"));
            println!("Formats:       {}", s.formats.join(", "));
            println!("Modalities:    {}", s.modalities.join(", "));
            println!("License:       {}", s.license.as_deref().unwrap_or("-"));
            println!("Manifest:      {}", s.manifest);
            match &rec.state {
                PluginState::Loaded(p) => {
                    println!("Status:        loaded");
                    if let Some(d) = &p.info().description {
                        println!("Description:   {d}");
                    }
                    println!(
                        "Build:         {}",
                        s.build_info.as_deref().unwrap_or("(not reported)")
                    );
                }
                PluginState::Refused { reason, .. } => println!("Status:        refused: {reason}"),
            }
            println!("Architectures: ({})", s.architectures.len());
            for chunk in s.architectures.chunks(8) {
                println!("  {}", chunk.join(", "));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent_and_carries_the_edge_flags() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "gantry-node",
            "serve",
            "--model",
            "m.gguf",
            "--max-connections",
            "7",
            "--header-read-timeout-seconds",
            "2",
            "--idle-timeout-seconds",
            "3",
            "--max-body-bytes",
            "1000",
        ])
        .expect("parse");
        let Command::Serve(args) = cli.command else {
            panic!("serve")
        };
        assert_eq!(
            args.edge,
            gantry_edge::EdgeArgs {
                max_connections: 7,
                header_read_timeout_seconds: 2,
                idle_timeout_seconds: 3,
                body_read_timeout_seconds: 60,
                max_body_bytes: 1000,
            }
        );
    }
}
