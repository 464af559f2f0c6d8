//! llama.cpp plugin tests through the engine host: real GGUF inference, batching, KV release,
//! determinism, embeddings, and the Gemma 3 270M model.

mod common;

use std::sync::Arc;

use common::*;
use gantry_engine_abi::{Sampling, Status, StepEntry};
use gantry_node::engine_host::{ModelExec, ModelShared};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};

fn prompts(shared: &Arc<ModelShared>) -> Vec<Vec<i32>> {
    [
        "Hello world",
        "The capital of France is",
        "Question: what is the answer?",
        "a b c d e f",
        "Paris is a city in",
        "One two three four five six",
        "The quick brown fox",
        "x",
    ]
    .iter()
    .map(|p| shared.tokenize(p, true, false).expect("tokenize"))
    .collect()
}

#[test]
fn eight_sequences_stepped_together_match_each_sequence_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(8, 256);
    let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let prompts = prompts(&shared);
    let together = generate_batched(&mut exec, &prompts, 24);
    for (i, p) in prompts.iter().enumerate() {
        let alone = generate_batched(&mut exec, std::slice::from_ref(p), 24);
        assert_eq!(
            together[i], alone[0],
            "prompt {i}: batched and alone greedy tokens differ"
        );
    }
    // The prompts are different, and so are their continuations.
    assert!(together.iter().any(|t| t != &together[0]));
}

#[test]
fn generation_on_the_tiny_model_is_deterministic_across_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 256);
    let run = || {
        let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
        let p = shared
            .tokenize("The capital of France is", true, false)
            .expect("tok");
        let toks = generate_batched(&mut exec, &[p], 32).remove(0);
        String::from_utf8_lossy(&shared.detokenize(&toks, false).expect("detok")).into_owned()
    };
    let first = run();
    assert_eq!(first, run());
    assert!(!first.trim().is_empty());
    // The writer is deterministic too: a second file from the same spec is byte-identical.
    let again = dir.path().join("again.gguf");
    write_tiny_gguf(&again, &TinyModelSpec::default()).expect("write");
    assert!(
        std::fs::read(&path).expect("read") == std::fs::read(&again).expect("read"),
        "same seed, different bytes"
    );
}

#[test]
fn seeded_sampling_repeats_for_the_same_seed_and_honours_logprobs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 256);
    let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let p = shared.tokenize("Hello", true, false).expect("tok");
    let sample = |exec: &mut ModelExec, seed: u64| {
        let s = Sampling {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.95,
            seed,
            top_logprobs: 3,
            want_logprob: true,
            ..Sampling::greedy()
        };
        let seq = exec.seq_open().expect("seq");
        let mut feed = p.clone();
        let mut out = Vec::new();
        for _ in 0..16 {
            let r = exec
                .step(&[StepEntry {
                    seq,
                    tokens: &feed,
                    sample: Some(&s),
                    fresh: false,
                    allowed: None,
                    sample_all: false,
                }])
                .expect("step")
                .remove(0)
                .expect("tok");
            assert!(r.logprob <= 0.0 && r.logprob.is_finite());
            assert_eq!(r.top.len(), 3);
            assert!(r.top[0].1 >= r.top[1].1 && r.top[1].1 >= r.top[2].1);
            out.push(r.token);
            feed = vec![r.token];
        }
        exec.seq_release(seq);
        out
    };
    assert_eq!(sample(&mut exec, 7), sample(&mut exec, 7));
    assert_ne!(sample(&mut exec, 7), sample(&mut exec, 8));
}

