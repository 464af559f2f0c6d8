//! LoRA adapters in the native engine (ABI 1.6, the model level below the scheduler), on the
//! real SmolLM2-135M-Instruct (f32) and the PEFT test adapters made for it
//! (testkit/python/smollm2_lora.py): an adapter applied per sequence gives the merged model's
//! output, sequences under different adapters and the base share steps without changing each
//! other's tokens, adapters that do not fit are refused naming the tensor, the prefix cache
//! never hands one adapter's K/V to another, and a fork keeps its source's adapter.
//!
//! Needs `GANTRY_SMOLLM2_ST_DIR`; prints "SKIPPED: ..." and passes only when the adapter
//! directory (`GANTRY_SMOLLM2_ADAPTERS`) is missing.

mod common;

use std::path::{Path, PathBuf};

use common::{env_path, st_desc};
use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    AdapterDescriptor, Backend, EngineConfig, EngineError, Format, SampledToken, Sampling, Status,
    StepEntry,
};
use gantry_engine_native::{NativeEngine, NativeModel};

const PROMPT: &str = "<|im_start|>user\nTell me about the sea and the ships that sail on it.\
    <|im_end|>\n<|im_start|>assistant\n";
/// Longer than two KV blocks, for the prefix cache.
const LONG: &str = "<|im_start|>system\nYou are a helpful assistant who answers questions about \
    ships, harbours and the sea in plain words.<|im_end|>\n<|im_start|>user\nTell me about \
    the sea.<|im_end|>\n<|im_start|>assistant\n";
const OTHER: &str = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
    <|im_start|>assistant\n";

/// Tokens generated per comparison.
const N: usize = 16;

/// The adapter directory, or `None` after printing why the test is skipped.
fn adapters() -> Option<PathBuf> {
    let dir = match std::env::var_os("GANTRY_SMOLLM2_ADAPTERS") {
        Some(d) => PathBuf::from(d),
        None => {
            println!("SKIPPED: GANTRY_SMOLLM2_ADAPTERS is not set (eval \"$(cat /tmp/w/env.sh)\")");
            return None;
        }
    };
    if !dir.join("pirate").join("adapter_config.json").is_file() {
        println!(
            "SKIPPED: no PEFT adapters under {} (testkit/python/smollm2_lora.py makes them)",
            dir.display()
        );
        return None;
    }
    Some(dir)
}

