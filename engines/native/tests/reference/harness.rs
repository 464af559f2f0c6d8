//! The transformers reference's harness, shared by `tests/reference.rs` (the native engine)
//! and `tests/reference_llama_cpp.rs` (the llama.cpp plugin): `reference.json` read back, a
//! model run through its prompts and forced continuations as the step entries say, and the
//! comparisons of top-20 log-probabilities and of embeddings.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::path::Path;

use gantry_engine_abi::{Sampling, StepEntry};
use gantry_node::engine_host::ModelExec;
use serde_json::Value;

pub struct Reference {
    pub class: String,
    pub prompts: Vec<Vec<i32>>,
    pub prompt_logprobs: Vec<Vec<Vec<f32>>>,
    pub greedy: Vec<Vec<i32>>,
    pub greedy_logprobs: Vec<Vec<Vec<f32>>>,
}

pub fn ints(v: &Value) -> Vec<i32> {
    v.as_array()
        .expect("a list of token ids")
        .iter()
        .map(|t| t.as_i64().expect("a token id") as i32)
        .collect()
}

pub fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .expect("a list of distributions")
        .iter()
        .map(|r| {
            r.as_array()
                .expect("a distribution")
                .iter()
                .map(|x| x.as_f64().expect("a log-probability") as f32)
                .collect()
        })
        .collect()
}

/// The reference of the checkpoint in `dir`: for bfloat16 weights run by the engine's bf16
/// kernel (`rounded`), the one computed with bf16-rounded activations.
pub fn read_reference(dir: &Path, rounded: bool) -> Reference {
    let path = dir.join("reference.json");
    let top: Value = serde_json::from_slice(
        &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .expect("reference.json");
    let v = match &top["bf16_activations"] {
        Value::Null => &top,
        r if rounded => r,
        _ => &top,
    };
    let each = |key: &str| v[key].as_array().expect(key).clone();
    Reference {
        class: top["class"].as_str().expect("class").to_string(),
        prompts: top["prompts"]
            .as_array()
            .expect("prompts")
            .iter()
            .map(ints)
            .collect(),
        prompt_logprobs: each("prompt_logprobs").iter().map(rows).collect(),
        greedy: each("greedy").iter().map(ints).collect(),
        greedy_logprobs: each("greedy_logprobs").iter().map(rows).collect(),
    }
}

/// The most likely tokens at one position and their log-probabilities, best first.
pub type Top = Vec<(i32, f32)>;

/// What the engine computed for one prompt: every prompt position's top tokens, each decode
/// step's (teacher-forced with the reference's tokens), and the token each decode step picked.
#[derive(Default)]
pub struct Run {
    pub prompt: Vec<Top>,
    pub decode: Vec<Top>,
    pub picked: Vec<i32>,
}

/// How many top tokens the ABI returns per position.
pub const TOP: usize = 20;

/// Where a sequence of [`run`] stands.
#[derive(Clone, Copy)]
enum Stage {
    /// Not in yet.
    Waiting,
    /// This many of its prompt tokens went in (the first in a plain sampled step: position 0's
    /// distribution).
    Started(usize),
    /// Its prompt is in; this many forced tokens were fed since.
    Decoding(usize),
}

/// How the rest of a prompt goes in after its first token.
#[derive(Clone, Copy, PartialEq)]
pub enum Feed {
    /// One entry that samples after every token (a verification entry: every position's
    /// distribution; an engine verifies only a sequence it has stepped).
    Verify,
    /// One token per step, each sampled (recurrent models, whose state cannot take a
    /// verification entry).
    OneByOne,
    /// One entry sampled after its last token: [`Run::prompt`] holds positions 0 and last
    /// only (the chunked prompt path of a recurrent model).
    Whole,
}

impl Feed {
    /// The prompt positions of `rows` (one per position) that a run fed this way samples.
    pub fn expected<T: Clone>(self, rows: &[T]) -> Vec<T> {
        match self {
            Feed::Whole => vec![rows[0].clone(), rows[rows.len() - 1].clone()],
            _ => rows.to_vec(),
        }
    }
}

/// Run `prompts` through the engine together: prompt `i` joins at step `join_at[i]` with its
/// first token, then the rest of its prompt as `feed` says, then decodes `forced[i]` one token
/// per step.
pub fn run(
    exec: &mut ModelExec,
    prompts: &[Vec<i32>],
    forced: &[Vec<i32>],
    join_at: &[usize],
    feed: Feed,
) -> Vec<Run> {
    let all = Sampling {
        top_logprobs: TOP as u32,
        want_logprob: true,
        ..Sampling::greedy()
    };
    let seqs: Vec<u64> = prompts
        .iter()
        .map(|_| exec.seq_open().expect("seq_open"))
        .collect();
    let mut out: Vec<Run> = prompts.iter().map(|_| Run::default()).collect();
    let mut stage = vec![Stage::Waiting; prompts.len()];
    let mut step = 0;
    while (0..prompts.len())
        .any(|i| !matches!(stage[i], Stage::Decoding(n) if n >= forced[i].len()))
    {
        let mut entries = Vec::new();
        let mut who = Vec::new();
        for i in 0..prompts.len() {
            let (tokens, first, verify): (&[i32], bool, bool) = match stage[i] {
                Stage::Waiting if step >= join_at[i] => (&prompts[i][..1], true, false),
                Stage::Waiting => continue,
                Stage::Started(k) if feed == Feed::OneByOne => {
                    (&prompts[i][k..k + 1], false, false)
                }
                Stage::Started(k) => (&prompts[i][k..], false, feed == Feed::Verify),
                Stage::Decoding(n) if n < forced[i].len() => (&forced[i][n..n + 1], false, false),
                Stage::Decoding(_) => continue,
            };
            entries.push(StepEntry {
                seq: seqs[i],
                tokens,
                sample: Some(&all),
                fresh: first,
                allowed: None,
                sample_all: verify,
            });
            who.push((i, if verify { tokens.len() } else { 1 }, tokens.len()));
        }
        let results = exec.step(&entries).expect("step");
        drop(entries);
        let mut slots = results.into_iter();
        for (i, n, fed) in who {
            let mut tops = Vec::with_capacity(n);
            let mut token = 0;
            for _ in 0..n {
                let t = slots.next().flatten().expect("a sampled slot");
                assert_eq!(t.top.len(), TOP, "top_logprobs");
                token = t.token;
                tops.push(t.top);
            }
            stage[i] = match stage[i] {
                Stage::Waiting => {
                    out[i].prompt.extend(tops);
                    Stage::Started(1)
                }
                Stage::Started(k) if k + fed < prompts[i].len() => {
                    out[i].prompt.extend(tops);
                    Stage::Started(k + fed)
                }
                Stage::Started(_) => {
                    out[i].prompt.extend(tops);
                    // The prompt's last distribution is also the first decode step's.
                    let last = out[i].prompt.last().expect("a prompt").clone();
                    out[i].picked.push(last[0].0);
                    out[i].decode.push(last);
                    Stage::Decoding(0)
                }
                Stage::Decoding(fed) => {
                    out[i].decode.extend(tops);
                    out[i].picked.push(token);
                    Stage::Decoding(fed + 1)
                }
            };
        }
        step += 1;
    }
    for s in seqs {
        exec.seq_release(s);
    }
    // The last forced token's step samples past the reference's continuation: drop it.
    for (r, f) in out.iter_mut().zip(forced) {
        r.decode.truncate(f.len());
        r.picked.truncate(f.len());
    }
    out
}

/// Prompt `i` of `r` alone (joining at the first step), then its greedy continuation forced.
pub fn run_alone(exec: &mut ModelExec, r: &Reference, i: usize, feed: Feed) -> Run {
    run(exec, &r.prompts[i..i + 1], &r.greedy[i..i + 1], &[0], feed).remove(0)
}

/// Largest |engine − reference| over the engine's top tokens at every position.
pub fn max_diff(got: &[Top], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len(), "positions");
    got.iter()
        .zip(want)
        .flat_map(|(top, row)| top.iter().map(|&(t, lp)| (lp - row[t as usize]).abs()))
        .fold(0.0, f32::max)
}

