//! Speculative decoding and forks in the llama.cpp plugin (ABI 1.5, engine layer, below the
//! scheduler), through the engine host on real GGUF models: a verification entry
//! (`GANTRY_STEP_SAMPLE_ALL`) samples after every drafted token exactly what feeding them one at
//! a time samples, `seq_truncate` drops rejected drafts, and `seq_fork` shares a prompt's cells
//! with new sequences without changing what they generate.

mod common;

use common::*;
use gantry_engine_abi::{EngineError, SampledToken, Sampling, Status, StepEntry};
use gantry_node::engine_host::{ModelExec, ModelShared};
use gantry_testkit::TinyModelSpec;

/// One step of one entry on `seq`: `tokens`, sampled with `sampling` after the last token, or
/// after every token with `all`.
fn step(
    exec: &mut ModelExec,
    seq: u64,
    tokens: &[i32],
    sampling: Option<&Sampling>,
    all: bool,
) -> Result<Vec<SampledToken>, EngineError> {
    let out = exec.step(&[StepEntry {
        seq,
        tokens,
        sample: sampling,
        fresh: false,
        allowed: None,
        sample_all: all,
    }])?;
    Ok(out.into_iter().flatten().collect())
}

fn tokens(out: &[SampledToken]) -> Vec<i32> {
    out.iter().map(|t| t.token).collect()
}

/// `n` tokens of `seq` decoded one at a time after `first` (fed first).
fn decode(exec: &mut ModelExec, seq: u64, first: i32, n: usize, s: &Sampling) -> Vec<i32> {
    let mut feed = first;
    (0..n)
        .map(|_| {
            feed = step(exec, seq, &[feed], Some(s), false).expect("decode")[0].token;
            feed
        })
        .collect()
}

/// `n` tokens sampled with `s` after `prompt`, fed one at a time, on a sequence of its own.
fn plain(exec: &mut ModelExec, prompt: &[i32], n: usize, s: &Sampling) -> Vec<i32> {
    let seq = exec.seq_open().expect("seq_open");
    let first = step(exec, seq, prompt, Some(s), false).expect("prompt")[0].token;
    let mut out = vec![first];
    out.extend(decode(exec, seq, first, n - 1, s));
    exec.seq_release(seq);
    out
}

/// Greedy verification on `exec`: the plain continuation as the draft is accepted whole, and a
/// draft with a wrong token is right up to it and, truncated there, goes on as the plain one.
fn check_greedy_verification(exec: &mut ModelExec, prompt: &[i32]) {
    let g = Sampling::greedy();
    let want = plain(exec, prompt, 24, &g);
    // Every draft right: the samples after t0..t7 are t1..t8.
    let seq = exec.seq_open().expect("seq_open");
    let t0 = step(exec, seq, prompt, Some(&g), false).expect("prompt")[0].token;
    assert_eq!(t0, want[0]);
    let got = step(exec, seq, &want[..8], Some(&g), true).expect("verify");
    assert_eq!(got.len(), 8, "one sample per drafted token");
    assert_eq!(
        tokens(&got),
        want[1..9],
        "the plain continuation is accepted whole"
    );
    // Nothing to drop: it goes on after the bonus token t8.
    exec.seq_truncate(seq, (prompt.len() + 8) as u64)
        .expect("keeping everything");
    assert_eq!(decode(exec, seq, want[8], 8, &g), want[9..17]);
    exec.seq_release(seq);

    // A wrong draft in the middle: t0 t1 t2 X t4 t5.
    let seq = exec.seq_open().expect("seq_open");
    step(exec, seq, prompt, Some(&g), false).expect("prompt");
    let wrong = (0..)
        .find(|t| *t != want[3] && *t != want[2])
        .expect("another token");
    let draft = [want[0], want[1], want[2], wrong, want[4], want[5]];
    let got = tokens(&step(exec, seq, &draft, Some(&g), true).expect("verify"));
    assert_eq!(got.len(), draft.len());
    assert_eq!(got[..3], want[1..4], "the samples before the wrong draft");
    // t0 t1 t2 are kept (the sample after t2, t3, is the correction fed next).
    let held = prompt.len() + draft.len();
    let err = exec
        .seq_truncate(seq, held as u64 + 1)
        .expect_err("keeping more than it holds");
    assert_eq!(err.status, Status::Internal, "{err}");
    exec.seq_truncate(seq, (prompt.len() + 3) as u64)
        .expect("truncate");
    assert_eq!(
        decode(exec, seq, got[2], 12, &g),
        want[4..16],
        "after the truncation the sequence goes on as the plain one"
    );
    exec.seq_release(seq);
}

