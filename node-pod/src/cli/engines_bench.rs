//! `gantry-node engines bench` (command line, outside the request path): the engine choice's
//! benchmark of every plugin that supports a model, run by hand.

use std::path::Path;
use std::process::ExitCode;

use gantry_engine_abi::{Backend, EngineConfig, Format, ModelDescriptor};

use super::EngineArgs;
use crate::engine_host::{EngineRegistry, default_plugins_dir};

/// `gantry-node engines bench MODEL`: node/engine_choice.rs's benchmark of every plugin that
/// supports the model, in engine id order, and the rule's pick.
pub(super) fn engines_bench(
    model: &Path,
    threads: u32,
    args: &EngineArgs,
) -> anyhow::Result<ExitCode> {
    use crate::node::engine_choice as ec;
    let (format, primary) = if model.is_dir() {
        let single = model.join("model.safetensors");
        let primary = if single.is_file() {
            single
        } else {
            model.join("model.safetensors.index.json")
        };
        (Format::Safetensors, primary)
    } else if model.extension().is_some_and(|e| e == "gguf") {
        (Format::Gguf, model.to_path_buf())
    } else {
        (Format::Safetensors, model.to_path_buf())
    };
    let arch = crate::node::read_architecture(&primary, format).map_err(anyhow::Error::msg)?;
    let dir = args.plugins_dir.clone().unwrap_or_else(default_plugins_dir);
    let config = EngineConfig {
        backend: args.backend,
        n_threads: threads,
        max_batch_size: 1,
        ..EngineConfig::default()
    };
    let reg = EngineRegistry::discover(&dir, &config);
    let ids = reg.alternatives(format, &arch, &[]);
    anyhow::ensure!(
        !ids.is_empty(),
        "no plugin under {} supports {} {arch}",
        dir.display(),
        format.as_str()
    );
    let probe = ec::Probe {
        // On a CUDA node the device check is the node's (it reads the devices); here the
        // machine's RAM bounds a CPU candidate and a GPU candidate is not bounded.
        budget_bytes: if args.backend == Backend::Cpu {
            ec::machine_ram_bytes().unwrap_or(0)
        } else {
            0
        },
        devices: None,
    };
    let desc = ModelDescriptor {
        max_sequences: 1,
        ..ModelDescriptor::new("bench", primary.clone(), format)
    };
    let mut results: Vec<_> = ids
        .iter()
        .filter_map(|id| reg.plugin(id).map(|p| ec::bench(id, p, &desc, &probe)))
        .collect();
    let winner = ec::decide(&mut results);
    if args.json {
        let out = serde_json::json!({
            "model": model.display().to_string(),
            "architecture": arch,
            "rule": ec::RULE,
            "chosen": winner.map(|w| results[w].plugin.clone()),
            "candidates": results,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "{:<14} {:<9} {:<9} {:>10} {:>10} {:>12}  NOTE",
            "ENGINE", "VERSION", "OUTCOME", "TOK/S", "TTFT MS", "PEAK"
        );
        for r in &results {
            println!(
                "{:<14} {:<9} {:<9} {:>10.1} {:>10.1} {:>12}  {}",
                r.plugin,
                r.version,
                r.outcome,
                r.tokens_per_second.unwrap_or(0.0),
                r.ttft_ms.unwrap_or(0.0),
                r.peak_bytes
                    .map(crate::memory::human)
                    .unwrap_or_else(|| "-".into()),
                r.message.as_deref().unwrap_or("")
            );
        }
        println!("rule: {}", ec::RULE);
    }
    Ok(if winner.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