/// A model of `dir` on the CPU backend: eight sequences of 256 positions, two threads.
fn load(dir: &Path) -> NativeModel {
    let engine = NativeEngine::create(
        EngineConfig {
            backend: Backend::Cpu,
            max_batch_size: 8,
            context_length: 256,
            n_threads: 2,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )
    .expect("engine");
    engine.load_model(&st_desc("smollm2", dir)).expect("load")
}

fn smollm2() -> NativeModel {
    load(&env_path("GANTRY_SMOLLM2_ST_DIR"))
}

fn peft(dir: &Path, name: &str) -> AdapterDescriptor {
    AdapterDescriptor {
        name: name.into(),
        path: dir.join(name),
        format: Format::Safetensors,
        scale: 1.0,
    }
}

fn load_adapter(m: &NativeModel, dir: &Path, name: &str) -> u64 {
    m.adapter_load(&peft(dir, name))
        .unwrap_or_else(|e| panic!("adapter {name}: {e:?}"))
        .id
}

fn prompt(m: &NativeModel, text: &str) -> Vec<i32> {
    m.tokenize(text.as_bytes(), true, true).expect("tokenize")
}

fn with_logprobs() -> Sampling {
    Sampling {
        top_logprobs: 20,
        want_logprob: true,
        ..Sampling::greedy()
    }
}

/// Greedy continuations of `prompts[i]` under `adapters[i]` (0 = base), all sequences stepped
/// together: prompt in one entry, then one token per step; `join_at[i]` delays sequence i by
/// that many steps. `fresh` evaluates prompts without the prefix cache.
fn generate(
    m: &NativeModel,
    prompts: &[&[i32]],
    adapters: &[u64],
    join_at: &[usize],
    fresh: bool,
) -> Vec<Vec<SampledToken>> {
    let s = with_logprobs();
    let seqs: Vec<u64> = adapters
        .iter()
        .map(|&a| {
            let seq = m.seq_open().expect("seq_open");
            m.seq_set_adapter(seq, a).expect("seq_set_adapter");
            seq
        })
        .collect();
    let mut out: Vec<Vec<SampledToken>> = vec![Vec::new(); seqs.len()];
    let mut step = 0;
    while out.iter().any(|o| o.len() < N) {
        let last: Vec<[i32; 1]> = out
            .iter()
            .map(|o| [o.last().map_or(0, |t| t.token)])
            .collect();
        let mut entries = Vec::new();
        let mut who = Vec::new();
        for i in 0..seqs.len() {
            if out[i].len() >= N || step < join_at.get(i).copied().unwrap_or(0) {
                continue;
            }
            let first = out[i].is_empty();
            entries.push(StepEntry {
                seq: seqs[i],
                tokens: if first { prompts[i] } else { &last[i] },
                sample: Some(&s),
                fresh: fresh && first,
                allowed: None,
                sample_all: false,
            });
            who.push(i);
        }
        let results = m.step(&entries).expect("step");
        for (i, r) in who.into_iter().zip(results) {
            out[i].push(r.expect("sampled"));
        }
        step += 1;
    }
    for seq in seqs {
        m.seq_release(seq);
    }
    out
}

fn tokens(s: &[SampledToken]) -> Vec<i32> {
    s.iter().map(|t| t.token).collect()
}

/// One greedy continuation of `p` under `adapter`, alone, without the prefix cache.
fn alone(m: &NativeModel, p: &[i32], adapter: u64) -> Vec<i32> {
    tokens(&generate(m, &[p], &[adapter], &[], true)[0])
}

#[test]
fn the_engine_declares_adapters() {
    assert_ne!(
        NativeEngine::CAPABILITIES & gantry_engine_abi::ffi::GANTRY_CAP_ADAPTERS,
        0
    );
}

/// Bound on |Δ logprob| between the adapter applied at run time and the merged checkpoint,
/// over the sampled token and the top 20 of every step. Measured (2 threads, AVX2 machine):
/// 1.3e-5 max over 16 steps (f32 throughout; the top-20 logprobs lie around -0.1 to -15, so
/// that is ~1e-5 relative or better). The bound leaves room for other gemm kernel choices.
const MERGED_BOUND: f32 = 1e-3;

#[test]
fn pirate_at_run_time_matches_the_pirate_merged_checkpoint() {
    let Some(dir) = adapters() else { return };
    let m = smollm2();
    let pirate = m.adapter_load(&peft(&dir, "pirate")).expect("pirate");
    // The f32 bytes held: rank 8 A and B of seven projections in 30 layers.
    let per_layer = 8 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3);
    assert_eq!(pirate.bytes, 4 * 30 * per_layer as u64);
    let p = prompt(&m, PROMPT);
    let ours = generate(&m, &[&p], &[pirate.id], &[], true).remove(0);
    drop(m);
    let merged = load(&dir.join("pirate-merged"));
    let theirs = generate(&merged, &[&p], &[0], &[], true).remove(0);
    assert_eq!(tokens(&ours), tokens(&theirs), "greedy tokens");
    let mut max = 0f32;
    for (a, b) in ours.iter().zip(&theirs) {
        max = max.max((a.logprob - b.logprob).abs());
        for &(t, lp) in &a.top {
            if let Some(&(_, lq)) = b.top.iter().find(|(u, _)| *u == t) {
                max = max.max((lp - lq).abs());
            }
        }
    }
    println!("pirate at run time vs pirate-merged: max |delta logprob| = {max:e} over {N} steps");
    assert!(
        max <= MERGED_BOUND,
        "max |delta logprob| {max} > {MERGED_BOUND}"
    );
}