/// Largest difference between two runs' top tokens where both list the token; the best
/// token must be the same.
pub fn run_gap(a: &[Top], b: &[Top]) -> f32 {
    assert_eq!(a.len(), b.len(), "positions");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x[0].0, y[0].0, "the best token differs between two runs");
            x.iter().filter_map(|&(t, lp)| {
                y.iter()
                    .find(|(u, _)| *u == t)
                    .map(|&(_, lq)| (lp - lq).abs())
            })
        })
        .fold(0.0, f32::max)
}

/// The largest |engine − reference| component over the embeddings of `prompts`, embedded one
/// by one and all in one batch (ABI 1.8 `embed_batch`), each engine vector checked to be of
/// unit length.
pub fn embedding_gap(exec: &mut ModelExec, prompts: &Value, embeddings: &Value, name: &str) -> f32 {
    let prompts: Vec<Vec<i32>> = prompts
        .as_array()
        .expect("prompts")
        .iter()
        .map(ints)
        .collect();
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| exec.embed(p).expect("embed"))
        .collect();
    let batch = exec.embed_batch(&prompts).expect("embed_batch");
    assert_eq!(batch.len(), prompts.len(), "{name}: one vector per input");
    let mut worst = 0.0f32;
    for (got, want) in alone
        .iter()
        .chain(&batch)
        .zip(embeddings.as_array().expect("embeddings").iter().cycle())
    {
        let want: Vec<f32> = want
            .as_array()
            .expect("a vector")
            .iter()
            .map(|x| x.as_f64().expect("a number") as f32)
            .collect();
        assert_eq!(got.len(), want.len(), "{name}");
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{name}: |v| = {norm}");
        worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(worst, f32::max);
    }
    worst
}

/// The families with recurrent state (Mamba and short-convolution layers): their prompts go in
/// one token per step, since neither engine samples after every token of a recurrent batch.
pub const RECURRENT: [&str; 11] = [
    "mamba",
    "mamba2",
    "jamba",
    "bamba",
    "bamba-full-rope",
    "granite-hybrid",
    "granite-hybrid-dense",
    "falcon-h1",
    "lfm2",
    "nemotron-h",
    "nemotron-h-moe",
];
