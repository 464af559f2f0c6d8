//! The native engine against Hugging Face transformers, the independent reference (load and
//! forward pass, through the node's engine host as `gantry-node` runs the plugin).
//!
//! `testkit/python/hf_reference.py` (run by `scripts/setup.sh`, which exports
//! `GANTRY_HF_REFERENCE`) writes tiny random checkpoints of every architecture the engine runs
//! with transformers' own `from_config` and `save_pretrained`, in float32 and bfloat16, and
//! records transformers' log-probabilities over the whole vocabulary at every prompt position,
//! its greedy `generate` continuation (32 tokens), and the log-probabilities at each generated
//! position. Here the engine loads each checkpoint and, comparing at every position the
//! log-probabilities of the engine's 20 most likely tokens (the ABI's `top_logprobs` limit;
//! log-probabilities, so the normalisation over the whole vocabulary is compared too):
//! - evaluates each prompt in one step that samples after every token (every position's
//!   distribution), then decodes the reference's continuation one token per step (its KV
//!   cache, as in serving), comparing every distribution with transformers';
//! - does so for each prompt alone and for all prompts in one batch that later prompts join
//!   mid-decode (the batched step, the mixture-of-experts dispatch grouping tokens of several
//!   sequences), which must agree;
//! - on float32 checkpoints, picks transformers' greedy token at every step (the same 32-token
//!   continuation); on bfloat16 ones the agreement is counted and printed.
//!
//! The largest differences are printed per checkpoint (`cargo test -- --nocapture`). The
//! harness (`reference/harness.rs`) is shared with `reference_llama_cpp.rs`, which runs the
//! llama.cpp plugin on the same checkpoints.

use serde_json::Value;

mod common;
use common::*;
#[path = "reference/harness.rs"]
mod harness;
use harness::*;

/// Every architecture the reference covers (`hf_families.py`'s `ARCHS` and, written by
/// transformers 5, `ARCHS_V5`), by directory stem.
const ARCHS: [&str; 14] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "qwen3-moe",
    "mixtral",
    "qwen2-moe",
    "bamba",
    "granite-hybrid",
    "granite-hybrid-dense",
    "nemotron-h",
    "nemotron-h-moe",
    "gpt-oss",
];

/// Largest |engine − transformers| log-probability accepted, by checkpoint dtype. Both sides
/// compute in f32, and for bfloat16 weights the reference matches the engine's products (on a
/// CPU with the bf16 kernel it rounds each linear layer's input to bf16 as the kernel does).
/// float32: what is left is summation order (measured: under 1e-5). bfloat16: rounding
/// activations to 8 bits of mantissa makes every last-bit difference in a sum a possible
/// 2^-8 step in the next product's input; transformers itself moves position 0's
/// log-probabilities by up to 2e-2 when only the prompt's length changes (its CPU products take
/// another path), so the bound is that of bf16 arithmetic (measured: under 4e-2), and greedy
/// decoding is compared on float32 only.
fn tolerance(dtype: &str) -> f32 {
    if dtype == "float32" { 1e-3 } else { 6e-2 }
}