#[test]
fn adapters_change_the_text_and_a_mixed_batch_gives_each_sequence_its_own_tokens() {
    let Some(dir) = adapters() else { return };
    let m = smollm2();
    let pirate = load_adapter(&m, &dir, "pirate");
    let formal = load_adapter(&m, &dir, "formal");
    let (p, q) = (prompt(&m, PROMPT), prompt(&m, OTHER));
    let base_p = alone(&m, &p, 0);
    let pirate_p = alone(&m, &p, pirate);
    let formal_p = alone(&m, &p, formal);
    let text =
        |t: &[i32]| String::from_utf8_lossy(&m.detokenize(t, false).expect("detok")).into_owned();
    println!("base:   {:?}", text(&base_p));
    println!("pirate: {:?}", text(&pirate_p));
    println!("formal: {:?}", text(&formal_p));
    assert_ne!(pirate_p, base_p, "pirate changes the base's text");
    assert_ne!(formal_p, pirate_p, "formal is not pirate");
    assert_ne!(formal_p, base_p, "formal changes the base's text");
    let pirate_q = alone(&m, &q, pirate);
    let base_q = alone(&m, &q, 0);

    // Base, pirate, pirate, formal, base in the same steps (two pirate rows side by side form
    // one run), two of them joining late so prompt and decode rows mix too; every prompt is
    // evaluated whole (no prefix cache), so the runs cover prompt rows as well.
    let prompts: [&[i32]; 5] = [&p, &p, &q, &p, &q];
    let adapters = [0, pirate, pirate, formal, 0];
    let mixed = generate(&m, &prompts, &adapters, &[0, 0, 0, 3, 1], true);
    let want = [&base_p, &pirate_p, &pirate_q, &formal_p, &base_q];
    for (i, (got, want)) in mixed.iter().zip(want).enumerate() {
        assert_eq!(&tokens(got), want, "sequence {i} (adapter {})", adapters[i]);
    }
}

fn refusal(m: &NativeModel, desc: &AdapterDescriptor) -> EngineError {
    match m.adapter_load(desc) {
        Ok(a) => panic!("adapter {} was loaded as {}", desc.name, a.id),
        Err(e) => {
            println!("{}: {:?}: {}", desc.name, e.status, e.message);
            e
        }
    }
}

#[test]
fn adapters_that_do_not_fit_are_refused_naming_the_tensor_and_the_base_runs_on() {
    let Some(dir) = adapters() else { return };
    let m = smollm2();
    let p = prompt(&m, PROMPT);
    let before = alone(&m, &p, 0);

    let e = refusal(&m, &peft(&dir, "bad-shape"));
    assert_eq!(e.status, Status::LoadFailed);
    for part in [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "[8, 512]",
        "[576, 576]",
        "[8, 576]",
    ] {
        assert!(e.message.contains(part), "{:?} lacks {part}", e.message);
    }
    let e = refusal(&m, &peft(&dir, "bad-target"));
    assert_eq!(e.status, Status::LoadFailed);
    for part in [
        "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight",
        "qkv_proj",
        "[8, 576]",
    ] {
        assert!(e.message.contains(part), "{:?} lacks {part}", e.message);
    }
    // A GGUF adapter: this engine reads PEFT directories.
    let gguf = AdapterDescriptor {
        path: dir.join("pirate.gguf"),
        format: Format::Gguf,
        ..peft(&dir, "pirate.gguf")
    };
    let e = refusal(&m, &gguf);
    assert_eq!(e.status, Status::Unsupported);
    assert!(e.message.contains("PEFT safetensors"), "{}", e.message);

    // Made-up ones: a rank of 0, fan_in_fan_out, a damaged file, a missing directory.
    let tmp = tempfile::tempdir().expect("tempdir");
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("pirate/adapter_config.json")).expect("config"),
    )
    .expect("json");
    let variant = |name: &str, key: &str, value: serde_json::Value, weights: Option<&[u8]>| {
        let d = tmp.path().join(name);
        std::fs::create_dir(&d).expect("mkdir");
        let mut c = config.clone();
        c[key] = value;
        std::fs::write(d.join("adapter_config.json"), c.to_string()).expect("write");
        match weights {
            Some(w) => std::fs::write(d.join("adapter_model.safetensors"), w).expect("write"),
            None => {
                std::fs::copy(
                    dir.join("pirate/adapter_model.safetensors"),
                    d.join("adapter_model.safetensors"),
                )
                .expect("copy");
            }
        }
        peft(tmp.path(), name)
    };
    let e = refusal(&m, &variant("rank0", "r", 0.into(), None));
    assert_eq!(e.status, Status::LoadFailed);
    assert!(e.message.contains("rank"), "{}", e.message);
    let e = refusal(&m, &variant("rank4", "r", 4.into(), None));
    assert_eq!(e.status, Status::LoadFailed);
    assert!(e.message.contains("must be [4, "), "{}", e.message);
    let e = refusal(&m, &variant("fifo", "fan_in_fan_out", true.into(), None));
    assert_eq!(e.status, Status::Unsupported);
    let e = refusal(&m, &variant("bias", "bias", "all".into(), None));
    assert_eq!(e.status, Status::Unsupported);
    let e = refusal(
        &m,
        &variant("damaged", "r", 8.into(), Some(b"\x10\0\0\0\0\0\0\0{\"a\":")),
    );
    assert_eq!(e.status, Status::ModelCorrupt);
    let e = refusal(&m, &peft(tmp.path(), "missing"));
    assert_eq!(e.status, Status::ModelCorrupt);

    // The model serves the base as before, and a good adapter still loads.
    assert_eq!(alone(&m, &p, 0), before, "base after the refusals");
    load_adapter(&m, &dir, "pirate");
}