#[test]
fn releasing_a_sequence_gives_its_kv_capacity_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 256);
    let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let cap = shared.info().kv_capacity_tokens as usize;
    assert!(cap >= 512, "capacity {cap}");
    let chunk = vec![300i32; 256];
    let fill =
        |exec: &mut ModelExec, seq: u64, n: usize| -> Result<(), gantry_engine_abi::EngineError> {
            for _ in 0..n / chunk.len() {
                exec.step(&[StepEntry {
                    seq,
                    tokens: &chunk,
                    sample: None,
                    fresh: false,
                    allowed: None,
                    sample_all: false,
                }])?;
            }
            Ok(())
        };
    // Sequence A takes every cell.
    let a = exec.seq_open().expect("seq a");
    fill(&mut exec, a, cap).expect("A fits exactly");
    let b = exec.seq_open().expect("seq b");
    let err = fill(&mut exec, b, 256).expect_err("the KV cache is full");
    assert!(
        matches!(err.status, Status::OomRam | Status::OomVram),
        "{err}"
    );
    exec.seq_release(b);
    // Releasing A frees its cells at once: B's prefill now fits.
    exec.seq_release(a);
    let b = exec.seq_open().expect("seq b again");
    fill(&mut exec, b, cap).expect("after release the full capacity is back");
    exec.seq_release(b);
}

#[test]
fn opening_more_sequences_than_slots_is_refused_until_one_is_released() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 128);
    let (_shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let a = exec.seq_open().expect("a");
    let _b = exec.seq_open().expect("b");
    let err = exec.seq_open().expect_err("third");
    assert!(err.message.contains("sequence slots"), "{err}");
    exec.seq_release(a);
    exec.seq_open().expect("a slot is free again");
}

#[test]
fn model_info_reports_the_gguf_metadata() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(4, 256);
    let (shared, _exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let info = shared.info();
    assert_eq!(info.architecture, "llama");
    assert_eq!(info.context_length, 256);
    assert_eq!(info.max_sequences, 4);
    assert_eq!(info.bos_token, Some(gantry_testkit::BOS_ID as i32));
    assert_eq!(info.eos_token, Some(gantry_testkit::EOS_ID as i32));
    assert!(
        info.eog_tokens
            .contains(&(gantry_testkit::IM_END_ID as i32))
    );
    assert!(
        info.chat_template
            .as_deref()
            .is_some_and(|t| t.contains("im_start"))
    );
    assert!(info.supports_completion() && !info.supports_embedding());
    assert!(info.bytes_used > 0);
    // Tokenizer round trip through the plugin.
    let toks = shared.tokenize("Hello world", false, false).expect("tok");
    assert_eq!(
        String::from_utf8(shared.detokenize(&toks, false).expect("detok")).expect("utf8"),
        " Hello world"
    );
}

#[test]
fn an_embedding_model_embeds_and_a_completion_model_refuses_to() {
    let dir = tempfile::tempdir().expect("tempdir");
    let emb = tiny(
        dir.path(),
        &TinyModelSpec {
            embedding: true,
            name: "emb".into(),
            ..TinyModelSpec::default()
        },
    );
    let plugin = llama_plugin(2, 256);
    let (shared, mut exec) = plugin.load_model(&desc("emb", &emb)).expect("load");
    assert!(shared.info().supports_embedding());
    assert_eq!(shared.info().embedding_dims, 64);
    let a = exec
        .embed(&shared.tokenize("hello there", true, false).expect("tok"))
        .expect("embed");
    let b = exec
        .embed(&shared.tokenize("something else", true, false).expect("tok"))
        .expect("embed");
    assert_eq!(a.len(), 64);
    assert_ne!(a, b);
    assert_eq!(
        a,
        exec.embed(&shared.tokenize("hello there", true, false).expect("tok"))
            .expect("embed")
    );

    let text = tiny(dir.path(), &TinyModelSpec::default());
    let (ts, mut texec) = plugin.load_model(&desc("text", &text)).expect("load");
    let err = texec
        .embed(&ts.tokenize("hi", true, false).expect("tok"))
        .expect_err("not an embedding model");
    assert_eq!(err.status, Status::Unsupported);
}

