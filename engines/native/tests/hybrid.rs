//! The native engine's state-space (Mamba-2) layers as the step's bookkeeping sees them,
//! through the node's engine host: a sequence's recurrent state lives in its slot, a fork
//! copies it, a verification entry or a cut back is refused (the state summarises every token
//! it took), a released slot starts the next sequence from zeros, and no prefix is reused; and
//! sequences that join and leave a batch decode as they do alone. On the tiny transformers
//! Bamba and Nemotron-H checkpoints of `hf_reference.py` (`GANTRY_HF_REFERENCE`).

use gantry_engine_abi::{Sampling, Status, StepEntry};
use gantry_node::engine_host::ModelExec;

mod common;
use common::*;

fn entry<'a>(seq: u64, tokens: &'a [i32], fresh: bool, sample: &'a Sampling) -> StepEntry<'a> {
    StepEntry {
        seq,
        tokens,
        sample: Some(sample),
        fresh,
        allowed: None,
        sample_all: false,
    }
}

/// The top log-probabilities after each of `tokens`, fed one per step after `prefix` (whole).
fn continue_with(
    exec: &mut ModelExec,
    seq: u64,
    tokens: &[i32],
    s: &Sampling,
) -> Vec<Vec<(i32, f32)>> {
    tokens
        .iter()
        .map(|t| {
            let r = exec
                .step(&[entry(seq, std::slice::from_ref(t), false, s)])
                .expect("step");
            r[0].as_ref().expect("a sample").top.clone()
        })
        .collect()
}

#[test]
fn a_hybrid_model_keeps_each_sequence_state_in_its_slot() {
    let dir = env_path("GANTRY_HF_REFERENCE").join("bamba-float32");
    let plugin = plugin("native", 3, 128);
    let (shared, mut exec) = plugin
        .load_model(&st_desc("bamba", &dir))
        .expect("load the Bamba checkpoint");
    assert_eq!(shared.info().architecture, "BambaForCausalLM");
    // ABI 1.7: two Mamba-2 layers of (4 - 1) × 160 convolution inputs and 8 × 16 × 16 scan
    // values, f32 (what llama.cpp's layout gives the same shape, `tests/reference_llama_cpp.rs`).
    assert_eq!(
        shared.info().recurrent_state_bytes,
        2 * (3 * 160 + 8 * 16 * 16) * 4
    );
    let s = Sampling {
        top_logprobs: 5,
        want_logprob: true,
        ..Sampling::greedy()
    };
    let prompt: Vec<i32> = (10..30).collect();
    let tail = [40, 41, 42, 43];

    // The reference: the prompt, then the tail, in one sequence.
    let a = exec.seq_open().expect("open");
    exec.step(&[entry(a, &prompt, true, &s)]).expect("prompt");
    let want = continue_with(&mut exec, a, &tail, &s);

    // A fork after the prompt continues from the parent's state, not from zeros.
    let b = exec.seq_open().expect("open");
    exec.step(&[entry(b, &prompt, true, &s)]).expect("prompt");
    let child = exec.seq_fork(b).expect("fork");
    assert_eq!(continue_with(&mut exec, child, &tail, &s), want);
    assert_eq!(continue_with(&mut exec, b, &tail, &s), want);

    // Its drafts could not be dropped again: a verification entry and a cut back are refused,
    // and the sequence goes on as before.
    let verify = StepEntry {
        sample_all: true,
        ..entry(b, &tail, false, &s)
    };
    let e = exec.step(&[verify]).expect_err("a verification entry");
    assert_eq!(e.status, Status::Unsupported);
    assert!(e.message.contains("state-space"), "{}", e.message);
    let held = (prompt.len() + tail.len()) as u64;
    let e = exec.seq_truncate(b, held - 2).expect_err("a cut back");
    assert_eq!(e.status, Status::Unsupported);
    exec.seq_truncate(b, held)
        .expect("keeping every token is no cut");

    // Released slots are taken again, from zeros: the same prompt gives the same answer, and
    // nothing of it is reused from a prefix cache.
    for seq in [a, b, child] {
        exec.seq_release(seq);
    }
    let c = exec.seq_open().expect("open");
    exec.step(&[entry(c, &prompt, true, &s)]).expect("prompt");
    assert_eq!(exec.seq_cached_tokens(c), Some(0));
    assert_eq!(continue_with(&mut exec, c, &tail, &s), want);

    // Two sequences in one step keep apart.
    let d = exec.seq_open().expect("open");
    let other: Vec<i32> = (50..60).collect();
    exec.step(&[entry(d, &other, true, &s)])
        .expect("other prompt");
    let both: Vec<Vec<(i32, f32)>> = tail
        .iter()
        .zip([44, 45, 46, 47])
        .map(|(t, u)| {
            let r = exec
                .step(&[
                    entry(c, std::slice::from_ref(t), false, &s),
                    entry(d, std::slice::from_ref(&u), false, &s),
                ])
                .expect("step");
            r[0].as_ref().expect("a sample").top.clone()
        })
        .collect();
    let c2 = exec.seq_open().expect("open");
    exec.step(&[entry(c2, &prompt, true, &s)]).expect("prompt");
    let mut fed = tail.to_vec();
    fed.extend(tail);
    let alone = continue_with(&mut exec, c2, &fed, &s);
    assert_eq!(both, alone[tail.len()..], "the batched sequence as alone");
}