#[test]
fn verifying_drafts_on_the_tiny_model_samples_what_greedy_decoding_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 256);
    assert!(
        plugin.info().supports_speculation() && plugin.info().supports_token_mask(),
        "the plugin declares GANTRY_CAP_SPECULATE beside GANTRY_CAP_TOKEN_MASK"
    );
    let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let prompt = shared
        .tokenize("The capital of France is", true, false)
        .expect("tok");
    check_greedy_verification(&mut exec, &prompt);
}

#[test]
fn a_verification_draws_from_the_seeded_generator_as_one_token_at_a_time_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 256);
    let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let prompt = shared.tokenize("Hello there", true, false).expect("tok");
    let s = Sampling {
        temperature: 1.0,
        top_k: 40,
        top_p: 0.95,
        seed: 7,
        want_logprob: true,
        top_logprobs: 2,
        ..Sampling::greedy()
    };
    let want = plain(&mut exec, &prompt, 12, &s);
    // The same seed; the samples it drew fed back as drafts: the same samples again.
    let seq = exec.seq_open().expect("seq_open");
    assert_eq!(
        step(&mut exec, seq, &prompt, Some(&s), false).expect("prompt")[0].token,
        want[0]
    );
    let got = step(&mut exec, seq, &want[..10], Some(&s), true).expect("verify");
    assert_eq!(tokens(&got), want[1..11]);
    assert!(
        got.iter()
            .all(|t| t.logprob.is_finite() && t.logprob <= 0.0 && t.top.len() == 2)
    );
    exec.seq_release(seq);
}

#[test]
fn forked_sequences_generate_what_an_unforked_one_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(4, 256);
    let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let prompt = shared
        .tokenize("Question: what is the answer? Answer:", true, false)
        .expect("tok");
    check_forks(&mut exec, &prompt, 4);
}

/// A parent fed `prompt` but its last token, forked into `n - 1` children: each then fed the
/// last token and decoding 16 more, all stepped together, generates the plain greedy
/// continuation; one fork more than `n` sequences is refused with an OOM status.
fn check_forks(exec: &mut ModelExec, prompt: &[i32], n: usize) {
    let g = Sampling::greedy();
    let want = plain(exec, prompt, 17, &g);
    let (head, last) = prompt.split_at(prompt.len() - 1);
    let parent = exec.seq_open().expect("seq_open");
    step(exec, parent, head, None, false).expect("prompt but its last token");
    let mut seqs = vec![parent];
    for _ in 1..n {
        let child = exec.seq_fork(parent).expect("fork");
        assert_eq!(exec.seq_cached_tokens(child), Some(0));
        seqs.push(child);
    }
    let err = exec.seq_fork(parent).expect_err("every sequence is open");
    assert!(
        matches!(err.status, Status::OomRam | Status::OomVram),
        "{err}"
    );
    let outs = decode_together(exec, &seqs, vec![last.to_vec(); n], 17);
    for (i, out) in outs.iter().enumerate() {
        assert_eq!(out, &want, "sequence {i} (0 = the parent)");
    }
    // A sequence not stepped yet has nothing to fork.
    exec.seq_release(seqs.pop().expect("a child"));
    let fresh = exec.seq_open().expect("seq_open");
    let err = exec.seq_fork(fresh).expect_err("nothing to fork");
    assert_eq!(err.status, Status::Unsupported, "{err}");
    exec.seq_release(fresh);
    for s in seqs {
        exec.seq_release(s);
    }
}

