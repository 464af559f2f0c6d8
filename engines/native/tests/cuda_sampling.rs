//! Native engine, CUDA backend: sampling on the device and decode steps through CUDA graphs,
//! checked on a GPU (`scripts/gpu-check.sh` and `scripts/gpu-decode.sh` run them with
//! `--include-ignored`; they are listed as ignored everywhere else, never as passed).
//!
//! - The device sampler draws from the exact distribution (temperature, top-k, top-p, min-p
//!   as the CPU sampler applies them), by a chi-square test on a small vocabulary.
//! - It agrees with the host sampler on greedy choices, log-probabilities, top
//!   log-probabilities, logit bias, penalties and allowed-token masks.
//! - Greedy decoding on CUDA gives the CPU backend's tokens on the f32 tiny models.
//! - A seeded request draws the same tokens alone and inside a batch of 64 (whose decode
//!   steps run through the graph of that size).

use std::path::Path;

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{Backend as AbiBackend, EngineConfig, Sampling, StepEntry};
use gantry_engine_native::backend::SampleRow;
use gantry_engine_native::cuda::{CudaBackend, unavailable};
use gantry_engine_native::sampler::SeqSampler;
use gantry_engine_native::weights::Weights;
use gantry_engine_native::{DecoderModel, NativeEngine};
use gantry_testkit::hf::{HfFamily, write_tiny_hf};

mod common;
use common::*;

/// A CUDA backend on the tiny Llama (f32) and its vocabulary size.
fn tiny_backend(dir: &Path) -> (CudaBackend, usize) {
    write_tiny_hf(dir, HfFamily::Llama, 7).expect("tiny model");
    let mc = DecoderModel::model_config(dir).expect("config");
    let primary = st_desc("tiny", dir).primary_file;
    let weights = Weights::open(dir, &primary).expect("weights");
    let b = CudaBackend::new(&mc, &weights, 8, 4, 0).expect("cuda");
    (b, mc.vocab)
}

/// The CPU sampler's distribution over `logits` (finite entries only): top-k, then top-p and
/// min-p on the untempered probabilities, then temperature over what is kept.
fn exact(logits: &[f32], p: &Sampling) -> Vec<(usize, f64)> {
    let mut c: Vec<(usize, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i, l))
        .collect();
    c.sort_by(|a, b| b.1.total_cmp(&a.1));
    if p.top_k > 0 {
        c.truncate(p.top_k as usize);
    }
    let max = c[0].1;
    let probs: Vec<f64> = c.iter().map(|x| f64::from(x.1 - max).exp()).collect();
    let total: f64 = probs.iter().sum();
    let mut keep = c.len();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        for (i, pr) in probs.iter().enumerate() {
            cum += pr / total;
            if cum >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        keep = keep.min(
            probs
                .iter()
                .take_while(|&&pr| pr >= f64::from(p.min_p))
                .count(),
        );
    }
    c.truncate(keep.max(1));
    let w: Vec<f64> = c
        .iter()
        .map(|x| f64::from((x.1 - max) / p.temperature).exp())
        .collect();
    let z: f64 = w.iter().sum();
    c.iter().zip(w).map(|(x, w)| (x.0, w / z)).collect()
}

