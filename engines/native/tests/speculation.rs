//! Speculative decoding and forks in the native engine (ABI 1.5, the model level below the
//! scheduler): a step that samples after every token of a draft (`sample_all`), `seq_truncate`
//! back to the accepted tokens (copying on write a block another sequence or the prefix cache
//! reads), and `seq_fork` sharing a prompt's KV with several sequences, on the real Gemma 3
//! 270M with greedy sampling: every path must give the plain one-token-per-step continuation.
//!
//! Needs `GANTRY_GEMMA_ST_DIR` (scripts/setup.sh makes it, scripts/test.sh exports it); the
//! tests fail, never pass silently, without it. The same scenarios run on the CUDA backend
//! with the tiny models in an ignored test (a GPU machine runs it with `--include-ignored`):
//! a step with a draft takes the host's sampling path there.

mod common;

use common::{env_path, st_desc};
use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{Backend, EngineConfig, Sampling, Status, StepEntry};
use gantry_engine_native::{BLOCK_SIZE, NativeEngine, NativeModel};
use gantry_testkit::hf::{HfFamily, write_tiny_hf};

const TEXT: &str = "The history of the Roman Empire spans more than a thousand years, from the \
    founding of the city on the banks of the Tiber to the fall of Constantinople. Historians \
    divide it into the Kingdom, the Republic and the Empire, each with its own institutions.";