#[test]
fn verification_is_refused_with_penalties_a_mask_or_before_the_prompt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 256);
    let (shared, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let prompt = shared.tokenize("Hello world", true, false).expect("tok");
    let g = Sampling::greedy();
    let want = plain(&mut exec, &prompt, 6, &g);
    let seq = exec.seq_open().expect("seq_open");
    // Before its prompt: a verification needs a sequence already stepped.
    let err = step(&mut exec, seq, &prompt, Some(&g), true).expect_err("unbound");
    assert_eq!(err.status, Status::Unsupported, "{err}");
    step(&mut exec, seq, &prompt, Some(&g), false).expect("prompt");
    let penalized = Sampling {
        repetition_penalty: 1.3,
        ..Sampling::greedy()
    };
    let err = step(&mut exec, seq, &want[..3], Some(&penalized), true).expect_err("penalties");
    assert_eq!(err.status, Status::Unsupported, "{err}");
    let mask = vec![u32::MAX; 64];
    let err = exec
        .step(&[StepEntry {
            seq,
            tokens: &want[..3],
            sample: Some(&g),
            fresh: false,
            allowed: Some(&mask),
            sample_all: true,
        }])
        .expect_err("mask");
    assert_eq!(err.status, Status::Unsupported, "{err}");
    // The refused steps left the sequence as it was.
    assert_eq!(decode(&mut exec, seq, want[0], 5, &g), want[1..6]);
    exec.seq_release(seq);
}

/// A prompt of at least `n` tokens.
fn long_prompt(shared: &ModelShared, n: usize) -> Vec<i32> {
    let mut text = String::from("Notes on the rivers of France, one after another.");
    let rivers = ["Seine", "Loire", "Rhone", "Garonne", "Dordogne", "Marne"];
    let mut i = 0;
    loop {
        let p = shared.tokenize(&text, true, false).expect("tok");
        if p.len() >= n {
            return p;
        }
        let r = rivers[i % rivers.len()];
        text.push_str(&format!(
            " Item {i}: the {r} flows past town number {}.",
            i * 7
        ));
        i += 1;
    }
}

#[test]
fn gemma_verification_and_forks_past_the_sliding_window_are_exact() {
    let path = gemma_path();
    let plugin = llama_plugin(4, 1024);
    let (shared, mut exec) = plugin
        .load_model(&desc("gemma", &path))
        .expect("load gemma");
    assert_eq!(shared.info().architecture, "gemma3");
    // Inside the window, then past it (the window is 512 positions).
    let short = shared
        .tokenize(
            "Question: What is the capital of France?\nAnswer:",
            true,
            false,
        )
        .expect("tok");
    check_greedy_verification(&mut exec, &short);
    let long = long_prompt(&shared, 600);
    check_greedy_verification(&mut exec, &long);
    check_forks(&mut exec, &long, 4);
}

#[test]
fn gemma_verification_beside_a_long_prefill_chunk_is_exact() {
    // A step of more than one ubatch (512 tokens): another sequence's prompt chunk and a
    // verification of a sequence longer than the window, truncated afterwards.
    let path = gemma_path();
    let plugin = llama_plugin(2, 1024);
    let (shared, mut exec) = plugin
        .load_model(&desc("gemma", &path))
        .expect("load gemma");
    let g = Sampling::greedy();
    let a = long_prompt(&shared, 560);
    let want = plain(&mut exec, &a, 16, &g);
    let b: Vec<i32> = long_prompt(&shared, 700)[..700].to_vec();
    let seq_a = exec.seq_open().expect("seq_open");
    step(&mut exec, seq_a, &a, Some(&g), false).expect("prompt");
    let seq_b = exec.seq_open().expect("seq_open");
    let wrong = (0..).find(|t| *t != want[3]).expect("another token");
    let draft = [want[0], want[1], want[2], wrong, want[4], want[5], want[6]];
    let out = exec
        .step(&[
            StepEntry {
                seq: seq_a,
                tokens: &draft,
                sample: Some(&g),
                fresh: false,
                allowed: None,
                sample_all: true,
            },
            StepEntry {
                seq: seq_b,
                tokens: &b,
                sample: None,
                fresh: false,
                allowed: None,
                sample_all: false,
            },
        ])
        .expect("step");
    assert_eq!(out.len(), draft.len() + 1, "7 slots for A, one for B");
    assert!(out[draft.len()].is_none(), "B asked for no sample");
    let got: Vec<i32> = out[..draft.len()]
        .iter()
        .map(|t| t.as_ref().expect("sampled").token)
        .collect();
    assert_eq!(got[..3], want[1..4]);
    exec.seq_truncate(seq_a, (a.len() + 3) as u64)
        .expect("truncate");
    assert_eq!(decode(&mut exec, seq_a, got[2], 12, &g), want[4..16]);
    exec.seq_release(seq_a);
    exec.seq_release(seq_b);
}