fn skip_without_gpu() -> bool {
    if let Some(why) = unavailable() {
        eprintln!("not run: no usable GPU here ({why})");
        return true;
    }
    false
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn the_device_sampler_draws_from_the_exact_distribution() {
    if skip_without_gpu() {
        panic!("this GPU test ran without a GPU");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut b, vocab) = tiny_backend(dir.path());
    let mut logits = vec![f32::NEG_INFINITY; vocab];
    for (i, v) in [2.0f32, 1.6, 1.1, 0.5, 0.2, -0.4, -0.9, -1.5]
        .iter()
        .enumerate()
    {
        logits[3 + 5 * i] = *v;
    }
    let base = Sampling {
        temperature: 1.0,
        seed: 7,
        ..Sampling::greedy()
    };
    let cases = [
        ("temperature 1", base.clone()),
        (
            "temperature 0.7, top_k 4",
            Sampling {
                temperature: 0.7,
                top_k: 4,
                ..base.clone()
            },
        ),
        (
            "top_p 0.8",
            Sampling {
                top_p: 0.8,
                ..base.clone()
            },
        ),
        (
            "temperature 1.3, min_p 0.15",
            Sampling {
                temperature: 1.3,
                min_p: 0.15,
                ..base.clone()
            },
        ),
        (
            "top_k 6, top_p 0.9, min_p 0.05",
            Sampling {
                top_k: 6,
                top_p: 0.9,
                min_p: 0.05,
                ..base.clone()
            },
        ),
    ];
    // Chi-square critical values at p = 0.001 for 1..7 degrees of freedom.
    let critical = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32];
    let (rows, calls) = (64usize, 94usize);
    for (name, p) in cases {
        let want = exact(&logits, &p);
        let mut counts = vec![0usize; vocab];
        let batch: Vec<f32> = logits.iter().copied().cycle().take(rows * vocab).collect();
        for call in 0..calls {
            let r: Vec<SampleRow<'_>> = (0..rows)
                .map(|i| SampleRow {
                    params: &p,
                    allowed: None,
                    generated: &[],
                    draw: (call * rows + i) as u64,
                })
                .collect();
            for s in b.sample_logits(&batch, &r).expect("sample") {
                counts[s.token as usize] += 1;
            }
        }
        let n = (rows * calls) as f64;
        let kept: Vec<usize> = want.iter().map(|w| w.0).collect();
        for (t, &c) in counts.iter().enumerate() {
            assert!(
                c == 0 || kept.contains(&t),
                "{name}: drew token {t}, which the chain cuts"
            );
        }
        let chi2: f64 = want
            .iter()
            .map(|&(t, pr)| (counts[t] as f64 - n * pr).powi(2) / (n * pr))
            .sum();
        let df = want.len().saturating_sub(1);
        eprintln!(
            "{name}: {} tokens kept, chi-square {chi2:.2} ({df} degrees of freedom, {n} draws)",
            want.len()
        );
        if df > 0 {
            assert!(
                chi2 < critical[df - 1],
                "{name}: chi-square {chi2} over {}",
                critical[df - 1]
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn the_device_sampler_agrees_with_the_host_sampler() {
    if skip_without_gpu() {
        panic!("this GPU test ran without a GPU");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut b, vocab) = tiny_backend(dir.path());
    let mut x = 12345u64;
    let logits: Vec<f32> = (0..vocab)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        })
        .collect();
    let history = [5i32, 9, 5, 17, 5, 9];
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    for t in [4usize, 9, 30, 31, 32, vocab - 1] {
        mask[t / 32] |= 1 << (t % 32);
    }
    let g = Sampling::greedy();
    let cases: Vec<(&str, Sampling, Option<&[u32]>)> = vec![
        ("greedy", g.clone(), None),
        (
            "logprobs",
            Sampling {
                want_logprob: true,
                top_logprobs: 5,
                ..g.clone()
            },
            None,
        ),
        (
            "bias and penalties",
            Sampling {
                want_logprob: true,
                logit_bias: vec![(11, 3.5), (5, 2.0), (9, -1.0)],
                repetition_penalty: 1.3,
                presence_penalty: 0.4,
                frequency_penalty: 0.3,
                penalty_last_n: 4,
                ..g.clone()
            },
            None,
        ),
        (
            "mask",
            Sampling {
                want_logprob: true,
                top_logprobs: 3,
                ..g.clone()
            },
            Some(&mask),
        ),
    ];
    for (name, p, allowed) in &cases {
        let mut host = SeqSampler::new(p);
        for &t in &history {
            host.record(t);
        }
        let want = host
            .sample(&mut logits.clone(), p, *allowed)
            .expect("host sample");
        let row = [SampleRow {
            params: p,
            allowed: *allowed,
            generated: &history,
            draw: 6,
        }];
        let got = b
            .sample_logits(&logits, &row)
            .expect("device sample")
            .remove(0);
        eprintln!("{name}: host {want:?}, device {got:?}");
        assert_eq!(got.token, want.token, "{name}");
        if p.want_logprob {
            assert!((got.logprob - want.logprob).abs() < 1e-4, "{name}: logprob");
        }
        assert_eq!(got.top.len(), want.top.len(), "{name}: top logprobs");
        for (a, w) in got.top.iter().zip(&want.top) {
            assert_eq!(a.0, w.0, "{name}: top ids");
            assert!((a.1 - w.1).abs() < 1e-4, "{name}: top logprob of {}", a.0);
        }
    }
    // Draws under a mask stay inside it.
    let p = Sampling {
        temperature: 1.5,
        seed: 3,
        ..g
    };
    let rows: Vec<SampleRow<'_>> = (0..64)
        .map(|i| SampleRow {
            params: &p,
            allowed: Some(&mask),
            generated: &[],
            draw: i,
        })
        .collect();
    let batch: Vec<f32> = logits.iter().copied().cycle().take(64 * vocab).collect();
    for s in b.sample_logits(&batch, &rows).expect("sample") {
        let t = s.token as usize;
        assert!(
            mask[t / 32] & (1 << (t % 32)) != 0,
            "token {t} is outside the mask"
        );
    }
}

fn engine(backend: AbiBackend, max_batch: u32) -> NativeEngine {
    NativeEngine::create(
        EngineConfig {
            backend,
            max_batch_size: max_batch,
            context_length: 128,
            n_threads: 2,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )
    .expect("engine")
}

/// Decode `steps` tokens for each prompt in one batch; the tokens of each sequence.
fn decode(
    model: &impl Model,
    prompts: &[Vec<i32>],
    params: &[Sampling],
    steps: usize,
) -> Vec<Vec<i32>> {
    let seqs: Vec<u64> = prompts
        .iter()
        .map(|_| model.seq_open().expect("seq"))
        .collect();
    let mut feed: Vec<Vec<i32>> = prompts.to_vec();
    let mut out = vec![Vec::new(); prompts.len()];
    for _ in 0..steps {
        let entries: Vec<StepEntry<'_>> = seqs
            .iter()
            .enumerate()
            .map(|(i, &seq)| StepEntry {
                seq,
                tokens: &feed[i],
                sample: Some(&params[i]),
                fresh: true,
                allowed: None,
                sample_all: false,
            })
            .collect();
        let r = model.step(&entries).expect("step");
        for (i, s) in r.into_iter().enumerate() {
            let t = s.expect("sampled").token;
            out[i].push(t);
            feed[i] = vec![t];
        }
    }
    for s in seqs {
        model.seq_release(s);
    }
    out
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn greedy_decoding_on_cuda_gives_the_cpu_backends_tokens() {
    if skip_without_gpu() {
        panic!("this GPU test ran without a GPU");
    }
    for family in HfFamily::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        write_tiny_hf(dir.path(), family, 11).expect("tiny model");
        let prompts = vec![vec![1, 5, 9, 13, 2, 7], vec![1, 4, 4, 8]];
        let params = vec![Sampling::greedy(); 2];
        let run = |backend| {
            let e = engine(backend, 4);
            let m = e.load_model(&st_desc("tiny", dir.path())).expect("load");
            decode(&m, &prompts, &params, 24)
        };
        let (cpu, gpu) = (run(AbiBackend::Cpu), run(AbiBackend::Cuda));
        eprintln!(
            "{}: cpu {cpu:?}\n{}: cuda {gpu:?}",
            family.name(),
            family.name()
        );
        // f32 checkpoints run f32 end to end on both: the same tokens. 16-bit ones round the
        // activations and K/V on the GPU: the first token must agree.
        if matches!(family, HfFamily::Llama | HfFamily::Gemma3) {
            assert_eq!(cpu, gpu, "{}", family.name());
        } else {
            assert_eq!(cpu[0][0], gpu[0][0], "{}", family.name());
            assert_eq!(cpu[1][0], gpu[1][0], "{}", family.name());
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn a_seeded_request_draws_the_same_alone_and_in_a_batch_of_64() {
    if skip_without_gpu() {
        panic!("this GPU test ran without a GPU");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), HfFamily::Llama, 5).expect("tiny model");
    let e = engine(AbiBackend::Cuda, 64);
    let m = e.load_model(&st_desc("tiny", dir.path())).expect("load");
    let seeded = Sampling {
        temperature: 0.9,
        top_p: 0.95,
        seed: 42,
        ..Sampling::greedy()
    };
    let prompt = vec![1, 6, 2, 8, 3];
    let alone = decode(
        &m,
        std::slice::from_ref(&prompt),
        std::slice::from_ref(&seeded),
        20,
    );
    let mut prompts: Vec<Vec<i32>> = (0..64).map(|i| vec![1, 3 + i % 20, 4, 7 + i % 5]).collect();
    let mut params: Vec<Sampling> = (0..64)
        .map(|i| Sampling {
            temperature: 1.0,
            seed: 1000 + i as u64,
            ..Sampling::greedy()
        })
        .collect();
    prompts[17] = prompt;
    params[17] = seeded;
    let batch = decode(&m, &prompts, &params, 20);
    eprintln!("alone {:?}\nin a batch of 64 {:?}", alone[0], batch[17]);
    assert_eq!(alone[0], batch[17]);
}
