//! Times the native engine's steps on a model directory, without the node: a prompt's prefill
//! and decode steps at batch sizes 1, 4 and 8, median of a bounded number of steps (for
//! profiling: `perf record` this binary).
//!
//! `cargo run --release -p gantry-engine-native --example step_time -- DIR [THREADS]`

use std::path::PathBuf;
use std::time::Instant;

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{EngineConfig, Format, ModelDescriptor, Sampling, StepEntry};
use gantry_engine_native::NativeEngine;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().ok_or("usage: step_time DIR [THREADS]")?);
    let threads: u32 = args.next().map(|t| t.parse()).transpose()?.unwrap_or(2);
    let engine = NativeEngine::create(
        EngineConfig {
            n_threads: threads,
            max_batch_size: 8,
            context_length: 1024,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )?;
    let t0 = Instant::now();
    let model = engine.load_model(&ModelDescriptor::new(
        "m",
        dir.join("model.safetensors"),
        Format::Safetensors,
    ))?;
    println!("load: {:.2} s", t0.elapsed().as_secs_f64());
    let prompt = model.tokenize(
        "Read these notes and summarise them in three sentences. The city council met on Tuesday \
         to discuss the new library, the repair of the old bridge over the river, and a plan to \
         plant two hundred trees along the main street before winter."
            .as_bytes(),
        true,
        false,
    )?;
    let greedy = Sampling::greedy();
    for batch in [1usize, 4, 8] {
        let seqs: Vec<u64> = (0..batch)
            .map(|_| model.seq_open())
            .collect::<Result<_, _>>()?;
        // Prefill: every sequence's prompt in one step (the first few tokens differ so the
        // prefix cache cannot serve them).
        let prompts: Vec<Vec<i32>> = (0..batch)
            .map(|i| {
                let mut p = prompt.clone();
                p[1] = p[1].wrapping_add(i as i32 + 1000 * batch as i32);
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
        let t = Instant::now();
        let mut next: Vec<i32> = model
            .step(&entries)?
            .into_iter()
            .map(|r| r.map_or(0, |r| r.token))
            .collect();
        let prefill = t.elapsed().as_secs_f64();
        let mut times = Vec::new();
        for _ in 0..24 {
            let feeds: Vec<[i32; 1]> = next.iter().map(|&t| [t]).collect();
            let entries: Vec<StepEntry<'_>> = seqs
                .iter()
                .zip(&feeds)
                .map(|(&seq, f)| StepEntry {
                    seq,
                    tokens: f,
                    sample: Some(&greedy),
                    fresh: false,
                    allowed: None,
                    sample_all: false,
                })
                .collect();
            let t = Instant::now();
            next = model
                .step(&entries)?
                .into_iter()
                .map(|r| r.map_or(0, |r| r.token))
                .collect();
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!(
            "batch {batch}: prefill {} tokens in {:.1} ms ({:.0} tok/s); decode step median {:.1} ms ({:.1} tok/s)",
            prompt.len() * batch,
            prefill * 1e3,
            (prompt.len() * batch) as f64 / prefill,
            med * 1e3,
            batch as f64 / med
        );
        for s in seqs {
            model.seq_release(s);
        }
    }
    Ok(())
}
