//! Native engine through the node's engine host (the way `gantry-node` runs it): the real
//! Gemma 3 270M against the llama.cpp plugin on the same bf16 values, batch invariance, KV
//! budgets, and refusals of broken model directories. (Prefix reuse has its own binary,
//! `prefix_reuse.rs`: it captures the plugin's log.)
//!
//! The Gemma tests need `GANTRY_GEMMA_ST_DIR` and `GANTRY_GEMMA_BF16_GGUF` (scripts/setup.sh
//! makes both, scripts/test.sh exports them); they fail, never pass silently, without them.

use std::path::Path;
use std::sync::Arc;

use gantry_engine_abi::{Format, Sampling, Status, StepEntry};
use gantry_node::engine_host::{ModelExec, ModelShared};
use gantry_testkit::hf::{HfFamily, write_tiny_hf};

mod common;
use common::*;

const PROMPTS: [&str; 5] = [
    "Question: What is the capital of France?\nAnswer:",
    "The quick brown fox jumps over the lazy dog. Then the fox",
    "Write a short poem about the sea.\n",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
];

fn gemma() -> (Arc<ModelShared>, ModelExec, Arc<ModelShared>, ModelExec) {
    let st = env_path("GANTRY_GEMMA_ST_DIR");
    let gguf = env_path("GANTRY_GEMMA_BF16_GGUF");
    let native = plugin("native", 8, 512);
    let llama = plugin("llama_cpp", 8, 512);
    let (ns, ne) = native
        .load_model(&st_desc("gemma-st", &st))
        .expect("native load");
    let (ls, le) = llama
        .load_model(&desc(
            "gemma-gguf",
            gguf.parent().expect("dir"),
            &gguf,
            Format::Gguf,
        ))
        .expect("llama.cpp load");
    (ns, ne, ls, le)
}

#[test]
fn gemma_tokenizes_like_llama_cpp_and_agrees_with_it_under_teacher_forcing() {
    let (ns, mut ne, ls, mut le) = gemma();
    assert_eq!(ns.info().architecture, "Gemma3ForCausalLM");
    assert_eq!(ns.info().vocab_size, ls.info().vocab_size);
    let greedy = Sampling::greedy();
    let (mut agree, mut total) = (0usize, 0usize);
    for p in PROMPTS {
        let ids = ns.tokenize(p, true, false).expect("native tokenize");
        let peer = ls.tokenize(p, true, false).expect("llama.cpp tokenize");
        assert_eq!(
            ids, peer,
            "tokenizer.json and the GGUF vocabulary disagree on {p:?}"
        );
        // Teacher forcing: feed the prompt one token at a time; compare the greedy next token
        // after every prefix.
        let (a, b) = (ne.seq_open().expect("seq"), le.seq_open().expect("seq"));
        for t in &ids {
            let one = [*t];
            let entry = |seq| StepEntry {
                seq,
                tokens: &one,
                sample: Some(&greedy),
                fresh: false,
                allowed: None,
                sample_all: false,
            };
            let x = ne
                .step(&[entry(a)])
                .expect("native step")
                .remove(0)
                .expect("tok")
                .token;
            let y = le
                .step(&[entry(b)])
                .expect("llama step")
                .remove(0)
                .expect("tok")
                .token;
            total += 1;
            agree += usize::from(x == y);
        }
        ne.seq_release(a);
        le.seq_release(b);
    }
    let rate = agree as f64 / total as f64;
    eprintln!(
        "greedy agreement with llama.cpp on the same bf16 weights: {agree}/{total} = {:.4}",
        rate
    );
    assert!(rate >= 0.99, "agreement {agree}/{total} = {rate:.4} < 0.99");
}

#[test]
fn gemma_answers_paris() {
    let st = env_path("GANTRY_GEMMA_ST_DIR");
    let native = plugin("native", 2, 256);
    let (s, mut e) = native.load_model(&st_desc("gemma-st", &st)).expect("load");
    let p = s.tokenize(PROMPTS[0], true, false).expect("tokenize");
    let out = generate(&mut e, &[p], 4, &[]).remove(0);
    let text = String::from_utf8_lossy(&s.detokenize(&out, false).expect("detok")).into_owned();
    assert!(text.starts_with(" Paris"), "greedy continuation {text:?}");
}

