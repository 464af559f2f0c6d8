//! Test support CLI: `gantry-testkit tiny-gguf --out PATH ...` writes a tiny GGUF model for
//! scripts and Python tests; `gantry-testkit tiny-hf --family F --out DIR` a tiny safetensors one; `gantry-testkit metadata PATH` prints a GGUF file's metadata as JSON;
//! `gantry-testkit k8s-check < manifests.yaml` checks rendered manifests (chart tests).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use gantry_testkit::{TinyModelSpec, read_gguf_metadata, write_tiny_gguf};

#[derive(Parser)]
#[command(name = "gantry-testkit", about = "Gantry test support tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a tiny random-weight llama GGUF model.
    TinyGguf {
        /// Where to write the file.
        #[arg(long)]
        out: PathBuf,
        /// Weight RNG seed; the same seed gives the same bytes.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write an embedding model (llama.pooling_type = mean).
        #[arg(long)]
        embedding: bool,
        /// Write this as general.architecture instead of "llama" (weights stay llama-shaped).
        #[arg(long)]
        arch: Option<String>,
        /// Omit tokenizer.chat_template.
        #[arg(long)]
        no_template: bool,
        /// llama.context_length.
        #[arg(long)]
        context_length: Option<u32>,
        /// general.name.
        #[arg(long)]
        name: Option<String>,
    },
    /// Write a tiny random-weight Hugging Face model directory (safetensors) of one family:
    /// llama, mistral, qwen2, qwen3 or gemma3.
    TinyHf {
        /// Directory to write (created if needed).
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        family: String,
        /// Weight RNG seed; the same seed gives the same bytes.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Print the KV metadata of a GGUF file as one JSON object.
    Metadata { path: PathBuf },
    /// Check a multi-document YAML stream on stdin against the k8s-openapi types: one JSON
    /// verdict per object on stdout; exit 1 when any object is invalid.
    K8sCheck,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::TinyGguf {
            out,
            seed,
            embedding,
            arch,
            no_template,
            context_length,
            name,
        } => {
            let mut spec = TinyModelSpec {
                seed,
                embedding,
                architecture_name_override: arch,
                ..TinyModelSpec::default()
            };
            if no_template {
                spec.chat_template = None;
            }
            if let Some(n) = context_length {
                spec.context_length = n;
            }
            if let Some(name) = name {
                spec.name = name;
            }
            write_tiny_gguf(&out, &spec)?;
        }
        Command::TinyHf { out, family, seed } => {
            let f = gantry_testkit::hf::HfFamily::parse(&family)
                .ok_or_else(|| anyhow::anyhow!("unknown family {family}"))?;
            gantry_testkit::hf::write_tiny_hf(&out, f, seed)?;
        }
        Command::Metadata { path } => {
            let metadata = read_gguf_metadata(&path)?;
            println!("{}", serde_json::to_string_pretty(&metadata)?);
        }
        Command::K8sCheck => {
            let mut yaml = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut yaml)?;
            let verdicts = gantry_testkit::k8s_check::check_stream(&yaml)?;
            for v in &verdicts {
                println!("{}", serde_json::to_string(v)?);
            }
            if verdicts.iter().any(|v| v.result == "invalid") {
                std::process::exit(1);
            }
        }
    }
    Ok(())
}
