//! Command line (outside the request path): `gantry-node engines list|info`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use gantry_engine_abi::{Backend, EngineConfig};

use crate::engine_host::{EngineRegistry, PluginState, default_plugins_dir};

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
    /// Inspect the engine plugins this node can load.
    #[command(subcommand)]
    Engines(EnginesCommand),
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

fn registry(args: &EngineArgs) -> EngineRegistry {
    let dir = args.plugins_dir.clone().unwrap_or_else(default_plugins_dir);
    let config = EngineConfig {
        backend: args.backend,
        ..EngineConfig::default()
    };
    EngineRegistry::discover(&dir, &config)
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
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