#[test]
fn a_file_that_is_not_gguf_fails_to_load_with_model_corrupt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("junk.gguf");
    std::fs::write(&p, b"this is not a gguf file").expect("write");
    let err = llama_plugin(1, 128)
        .load_model(&desc("junk", &p))
        .expect_err("junk");
    assert_eq!(err.status, Status::ModelCorrupt);
}

#[test]
fn a_load_over_the_memory_limit_is_refused_before_allocating() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let cfg = gantry_engine_abi::EngineConfig {
        vram_limit_bytes: 4096,
        n_threads: 2,
        max_batch_size: 1,
        context_length: 128,
        ..Default::default()
    };
    let reg =
        gantry_node::engine_host::EngineRegistry::discover(&profile_dir().join("engines"), &cfg);
    let plugin = reg.plugin("llama_cpp").unwrap_or_else(|| {
        panic!(
            "llama_cpp refused: {:?}",
            reg.get("llama_cpp").map(|r| r.summary())
        )
    });
    let err = plugin
        .load_model(&desc("tiny", &path))
        .expect_err("too big");
    assert!(matches!(err.status, Status::OomRam | Status::OomVram));
    assert!(
        err.message.contains("limit is 4096 bytes"),
        "{}",
        err.message
    );
}

#[test]
fn gemma_3_270m_greedily_answers_paris() {
    let path = gemma_path();
    let plugin = llama_plugin(1, 512);
    let (shared, mut exec) = plugin
        .load_model(&desc("gemma", &path))
        .expect("load gemma");
    assert_eq!(shared.info().architecture, "gemma3");
    assert!(
        shared.info().chat_template.is_none(),
        "the PyPI Gemma is a base model without a template"
    );
    let prompt = shared
        .tokenize(
            "Question: What is the capital of France?\nAnswer:",
            true,
            false,
        )
        .expect("tokenize");
    let out = generate_batched(&mut exec, &[prompt], 8).remove(0);
    let text =
        String::from_utf8_lossy(&shared.detokenize(&out, false).expect("detok")).into_owned();
    assert!(text.starts_with(" Paris"), "got {text:?}");
}

#[test]
fn the_plugin_counts_its_ubatches_and_the_graphs_it_built_and_reused() {
    // ABI 1.12 `model_counters`: a steady batch reuses llama.cpp's graph from step to step; a
    // batch of another size builds one again.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(4, 256);
    let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let count = |exec: &mut ModelExec| -> std::collections::HashMap<String, u64> {
        exec.counters().expect("counters").into_iter().collect()
    };
    let before = count(&mut exec);
    let ps = prompts(&shared);
    // Two sequences: one prefill step, then 15 steps of two tokens each.
    generate_batched(&mut exec, &ps[..2], 16);
    let two = count(&mut exec);
    let grew = |k: &str,
                a: &std::collections::HashMap<String, u64>,
                b: &std::collections::HashMap<String, u64>| {
        b.get(k).copied().unwrap_or(0) - a.get(k).copied().unwrap_or(0)
    };
    assert_eq!(grew("ubatches", &before, &two), 16, "{two:?}");
    assert_eq!(
        grew("graph_reuses", &before, &two) + grew("graph_builds", &before, &two),
        16,
        "every ubatch's graph is built or reused: {two:?}"
    );
    // The decode steps of a steady batch reuse the graph (llama.cpp rebuilds when its KV view
    // grows, at most once here: 16 tokens of 2 sequences stay within one 256-cell view).
    assert!(grew("graph_reuses", &before, &two) >= 13, "{two:?}");
    // Three sequences: a new shape, built again, then reused.
    generate_batched(&mut exec, &ps[2..5], 8);
    let three = count(&mut exec);
    assert!(
        grew("graph_builds", &two, &three) >= 2,
        "prefill and the first decode: {three:?}"
    );
    assert!(grew("graph_reuses", &two, &three) >= 5, "{three:?}");
    // Counters never go down.
    for (k, v) in &two {
        assert!(three[k] >= *v, "{k}: {v} then {}", three[k]);
    }
}
