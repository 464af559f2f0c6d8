//! Times the native engine's decode steps with LoRA adapters (ABI 1.6), without the node: a
//! batch of four sequences all on the base model, all on one adapter, and two on each of two
//! adapters; the fastest, first-quartile and median step of each, the configurations
//! interleaved over a few rounds so a busy machine affects them alike. Then the adapters' own
//! work alone (every targeted projection of every layer for four rows, one run and two runs),
//! which a busy machine's noise hides in the whole steps.
//!
//! `cargo run --release -p gantry-engine-native --example adapter_step_time -- MODEL_DIR \
//!  ADAPTER_DIR ADAPTER_DIR [THREADS]` (e.g. SmolLM2-135M-Instruct f32 with the test adapters
//! `pirate/` and `formal/`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    AdapterDescriptor, EngineConfig, Format, ModelDescriptor, Sampling, StepEntry,
};
use gantry_engine_native::config::ModelConfig;
use gantry_engine_native::cpu::lora::Runs;
use gantry_engine_native::lora::{AdapterRun, LoraPair, LoraWeights, Target};
use gantry_engine_native::{DecoderModel, NativeEngine, NativeModel};

const STEPS: usize = 24;
const ROUNDS: usize = 5;

/// Decode-step times (ms) of one batch whose sequences run `adapters`.
fn decode(m: &NativeModel, prompt: &[i32], adapters: &[u64], round: usize) -> Vec<f64> {
    let greedy = Sampling::greedy();
    let seqs: Vec<u64> = adapters
        .iter()
        .map(|&a| {
            let s = m.seq_open().expect("seq_open");
            m.seq_set_adapter(s, a).expect("seq_set_adapter");
            s
        })
        .collect();
    // Distinct prompts, evaluated whole (no prefix cache).
    let prompts: Vec<Vec<i32>> = (0..seqs.len())
        .map(|i| {
            let mut p = prompt.to_vec();
            p[1] = p[1].wrapping_add((i + 10 * round) as i32 + 1);
            p
        })
        .collect();
    let entries: Vec<StepEntry<'_>> = seqs
        .iter()
        .zip(&prompts)
        .map(|(&seq, p)| StepEntry {
            seq,
            tokens: p,
            sample: Some(&greedy),
            fresh: true,
            allowed: None,
            sample_all: false,
        })
        .collect();
    let mut next: Vec<[i32; 1]> = m
        .step(&entries)
        .expect("prefill")
        .into_iter()
        .map(|r| [r.map_or(0, |r| r.token)])
        .collect();
    let mut times = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let entries: Vec<StepEntry<'_>> = seqs
            .iter()
            .zip(&next)
            .map(|(&seq, t)| StepEntry {
                seq,
                tokens: t,
                sample: Some(&greedy),
                fresh: false,
                allowed: None,
                sample_all: false,
            })
            .collect();
        let t = Instant::now();
        let out = m.step(&entries).expect("decode");
        times.push(t.elapsed().as_secs_f64() * 1e3);
        next = out
            .into_iter()
            .map(|r| [r.map_or(0, |r| r.token)])
            .collect();
    }
    for s in seqs {
        m.seq_release(s);
    }
    times
}

/// A rank-8 adapter of every projection with made-up values (the timing does not look at them).
fn synthetic(cfg: &ModelConfig) -> LoraWeights {
    let r = 8;
    let layers = (0..cfg.n_layers)
        .map(|_| {
            Target::ALL.map(|t| {
                let [d_out, d_in] = t.shape(cfg);
                Some(LoraPair {
                    rank: r,
                    d_in,
                    d_out,
                    a: (0..r * d_in)
                        .map(|i| (i as f32 * 0.37).sin() * 0.01)
                        .collect(),
                    b: (0..d_out * r)
                        .map(|i| (i as f32 * 0.11).cos() * 0.01)
                        .collect(),
                    scale: 2.0,
                })
            })
        })
        .collect();
    LoraWeights {
        name: "synthetic".into(),
        layers,
    }
}