/// The first step of a new sequence under `adapter` with `p` (prefix cache on); the tokens
/// it took from the cache.
fn cached_first_step(m: &NativeModel, p: &[i32], adapter: u64) -> (u64, i32) {
    let greedy = Sampling::greedy();
    let seq = m.seq_open().expect("seq_open");
    m.seq_set_adapter(seq, adapter).expect("seq_set_adapter");
    let out = m
        .step(&[StepEntry {
            seq,
            tokens: p,
            sample: Some(&greedy),
            fresh: false,
            allowed: None,
            sample_all: false,
        }])
        .expect("step");
    let cached = m.seq_cached_tokens(seq).expect("cached tokens known");
    m.seq_release(seq);
    (cached, out[0].as_ref().expect("sampled").token)
}

#[test]
fn a_prefix_cached_under_an_adapter_is_never_reused_under_another() {
    let Some(dir) = adapters() else { return };
    let m = smollm2();
    let pirate = load_adapter(&m, &dir, "pirate");
    let p = prompt(&m, LONG);
    assert!(
        p.len() > 2 * gantry_engine_native::BLOCK_SIZE,
        "{} tokens",
        p.len()
    );
    let base_first = alone(&m, &p, 0)[0];
    let pirate_first = alone(&m, &p, pirate)[0];
    // `alone` evaluates without the cache but registers its blocks: start from a model whose
    // cache holds only what this test puts there.
    drop(m);
    let m = smollm2();
    let pirate = load_adapter(&m, &dir, "pirate");

    let (cached, t) = cached_first_step(&m, &p, pirate);
    assert_eq!((cached, t), (0, pirate_first), "a cold cache");
    let (cached, t) = cached_first_step(&m, &p, 0);
    assert_eq!(
        cached, 0,
        "a base sequence takes nothing from pirate's blocks"
    );
    assert_eq!(t, base_first);
    let (cached, t) = cached_first_step(&m, &p, 0);
    assert_eq!(cached as usize, p.len() - 1, "two base sequences share");
    assert_eq!(t, base_first);
    let (cached, t) = cached_first_step(&m, &p, pirate);
    assert_eq!(cached as usize, p.len() - 1, "two pirate sequences share");
    assert_eq!(t, pirate_first);
}

fn fresh_entry<'a>(seq: u64, tokens: &'a [i32], s: &'a Sampling) -> StepEntry<'a> {
    StepEntry {
        seq,
        tokens,
        sample: Some(s),
        fresh: true,
        allowed: None,
        sample_all: false,
    }
}

#[test]
fn a_fork_of_a_pirate_sequence_continues_as_pirate() {
    let Some(dir) = adapters() else { return };
    let m = smollm2();
    let pirate = load_adapter(&m, &dir, "pirate");
    let formal = load_adapter(&m, &dir, "formal");
    let p = prompt(&m, PROMPT);
    let want = alone(&m, &p, pirate);
    let greedy = Sampling::greedy();
    let entry = |seq, tokens| fresh_entry(seq, tokens, &greedy);
    let src = m.seq_open().expect("seq_open");
    m.seq_set_adapter(src, pirate).expect("seq_set_adapter");
    let first = m.step(&[entry(src, &p)]).expect("step")[0]
        .as_ref()
        .expect("sampled")
        .token;
    assert_eq!(first, want[0]);
    // A stepped sequence keeps its adapter.
    let e = m
        .seq_set_adapter(src, formal)
        .expect_err("switching a stepped sequence");
    assert!(e.message.contains("stepped"), "{}", e.message);
    let child = m.seq_fork(src).expect("fork");
    m.seq_release(src);
    let mut got = vec![first];
    while got.len() < N {
        let last = [got[got.len() - 1]];
        let t = m.step(&[fresh_entry(child, &last, &greedy)]).expect("step")[0]
            .as_ref()
            .expect("sampled")
            .token;
        got.push(t);
    }
    m.seq_release(child);
    assert_eq!(got, want, "the fork continues as pirate");
}