/// Greedy tokens of `prompt` continued for `n` steps in sequence `seq` (prompt in one step).
fn greedy(exec: &mut ModelExec, seq: u64, prompt: &[i32], n: usize, s: &Sampling) -> Vec<i32> {
    let mut out = Vec::with_capacity(n);
    let r = exec.step(&[entry(seq, prompt, true, s)]).expect("prompt");
    out.push(r[0].as_ref().expect("a sample").token);
    while out.len() < n {
        let last = [*out.last().expect("a token")];
        let r = exec.step(&[entry(seq, &last, false, s)]).expect("step");
        out.push(r[0].as_ref().expect("a sample").token);
    }
    out
}

/// Nemotron 3 Nano's blocks (Mamba-2, attention, relu² experts; `nemotron-h-moe`): 8
/// sequences decoded together, joining one step apart and leaving at different lengths, give
/// each the greedy text it gives alone — each Mamba state stays in its slot whoever shares the
/// step, and the experts' batched dispatch mixes no rows.
#[test]
fn eight_concurrent_nemotron_h_sequences_decode_as_eight_sequential_ones() {
    let dir = env_path("GANTRY_HF_REFERENCE").join("nemotron-h-moe-float32");
    let plugin = plugin("native", 8, 128);
    let (shared, mut exec) = plugin
        .load_model(&st_desc("nemotron-h-moe", &dir))
        .expect("load the Nemotron-H checkpoint");
    assert_eq!(shared.info().architecture, "NemotronHForCausalLM");
    assert!(shared.info().recurrent_state_bytes > 0);
    let s = Sampling::greedy();
    let prompts: Vec<Vec<i32>> = (0..8)
        .map(|i| {
            (0..5 + 3 * i)
                .map(|j| 2 + (i * 37 + j * 11) % 250)
                .collect()
        })
        .collect();
    let lens: Vec<usize> = (0..8).map(|i| 10 + 2 * i).collect();
    let alone: Vec<Vec<i32>> = prompts
        .iter()
        .zip(&lens)
        .map(|(p, &n)| {
            let seq = exec.seq_open().expect("open");
            let out = greedy(&mut exec, seq, p, n, &s);
            exec.seq_release(seq);
            out
        })
        .collect();

    // Sequence i joins at step i (its whole prompt in that step, beside the others' decode
    // tokens) and leaves once it has its tokens.
    let seqs: Vec<u64> = (0..8).map(|_| exec.seq_open().expect("open")).collect();
    let mut got: Vec<Vec<i32>> = vec![Vec::new(); 8];
    for step in 0.. {
        let mut fed: Vec<(usize, Vec<i32>, bool)> = Vec::new();
        for i in 0..8 {
            if step == i {
                fed.push((i, prompts[i].clone(), true));
            } else if step > i && got[i].len() < lens[i] {
                fed.push((i, vec![*got[i].last().expect("a token")], false));
            }
        }
        if fed.is_empty() {
            break;
        }
        let entries: Vec<StepEntry<'_>> = fed
            .iter()
            .map(|(i, t, fresh)| entry(seqs[*i], t, *fresh, &s))
            .collect();
        let r = exec.step(&entries).expect("a batched step");
        for ((i, _, _), r) in fed.iter().zip(r) {
            got[*i].push(r.expect("a sample").token);
            if got[*i].len() == lens[*i] {
                exec.seq_release(seqs[*i]);
            }
        }
    }
    assert_eq!(got, alone);
}