#[test]
fn gemma_batch_invariance_eight_together_equal_eight_alone_and_joining_changes_nothing() {
    let st = env_path("GANTRY_GEMMA_ST_DIR");
    let native = plugin("native", 8, 256);
    let (s, mut e) = native.load_model(&st_desc("gemma-st", &st)).expect("load");
    let mut prompts: Vec<Vec<i32>> = PROMPTS
        .iter()
        .map(|p| s.tokenize(p, true, false).expect("tokenize"))
        .collect();
    prompts.push(s.tokenize("Once upon a time", true, false).expect("t"));
    prompts.push(s.tokenize("The best way to learn", true, false).expect("t"));
    prompts.push(s.tokenize("1, 2, 3,", true, false).expect("t"));
    let n = 12;
    let together = generate(&mut e, &prompts, n, &[]);
    // Sequences join at different steps (and so leave at different steps).
    let staggered = generate(&mut e, &prompts, n, &[0, 3, 1, 7, 2, 5, 0, 9]);
    for (i, p) in prompts.iter().enumerate() {
        let alone = generate(&mut e, std::slice::from_ref(p), n, &[]).remove(0);
        assert_eq!(together[i], alone, "prompt {i}: batched and alone differ");
        assert_eq!(
            staggered[i], alone,
            "prompt {i}: joining and leaving changed the output"
        );
    }
}

#[test]
fn broken_directories_are_refused_with_the_reason() {
    let native = plugin("native", 2, 128);
    let refusal = |dir: &Path| match native.load_model(&st_desc("broken", dir)) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    };
    // A truncated shard.
    let d = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(d.path(), HfFamily::Mistral, 0).expect("write");
    let shard = d.path().join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).expect("meta").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .and_then(|f| f.set_len(len / 2))
        .expect("truncate");
    let e = refusal(d.path());
    assert_eq!(e.status, Status::ModelCorrupt, "{e}");
    assert!(
        e.message.contains("model-00002-of-00002.safetensors"),
        "{e}"
    );

    // A tensor of the wrong shape: the config says more layers' worth of width.
    let d = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(d.path(), HfFamily::Llama, 0).expect("write");
    let cfg_path = d.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).expect("read")).expect("json");
    cfg["intermediate_size"] = serde_json::json!(96);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let e = refusal(d.path());
    assert_eq!(e.status, Status::ModelCorrupt, "{e}");
    assert!(
        e.message.contains("model.layers.0.mlp.gate_proj.weight"),
        "{e}"
    );

    // An architecture the engine does not run.
    cfg["intermediate_size"] = serde_json::json!(128);
    cfg["architectures"] = serde_json::json!(["MambaForCausalLM"]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let e = refusal(d.path());
    assert_eq!(e.status, Status::Unsupported, "{e}");
    assert!(e.message.contains("MambaForCausalLM"), "{e}");

    // An unknown RoPE scaling type.
    cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    cfg["rope_scaling"] = serde_json::json!({"rope_type": "longrope", "factor": 4.0});
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let e = refusal(d.path());
    assert_eq!(e.status, Status::Unsupported, "{e}");
    assert!(e.message.contains("longrope"), "{e}");
}

#[test]
fn every_tiny_family_loads_and_generates_within_its_kv_budget() {
    for f in HfFamily::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        write_tiny_hf(dir.path(), f, 1).expect("write");
        let native = plugin("native", 4, 64);
        let (s, mut e) = native
            .load_model(&st_desc(f.name(), dir.path()))
            .expect("load");
        let info = s.info();
        assert_eq!(info.kv_capacity_tokens, 64 * 4, "{f:?}");
        assert_eq!(info.context_length, 64);
        let p = s
            .tokenize("Hello world, the capital", true, false)
            .expect("tok");
        let out = generate(&mut e, &[p.clone(), p], 8, &[]);
        assert_eq!(out[0], out[1], "{f:?}: two identical prompts in one batch");
        // Four sequences of the whole context fit; a fifth sequence is refused.
        let seqs: Vec<u64> = (0..4).map(|_| e.seq_open().expect("seq")).collect();
        assert!(
            e.seq_open().is_err(),
            "{f:?}: a fifth sequence was accepted"
        );
        for s in seqs {
            e.seq_release(s);
        }
    }
}