/// Median time (ms) of the adapters' work of one decode step of four rows under `runs`.
fn adapter_work(cfg: &ModelConfig, loaded: &HashMap<u64, LoraWeights>, runs: &[AdapterRun]) -> f64 {
    let rows = 4;
    let bufs: Vec<(Vec<f32>, Vec<f32>)> = Target::ALL
        .iter()
        .map(|t| {
            let [d_out, d_in] = t.shape(cfg);
            (vec![0.5; rows * d_in], vec![0.0; rows * d_out])
        })
        .collect();
    let mut bufs = bufs;
    let mut runs = Runs::new(runs, loaded).expect("runs");
    let mut times = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        for layer in 0..cfg.n_layers {
            for (target, (x, y)) in Target::ALL.iter().zip(&mut bufs) {
                runs.apply(layer, *target, x, y);
            }
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: adapter_step_time MODEL_DIR ADAPTER_DIR ADAPTER_DIR [THREADS]";
    let dir = PathBuf::from(args.next().ok_or(usage)?);
    let a1 = PathBuf::from(args.next().ok_or(usage)?);
    let a2 = PathBuf::from(args.next().ok_or(usage)?);
    let threads: u32 = args.next().map(|t| t.parse()).transpose()?.unwrap_or(2);
    let engine = NativeEngine::create(
        EngineConfig {
            n_threads: threads,
            max_batch_size: 4,
            context_length: 512,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )?;
    let model = engine.load_model(&ModelDescriptor::new(
        "m",
        dir.join("model.safetensors"),
        Format::Safetensors,
    ))?;
    let load = |p: &PathBuf| {
        model.adapter_load(&AdapterDescriptor {
            name: p.display().to_string(),
            path: p.clone(),
            format: Format::Safetensors,
            scale: 1.0,
        })
    };
    let (x, y) = (load(&a1)?.id, load(&a2)?.id);
    let prompt = model.tokenize(
        "Read these notes and summarise them in three sentences. The city council met on Tuesday \
         to discuss the new library, the repair of the old bridge over the river, and a plan to \
         plant two hundred trees along the main street before winter."
            .as_bytes(),
        true,
        false,
    )?;
    let configs: [(&str, [u64; 4]); 3] = [
        ("4 base", [0; 4]),
        ("4 on one adapter", [x; 4]),
        ("2 + 2 on two adapters", [x, x, y, y]),
    ];
    let mut times = vec![Vec::new(); configs.len()];
    for round in 0..ROUNDS {
        for (i, (_, adapters)) in configs.iter().enumerate() {
            times[i].extend(decode(&model, &prompt, adapters, round));
        }
    }
    println!(
        "decode step, batch of 4, {threads} threads, {} steps each ({ROUNDS} rounds interleaved):",
        STEPS * ROUNDS
    );
    for ((name, _), t) in configs.iter().zip(&mut times) {
        t.sort_by(f64::total_cmp);
        let q = |f: f64| t[((t.len() - 1) as f64 * f) as usize];
        println!(
            "  {name:<22} min {:.2} ms, p25 {:.2} ms, median {:.2} ms",
            q(0.0),
            q(0.25),
            q(0.5)
        );
    }
    let cfg = DecoderModel::model_config(&dir)?;
    let loaded: HashMap<u64, LoraWeights> = [(1, synthetic(&cfg)), (2, synthetic(&cfg))].into();
    let run = |rows, adapter| AdapterRun { rows, adapter };
    println!("the adapters' work alone, 4 rows, every projection of every layer (median of 200):");
    for (name, runs) in [
        ("4 base", vec![]),
        ("4 on one adapter", vec![run(0..4, 1)]),
        ("2 + 2 on two adapters", vec![run(0..2, 1), run(2..4, 2)]),
    ] {
        println!("  {name:<22} {:.3} ms", adapter_work(&cfg, &loaded, &runs));
    }
    Ok(())
}
