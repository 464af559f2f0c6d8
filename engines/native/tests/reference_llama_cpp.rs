//! The llama.cpp plugin against Hugging Face transformers, the independent reference (load and
//! forward pass through the node's engine host): the float32 reference checkpoints of
//! `testkit/python/hf_reference.py`, converted to GGUF by llama.cpp's own converter in setup
//! (`testkit/python/hf_to_gguf.py`), run as `tests/reference.rs` runs the native engine
//! (`reference/harness.rs`), each prompt alone; and the plugin's manifest, which must list
//! exactly the architectures checked here.

use std::path::Path;

use serde_json::Value;

mod common;
use common::*;
#[path = "reference/harness.rs"]
mod harness;
use harness::*;

/// Every family the llama.cpp plugin is checked on, by reference directory stem, with the
/// `general.architecture` llama.cpp's converter gives it: the float32 reference checkpoints
/// converted to GGUF by llama.cpp's own converter (`testkit/python/hf_to_gguf.py`). The first
/// eight are native-engine checkpoints too (`hf_families.py`'s `LLAMA_CPP_SHARED`), and so are
/// the two Nemotron-H ones (`ARCHS_V5`, written by transformers 5); the rest only llama.cpp runs
/// (`LLAMA_CPP_ONLY`). Left out: Qwen3-MoE with a dense layer among the sparse
/// ones (llama.cpp's `qwen3moe` takes none; `qwen3-moe-sparse` instead) and Mistral (llama.cpp
/// runs `MistralForCausalLM` as `llama`, without its `sliding_window`: on this checkpoint's
/// 8-token window it is wrong past position 8, 25 of 96 greedy tokens; Mistral releases without
/// a window are unaffected), and Llama 4 (llama.cpp aborts on the converted text model:
/// `GGML_ASSERT(buf != NULL && "tensor buffer not set")`). gpt-oss is checked with YaRN's ramp
/// rounded (`gpt-oss-truncated-yarn`): llama.cpp always rounds it, and on the released
/// `truncate: false` it disagrees (`hf_families.py` says by how much). Where a family's released shapes
/// matter to llama.cpp, the checkpoint takes them (`hf_reference.py` says which and why). The
/// plugin's manifest lists exactly these architectures.
const LLAMA_CPP_FAMILIES: [(&str, &str); 51] = [
    ("llama", "llama"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("gemma3", "gemma3"),
    ("mixtral", "llama"),
    ("qwen2-moe", "qwen2moe"),
    ("granite-hybrid", "granitehybrid"),
    ("granite-hybrid-dense", "granitehybrid"),
    ("gemma2", "gemma2"),
    ("olmo2", "olmo2"),
    ("starcoder2", "starcoder2"),
    ("granite", "granite"),
    ("stablelm", "stablelm"),
    ("gpt2", "gpt2"),
    ("gpt-bigcode", "starcoder"),
    ("gpt-neox", "gptneox"),
    ("falcon", "falcon"),
    ("bloom", "bloom"),
    ("phi2", "phi2"),
    ("phi3", "phi3"),
    ("gemma", "gemma"),
    ("olmo", "olmo"),
    ("olmoe", "olmoe"),
    ("cohere", "command-r"),
    ("cohere2", "cohere2"),
    ("granitemoe", "granitemoe"),
    ("nemotron", "nemotron"),
    ("deepseek2-lite", "deepseek2"),
    ("deepseek3", "deepseek2"),
    ("exaone4", "exaone4"),
    ("smollm3", "smollm3"),
    ("gpt-oss-truncated-yarn", "gpt-oss"),
    ("ernie4.5", "ernie4_5"),
    ("ernie4.5-moe", "ernie4_5-moe"),
    ("seed-oss", "seed_oss"),
    ("apertus", "apertus"),
    ("arcee", "arcee"),
    ("dots1", "dots1"),
    ("glm4", "glm4"),
    ("glm4-moe", "glm4moe"),
    ("dbrx", "dbrx"),
    ("hunyuan-dense", "hunyuan-dense"),
    ("qwen3-moe-sparse", "qwen3moe"),
    ("mamba", "mamba"),
    ("mamba2", "mamba2"),
    ("nemotron-h", "nemotron_h"),
    ("nemotron-h-moe", "nemotron_h_moe"),
    ("jamba", "jamba"),
    ("bamba-full-rope", "granitehybrid"),
    ("falcon-h1", "falcon-h1"),
    ("lfm2", "lfm2"),
];

/// The float32 checkpoint `name` and its GGUF as setup converted it, whose architecture must be
/// `arch`: (directory, GGUF path, GGUF header).
fn converted(
    root: &Path,
    name: &str,
    arch: &str,
) -> (
    std::path::PathBuf,
    std::path::PathBuf,
    gantry_formats::gguf::GgufHeader,
) {
    let dir = root.join(format!("{name}-float32"));
    let gguf = dir.join("model-f32.gguf");
    assert!(
        gguf.is_file(),
        "{} is missing: run scripts/setup.sh",
        gguf.display()
    );
    let header = gantry_formats::gguf::read_header(&gguf).expect("a GGUF header");
    assert_eq!(header.architecture(), Some(arch), "{name}");
    (dir, gguf, header)
}

/// Recurrent state per sequence of some of them, f32, from their configs: Mamba-2 (three
/// layers of (4 - 1) × (128 + 2 × 16) convolution inputs and 16 × 128 scan values), the
/// full-RoPE Bamba (two such layers), LFM2 (two short-convolution layers of (3 - 1) × 64).
const STATE_BYTES: [(&str, u64); 3] = [
    ("mamba2", 3 * (3 * 160 + 16 * 128) * 4),
    ("bamba-full-rope", 2 * (3 * 160 + 16 * 128) * 4),
    ("lfm2", 2 * (2 * 64) * 4),
];

/// The llama.cpp plugin against the same transformers answers: every position's top-20
/// log-probabilities and the greedy continuation (95 % of its tokens at least), each prompt
/// alone; then the plugin's manifest, which must list exactly the architectures checked here.
#[test]
fn the_llama_cpp_plugin_matches_transformers_on_the_converted_checkpoints() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (name, gguf_arch) in LLAMA_CPP_FAMILIES {
        let (dir, gguf, header) = converted(&root, name, gguf_arch);
        eprintln!("llama.cpp plugin: {name} ({gguf_arch})");
        let r = read_reference(&dir, false);
        let plugin = plugin("llama_cpp", 4, 128);
        let mut exec = match plugin.load_model(&desc(
            name,
            &dir,
            &gguf,
            gantry_engine_abi::Format::Gguf,
        )) {
            Ok((shared, exec)) => {
                // Recurrent state (ABI 1.7) exactly where the family keeps one.
                let state = shared.info().recurrent_state_bytes;
                if (state > 0) != RECURRENT.contains(&name) {
                    failures.push(format!(
                        "{name}: recurrent state {state} bytes per sequence"
                    ));
                }
                if let Some(&(_, want)) = STATE_BYTES.iter().find(|(n, _)| *n == name)
                    && state != want
                {
                    failures.push(format!(
                            "{name}: recurrent state {state} bytes per sequence, llama.cpp's layout gives {want}"
                        ));
                }
                exec
            }
            Err(e) => {
                failures.push(format!("{name}: load: {e}"));
                continue;
            }
        };
        let feed = if RECURRENT.contains(&name) {
            Feed::OneByOne
        } else {
            Feed::Verify
        };
        let (mut worst, mut picked_same) = (0.0f32, 0);
        for i in 0..r.prompts.len() {
            let got = run_alone(&mut exec, &r, i, feed);
            worst = worst
                .max(max_diff(&got.prompt, &r.prompt_logprobs[i]))
                .max(max_diff(&got.decode, &r.greedy_logprobs[i]));
            picked_same += got
                .picked
                .iter()
                .zip(&r.greedy[i])
                .filter(|(a, b)| a == b)
                .count();
        }
        let total = r.prompts.len() * r.greedy[0].len();
        let bound = llama_cpp_tolerance(&header, gguf_arch);
        if worst > bound || picked_same * 100 < total * 95 {
            failures.push(format!(
                "{name}: max |Δ logprob| {worst:.2e} (bound {bound:.1e}), greedy {picked_same}/{total} (at least 95 %)"
            ));
        }
        report.push(format!(
            "{name:<16} {gguf_arch:<14} {:<30} {worst:.2e} (bound {bound:.1e})  greedy {picked_same}/{total}",
            r.class
        ));
    }
    println!("llama.cpp plugin, max |engine - transformers| log-probability:");
    for line in &report {
        println!("  {line}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    let manifest: Value = serde_json::from_str(include_str!("../../llama-cpp/manifest.json"))
        .expect("the llama.cpp manifest parses");
    let listed: std::collections::BTreeSet<&str> = manifest["architectures"]
        .as_array()
        .expect("architectures")
        .iter()
        .map(|v| v.as_str().expect("a name"))
        .collect();
    let checked: std::collections::BTreeSet<&str> = LLAMA_CPP_FAMILIES
        .iter()
        .chain([&LLAMA_CPP_ENCODER])
        .map(|(_, arch)| *arch)
        .collect();
    assert_eq!(
        listed, checked,
        "engines/llama-cpp/manifest.json must list exactly the architectures checked here"
    );
}

/// llama.cpp computes an f32 model's products in f32 but keeps its KV cache in f16, which is
/// most of the gap, and the rounding adds up layer after layer: the bound is 5e-2 for up to six
/// layers and grows with depth beyond (measured: 7.7e-4 to 4.3e-2 on three to six layers,
/// DBRX the largest; 1.7e-1 on DeepSeek-V2-Lite's 27, whose cache holds the compressed
/// latent). Greedy tokens may then part at near-ties.
fn llama_cpp_tolerance(header: &gantry_formats::gguf::GgufHeader, arch: &str) -> f32 {
    let blocks = header
        .metadata
        .get(&format!("{arch}.block_count"))
        .and_then(|v| v.as_u64())
        .expect("block_count");
    5e-2 * (blocks as f32 / 6.0).max(1.0)
}

/// The encoder the llama.cpp plugin is checked on (stem, GGUF architecture); in its manifest
/// with the decoder families.
const LLAMA_CPP_ENCODER: (&str, &str) = ("bert", "bert");

/// The tiny BertModel (`hf_families.py`'s `ENCODERS`, float32) converted by llama.cpp's
/// converter: the llama.cpp plugin's embeddings (llama.cpp pools as the GGUF says: mean, then
/// the plugin scales to unit length) against transformers' mean-pooled, normalised
/// `last_hidden_state` (measured: 9.3e-5 per component at most; llama.cpp runs BERT without a
/// KV cache, in f32).
#[test]
fn the_llama_cpp_plugin_embeds_the_converted_encoder_as_transformers_does() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let (stem, arch) = LLAMA_CPP_ENCODER;
    let (dir, gguf, _) = converted(&root, stem, arch);
    let top: Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).expect("reference"))
            .expect("reference.json");
    let plugin = plugin("llama_cpp", 1, 64);
    let (shared, mut exec) = plugin
        .load_model(&desc(stem, &dir, &gguf, gantry_engine_abi::Format::Gguf))
        .expect("load");
    let info = shared.info();
    assert!(info.supports_embedding(), "{info:?}");
    assert_eq!(info.embedding_dims, 64);
    let worst = embedding_gap(&mut exec, &top["prompts"], &top["embeddings"], stem);
    println!("bert (llama.cpp plugin): max |engine - transformers| per component {worst:.2e}");
    assert!(worst < 1e-3, "{worst:.2e} (bound 1e-3)");
}