#[test]
fn every_architecture_matches_transformers_alone_and_in_a_batch() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let bf16_kernel = gantry_engine_native::cpu::matmul::has_bf16_kernel();
    println!(
        "bf16 weights: {}",
        if bf16_kernel {
            "the bf16 kernel (reference: bf16-rounded activations)"
        } else {
            "converted to f32 (reference: f32 activations)"
        }
    );
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for arch in ARCHS {
        for dtype in ["float32", "bfloat16"] {
            let name = format!("{arch}-{dtype}");
            let dir = root.join(&name);
            assert!(
                dir.join("reference.json").is_file(),
                "{} has no reference.json: run scripts/setup.sh",
                dir.display()
            );
            let r = read_reference(&dir, bf16_kernel);
            // A recurrent model verifies no drafts: its prompts go in one token per step alone
            // (every position compared) and whole in the batch (its chunked scan).
            let (feed_alone, feed_batched) = if RECURRENT.contains(&arch) {
                (Feed::OneByOne, Feed::Whole)
            } else {
                (Feed::Verify, Feed::Verify)
            };
            let plugin = plugin("native", 4, 128);
            let (shared, mut exec) = plugin
                .load_model(&st_desc(&name, &dir))
                .unwrap_or_else(|e| panic!("{name}: load: {e}"));
            assert_eq!(shared.info().architecture, r.class, "{name}");
            let n = r.prompts.len();
            let alone: Vec<Run> = (0..n)
                .map(|i| run_alone(&mut exec, &r, i, feed_alone))
                .collect();
            // All prompts in one batch, the later ones joining while the first decodes.
            let join_at: Vec<usize> = (0..n).map(|i| i * 3).collect();
            let together = run(&mut exec, &r.prompts, &r.greedy, &join_at, feed_batched);
            let tol = tolerance(dtype);
            let (mut worst_prompt, mut worst_decode, mut batch_gap) = (0.0f32, 0.0f32, 0.0f32);
            let mut picked_same = 0;
            for i in 0..n {
                for (mode, got, feed) in [
                    ("alone", &alone[i], feed_alone),
                    ("batched", &together[i], feed_batched),
                ] {
                    let p = max_diff(&got.prompt, &feed.expected(&r.prompt_logprobs[i]));
                    let d = max_diff(&got.decode, &r.greedy_logprobs[i]);
                    worst_prompt = worst_prompt.max(p);
                    worst_decode = worst_decode.max(d);
                    if p > tol || d > tol {
                        failures.push(format!(
                            "{name} prompt {i} {mode}: max |Δ logprob| prompt {p:.2e}, decode {d:.2e} (bound {tol:.0e})"
                        ));
                    }
                    if dtype == "float32" && got.picked != r.greedy[i] {
                        failures.push(format!(
                            "{name} prompt {i} {mode}: greedy {:?}, transformers {:?}",
                            got.picked, r.greedy[i]
                        ));
                    }
                }
                batch_gap = batch_gap
                    .max(run_gap(
                        &feed_batched.expected(&alone[i].prompt),
                        &together[i].prompt,
                    ))
                    .max(run_gap(&alone[i].decode, &together[i].decode));
                picked_same += alone[i]
                    .picked
                    .iter()
                    .zip(&r.greedy[i])
                    .filter(|(a, b)| a == b)
                    .count();
            }
            if batch_gap > tol / 10.0 {
                failures.push(format!(
                    "{name}: batched and alone differ by {batch_gap:.2e} (bound {:.0e})",
                    tol / 10.0
                ));
            }
            report.push(format!(
                "{name:<20} {:<22} prompt {worst_prompt:.2e}  decode {worst_decode:.2e}  batch vs alone {batch_gap:.2e}  greedy {picked_same}/{}",
                r.class,
                n * r.greedy[0].len()
            ));
        }
    }
    println!("max |engine - transformers| log-probability, per checkpoint:");
    for line in &report {
        println!("  {line}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Embedding models (`BertModel`): the engine's pooled, normalised vector of each prompt
/// against transformers' `last_hidden_state`, mean-pooled and normalised as the checkpoint's
/// sentence-transformers `modules.json` declares.
#[test]
fn every_encoder_embeds_as_transformers_does() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let bf16_kernel = gantry_engine_native::cpu::matmul::has_bf16_kernel();
    for dtype in ["float32", "bfloat16"] {
        let name = format!("bert-{dtype}");
        let dir = root.join(&name);
        let path = dir.join("reference.json");
        let top: Value = serde_json::from_slice(
            &std::fs::read(&path)
                .unwrap_or_else(|e| panic!("{}: {e}: run scripts/setup.sh", path.display())),
        )
        .expect("reference.json");
        let v = match &top["bf16_activations"] {
            Value::Null => &top,
            r if bf16_kernel => r,
            _ => &top,
        };
        let plugin = plugin("native", 1, 64);
        let (shared, mut exec) = plugin
            .load_model(&st_desc(&name, &dir))
            .unwrap_or_else(|e| panic!("{name}: load: {e}"));
        let info = shared.info();
        assert!(
            info.supports_embedding() && !info.supports_completion(),
            "{name}: {info:?}"
        );
        assert_eq!(info.embedding_dims, 64, "{name}");
        let worst = embedding_gap(&mut exec, &top["prompts"], &v["embeddings"], &name);
        println!("{name}: max |engine - transformers| per component {worst:.2e}");
        let bound = if dtype == "float32" { 1e-5 } else { 1e-3 };
        assert!(worst < bound, "{name}: {worst:.2e} (bound {bound:.0e})");
        // Decoder calls are refused with the reason.
        let e = exec.seq_open().expect_err("an encoder has no sequences");
        assert!(e.message.contains("embedding model"), "{}", e.message);
    }
}

/// FP8 weights (`quant_method: fp8`, `float8_e4m3fn` in 32x32 blocks with `weight_scale_inv`):
/// the engine dequantizes them at load and then agrees with transformers run on the same
/// dequantized weights as closely as a bf16 checkpoint does; and it stays near the bf16
/// original the checkpoint was quantized from (what FP8's three mantissa bits cost a model
/// this small: measured up to 0.6 on the top-20 log-probabilities, bound 1.0).
#[test]
fn an_fp8_checkpoint_runs_as_its_dequantized_weights() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let bf16_kernel = gantry_engine_native::cpu::matmul::has_bf16_kernel();
    let dir = root.join("qwen3-fp8");
    let r = read_reference(&dir, bf16_kernel);
    let plugin = plugin("native", 4, 128);
    let (shared, mut exec) = plugin
        .load_model(&st_desc("qwen3-fp8", &dir))
        .unwrap_or_else(|e| panic!("qwen3-fp8: load: {e}"));
    assert_eq!(shared.info().architecture, r.class);
    let original = read_reference(&root.join("qwen3-bfloat16"), false);
    let (mut exact, mut near) = (0.0f32, 0.0f32);
    for i in 0..r.prompts.len() {
        let got = run_alone(&mut exec, &r, i, Feed::Verify);
        exact = exact
            .max(max_diff(&got.prompt, &r.prompt_logprobs[i]))
            .max(max_diff(&got.decode, &r.greedy_logprobs[i]));
        near = near.max(max_diff(&got.prompt, &original.prompt_logprobs[i]));
    }
    println!(
        "qwen3-fp8: max |engine - transformers on the dequantized weights| {exact:.2e}; vs the bf16 original {near:.2e}"
    );
    assert!(exact < tolerance("bfloat16"), "{exact:.2e}");
    assert!(near < 1.0, "{near:.2e}");
}