/// A model of `dir` on `backend`: four sequences of 256 positions.
fn load(dir: &std::path::Path, backend: Backend) -> NativeModel {
    let engine = NativeEngine::create(
        EngineConfig {
            backend,
            max_batch_size: 4,
            context_length: 256,
            n_threads: 2,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )
    .expect("engine");
    engine.load_model(&st_desc("model", dir)).expect("load")
}

/// Gemma 3 270M on the CPU backend.
fn gemma() -> NativeModel {
    load(&env_path("GANTRY_GEMMA_ST_DIR"), Backend::Cpu)
}

/// The first `n` tokens of the test text.
fn prompt(m: &NativeModel, n: usize) -> Vec<i32> {
    let p = m.tokenize(TEXT.as_bytes(), true, false).expect("tokenize");
    assert!(p.len() >= n, "{} tokens, the test wants {n}", p.len());
    p[..n].to_vec()
}

fn entry<'a>(seq: u64, tokens: &'a [i32], greedy: &'a Sampling, all: bool) -> StepEntry<'a> {
    StepEntry {
        seq,
        tokens,
        sample: Some(greedy),
        fresh: false,
        allowed: None,
        sample_all: all,
    }
}

/// Feed `tokens` to `seq` in one step; the greedy samples (one, or one per token with `all`).
fn feed(m: &NativeModel, seq: u64, tokens: &[i32], all: bool) -> Vec<i32> {
    feed_with(m, seq, tokens, all, &Sampling::greedy())
}

fn feed_with(m: &NativeModel, seq: u64, tokens: &[i32], all: bool, s: &Sampling) -> Vec<i32> {
    let out = m.step(&[entry(seq, tokens, s, all)]).expect("step");
    assert_eq!(out.len(), if all { tokens.len() } else { 1 });
    out.into_iter().map(|r| r.expect("sampled").token).collect()
}

/// Feed `first`, then decode one token per step: the `n` greedy tokens.
fn decode(m: &NativeModel, seq: u64, first: &[i32], n: usize) -> Vec<i32> {
    decode_with(m, seq, first, n, &Sampling::greedy())
}

fn decode_with(m: &NativeModel, seq: u64, first: &[i32], n: usize, s: &Sampling) -> Vec<i32> {
    let mut out = feed_with(m, seq, first, false, s);
    while out.len() < n {
        let last = out[out.len() - 1];
        out.extend(feed_with(m, seq, &[last], false, s));
    }
    out
}

/// The plain greedy continuation of `prompt`: a new sequence evaluated from scratch (no
/// prefix cache), one token per step.
fn plain(m: &NativeModel, prompt: &[i32], n: usize) -> Vec<i32> {
    plain_with(m, prompt, n, &Sampling::greedy())
}

fn plain_with(m: &NativeModel, prompt: &[i32], n: usize, s: &Sampling) -> Vec<i32> {
    let seq = m.seq_open().expect("seq_open");
    let first = m
        .step(&[StepEntry {
            fresh: true,
            ..entry(seq, prompt, s, false)
        }])
        .expect("step")[0]
        .as_ref()
        .expect("sampled")
        .token;
    let mut out = vec![first];
    if n > 1 {
        out.extend(decode_with(m, seq, &[first], n - 1, s));
    }
    m.seq_release(seq);
    out
}

/// `tokens` with token `at` replaced by another (`salt` picks which: a different one per
/// scenario, so no scenario finds another's draft in the prefix cache).
fn corrupt(m: &NativeModel, tokens: &[i32], at: usize, salt: i32) -> Vec<i32> {
    let vocab = m.info().vocab_size as i32;
    let mut d = tokens.to_vec();
    d[at] = (d[at] + salt * 37) % vocab;
    assert_ne!(d[at], tokens[at]);
    d
}

#[test]
fn the_engine_declares_speculation() {
    assert_ne!(
        NativeEngine::CAPABILITIES & gantry_engine_abi::ffi::GANTRY_CAP_SPECULATE,
        0
    );
}

#[test]
fn a_greedy_draft_is_verified_in_one_step_and_a_wrong_one_is_truncated_back_to_the_plain_continuation()
 {
    drafts(&gemma());
}

fn drafts(m: &NativeModel) {
    let p = prompt(m, 37);
    // g[0] follows the prompt, g[i + 1] follows g[i].
    let g = plain(m, &p, 18);

    // The plain continuation as a draft: every sample matches the next token.
    let a = m.seq_open().expect("seq_open");
    assert_eq!(feed(m, a, &p, false), g[..1]);
    assert_eq!(feed(m, a, &g[..16], true), g[1..17], "a correct draft");
    m.seq_release(a);

    // A wrong token at draft index 8: the samples up to it match; the host keeps the prompt
    // and g[..8], the sample after g[7] (g[8]) is the next token.
    let a = m.seq_open().expect("seq_open");
    assert_eq!(feed(m, a, &p, false), g[..1]);
    let draft = corrupt(m, &g[..16], 8, 1);
    let samples = feed(m, a, &draft, true);
    assert_eq!(samples[..8], g[1..9], "the samples before the wrong token");
    // Errors leave the sequence as it was.
    let too_long = m.seq_truncate(a, p.len() + 17).expect_err("past the end");
    assert_eq!(too_long.status, Status::Internal, "{too_long}");
    let n_keep = p.len() + 8;
    assert!(
        !n_keep.is_multiple_of(BLOCK_SIZE),
        "the cut is inside a block"
    );
    m.seq_truncate(a, n_keep).expect("truncate");
    assert_eq!(decode(m, a, &g[8..9], 9), g[9..18], "after the truncation");

    // The allowed-token mask is never sent with a draft: refused.
    let greedy = Sampling::greedy();
    let mask = vec![u32::MAX; (m.info().vocab_size as usize).div_ceil(32)];
    let e = m
        .step(&[StepEntry {
            allowed: Some(&mask),
            ..entry(a, &g[..2], &greedy, true)
        }])
        .expect_err("a mask with sample_all");
    assert_eq!(e.status, Status::Unsupported, "{e}");
    m.seq_release(a);
}

/// The prompt (37 tokens), its plain continuation `g` (18 tokens), and a draft of `g[..16]`
/// with `wrong` at index 8: the host keeps the prompt and `g[..8]`, a cut inside a block the
/// draft filled.
fn wrong_draft(m: &NativeModel, salt: i32) -> (Vec<i32>, Vec<i32>, Vec<i32>, usize) {
    let p = prompt(m, 37);
    let g = plain(m, &p, 18);
    let draft = corrupt(m, &g[..16], 8, salt);
    let n_keep = p.len() + 8;
    assert!(
        !n_keep.is_multiple_of(BLOCK_SIZE)
            && (n_keep / BLOCK_SIZE + 1) * BLOCK_SIZE <= p.len() + 16,
        "the cut lies inside a block the draft filled"
    );
    (p, g, draft, n_keep)
}

fn cat(a: &[i32], b: &[i32]) -> Vec<i32> {
    a.iter().chain(b).copied().collect()
}

#[test]
fn a_truncation_inside_a_block_shared_with_a_fork_copies_it_and_the_fork_sees_no_change() {
    truncate_shared(&gemma());
}

fn truncate_shared(m: &NativeModel) {
    let (p, g, draft, n_keep) = wrong_draft(m, 2);
    // What the draft's KV continues into, from scratch: the sample after the draft, then on.
    let after_draft = plain(m, &cat(&p, &draft), 9);

    // b, forked after the draft, holds the prompt and the whole draft; a truncates inside
    // their common block and writes on. b's continuation is unchanged.
    let a = m.seq_open().expect("seq_open");
    assert_eq!(feed(m, a, &p, false), g[..1]);
    let samples = feed(m, a, &draft, true);
    assert_eq!(samples[15], after_draft[0]);
    let b = m.seq_fork(a).expect("fork");
    m.seq_truncate(a, n_keep).expect("truncate");
    assert_eq!(
        decode(m, a, &g[8..9], 9),
        g[9..18],
        "a after the truncation"
    );
    assert_eq!(
        decode(m, b, &after_draft[..1], 8),
        after_draft[1..9],
        "b reads the draft it was forked with"
    );
    m.seq_release(a);
    m.seq_release(b);
}

#[test]
fn a_truncation_inside_a_block_the_prefix_cache_registered_copies_it_and_the_cache_stays_true() {
    truncate_cached(&gemma());
}

fn truncate_cached(m: &NativeModel) {
    let (p, g, draft, n_keep) = wrong_draft(m, 3);
    // a's draft fills a block the prefix cache registers; a truncates inside it and writes on.
    let a = m.seq_open().expect("seq_open");
    assert_eq!(feed(m, a, &p, false), g[..1]);
    let samples = feed(m, a, &draft, true);
    assert_eq!(samples[..8], g[1..9]);
    m.seq_truncate(a, n_keep).expect("truncate");
    assert_eq!(
        decode(m, a, &g[8..9], 9),
        g[9..18],
        "a after the truncation"
    );
    m.seq_release(a);
    // A prompt that repeats the draft takes the cached blocks and continues as from scratch
    // (computed after a, so that a's block was the one registered).
    let with_draft = cat(&p, &draft);
    let after_draft = plain(m, &with_draft, 9);
    assert_eq!(samples[15], after_draft[0]);
    let c = m.seq_open().expect("seq_open");
    assert_eq!(
        decode(m, c, &with_draft, 9),
        after_draft,
        "the cached draft"
    );
    let reused = m.seq_cached_tokens(c).expect("reported") as usize;
    assert!(
        reused >= n_keep.next_multiple_of(BLOCK_SIZE),
        "{reused} positions reused: the block holding the cut was not taken from the cache"
    );
    m.seq_release(c);
}

#[test]
fn penalties_see_every_draft_sample_in_order_and_forget_the_dropped_ones() {
    penalties(&gemma());
}

fn penalties(m: &NativeModel) {
    let p = prompt(m, 37);
    // Greedy under strong penalties: every generated token weighs on the next choices.
    let s = Sampling {
        presence_penalty: 1.5,
        frequency_penalty: 0.5,
        repetition_penalty: 1.3,
        penalty_last_n: -1,
        ..Sampling::greedy()
    };
    let g = plain_with(m, &p, 18, &s);
    let a = m.seq_open().expect("seq_open");
    assert_eq!(feed_with(m, a, &p, false, &s), g[..1]);
    let draft = corrupt(m, &g[..16], 8, 4);
    let samples = feed_with(m, a, &draft, true, &s);
    assert_eq!(samples[..8], g[1..9], "each sample sees the ones before it");
    m.seq_truncate(a, p.len() + 8).expect("truncate");
    assert_eq!(
        decode_with(m, a, &g[8..9], 9, &s),
        g[9..18],
        "the samples after the cut are forgotten"
    );
    m.seq_release(a);
}

#[test]
fn forks_of_a_prompt_continue_as_the_plain_greedy_sequence_and_a_fork_past_the_limit_is_refused() {
    forks(&gemma());
}

fn forks(m: &NativeModel) {
    let p = prompt(m, 37);
    let g = plain(m, &p, 17);
    let parent = m.seq_open().expect("seq_open");
    let greedy = Sampling::greedy();
    let out = m
        .step(&[StepEntry {
            sample: None,
            ..entry(parent, &p[..p.len() - 1], &greedy, false)
        }])
        .expect("step");
    assert_eq!(out.len(), 1);
    assert!(out[0].is_none());
    let kids: Vec<u64> = (0..3).map(|_| m.seq_fork(parent).expect("fork")).collect();
    assert_eq!(m.seq_cached_tokens(kids[0]), Some(0));
    // Every sequence is open: a fourth fork is refused.
    let e = m.seq_fork(parent).expect_err("past max_sequences");
    assert_eq!(e.status, Status::OomRam, "{e}");
    // The children, stepped together: the last prompt token, then 16 decode steps.
    let mut feeds: Vec<Vec<i32>> = vec![vec![p[p.len() - 1]]; 3];
    let mut outs: Vec<Vec<i32>> = vec![Vec::new(); 3];
    for _ in 0..17 {
        let entries: Vec<StepEntry<'_>> = kids
            .iter()
            .zip(&feeds)
            .map(|(&k, f)| entry(k, f, &greedy, false))
            .collect();
        let r = m.step(&entries).expect("step");
        for (i, s) in r.into_iter().enumerate() {
            let t = s.expect("sampled").token;
            outs[i].push(t);
            feeds[i] = vec![t];
        }
    }
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o, &g, "child {i}");
    }
    // The parent was left as it was: it continues the prompt as well.
    assert_eq!(decode(m, parent, &p[p.len() - 1..], 4), g[..4]);
    for s in kids.into_iter().chain([parent]) {
        m.seq_release(s);
    }
    assert!(m.seq_fork(parent).is_err(), "a released sequence");
}

type Scenario = fn(&NativeModel);

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn on_cuda_drafts_truncations_and_forks_continue_as_the_plain_sequence() {
    if let Some(why) = gantry_engine_native::cuda::unavailable() {
        panic!("this GPU test ran without a usable GPU: {why}");
    }
    for family in [HfFamily::Llama, HfFamily::Qwen3] {
        let scenarios: [(&str, Scenario); 5] = [
            ("drafts", drafts),
            ("truncate_shared", truncate_shared),
            ("truncate_cached", truncate_cached),
            ("penalties", penalties),
            ("forks", forks),
        ];
        for (name, scenario) in scenarios {
            eprintln!("cuda, {family:?}: {name}");
            let dir = tempfile::tempdir().expect("tempdir");
            write_tiny_hf(dir.path(), family, 3).expect("tiny model");
            scenario(&load(dir.path(), Backend::Cuda));
        }
    }
}