/// gpt-oss as released: the experts in MXFP4 (`*_blocks`, `*_scales`, `quant_method: mxfp4`),
/// everything else bf16. The engine dequantizes the blocks at load (exactly: every MXFP4 value
/// is a bf16 value) and agrees with transformers run on its own dequantization of the same
/// file as closely as a bf16 checkpoint does.
#[test]
fn an_mxfp4_gpt_oss_checkpoint_runs_as_transformers_dequantizes_it() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let bf16_kernel = gantry_engine_native::cpu::matmul::has_bf16_kernel();
    let dir = root.join("gpt-oss-mxfp4");
    let r = read_reference(&dir, bf16_kernel);
    let plugin = plugin("native", 4, 128);
    let (shared, mut exec) = plugin
        .load_model(&st_desc("gpt-oss-mxfp4", &dir))
        .unwrap_or_else(|e| panic!("gpt-oss-mxfp4: load: {e}"));
    assert_eq!(shared.info().architecture, r.class);
    let mut worst = 0.0f32;
    for i in 0..r.prompts.len() {
        let got = run_alone(&mut exec, &r, i, Feed::Verify);
        worst = worst
            .max(max_diff(&got.prompt, &r.prompt_logprobs[i]))
            .max(max_diff(&got.decode, &r.greedy_logprobs[i]));
    }
    println!("gpt-oss-mxfp4: max |engine - transformers| {worst:.2e}");
    assert!(worst < tolerance("bfloat16"), "{worst:.2e}");
}
