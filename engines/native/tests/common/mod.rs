//! Shared support of the native engine's integration tests: the built plugins through the
//! node's engine host, model descriptors, and a greedy generation loop.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::path::{Path, PathBuf};

use gantry_engine_abi::{EngineConfig, Format, ModelDescriptor, Sampling, StepEntry};
use gantry_node::engine_host::{EngineRegistry, ModelExec, Plugin};

/// `target/<profile>`: the test binary lives in `target/<profile>/deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

pub fn plugin(id: &str, max_batch_size: u32, context_length: u32) -> Plugin {
    let dir = profile_dir().join("engines");
    let cfg = EngineConfig {
        n_threads: 2,
        max_batch_size,
        context_length,
        ..EngineConfig::default()
    };
    let reg = EngineRegistry::discover(&dir, &cfg);
    let rec = reg.get(id).unwrap_or_else(|| {
        panic!(
            "no {id} plugin under {}: build the workspace first",
            dir.display()
        )
    });
    rec.plugin()
        .cloned()
        .unwrap_or_else(|| panic!("{id} refused: {:?}", rec.summary().reason))
}

pub fn desc(id: &str, dir: &Path, primary: &Path, format: Format) -> ModelDescriptor {
    ModelDescriptor {
        model_dir: dir.to_path_buf(),
        ..ModelDescriptor::new(id, primary, format)
    }
}

pub fn st_desc(id: &str, dir: &Path) -> ModelDescriptor {
    let primary = if dir.join("model.safetensors").is_file() {
        dir.join("model.safetensors")
    } else {
        dir.join("model.safetensors.index.json")
    };
    desc(id, dir, &primary, Format::Safetensors)
}

pub fn env_path(var: &str) -> PathBuf {
    let p = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!("{var} is not set: run scripts/setup.sh (scripts/test.sh exports it)")
    });
    assert!(
        p.exists(),
        "{var}={} does not exist: run scripts/setup.sh",
        p.display()
    );
    p
}

/// Greedy continuation of every prompt, all sequences stepped together (prompt in one entry,
/// then one token per step); `join_at[i]` delays sequence i by that many steps.
pub fn generate(
    exec: &mut ModelExec,
    prompts: &[Vec<i32>],
    n: usize,
    join_at: &[usize],
) -> Vec<Vec<i32>> {
    let greedy = Sampling::greedy();
    let seqs: Vec<u64> = prompts
        .iter()
        .map(|_| exec.seq_open().expect("seq_open"))
        .collect();
    let mut feed: Vec<Option<Vec<i32>>> = vec![None; prompts.len()];
    let mut out: Vec<Vec<i32>> = vec![Vec::new(); prompts.len()];
    let mut step = 0;
    while out.iter().any(|o| o.len() < n) {
        let mut entries = Vec::new();
        let mut who = Vec::new();
        for i in 0..prompts.len() {
            if out[i].len() >= n || step < join_at.get(i).copied().unwrap_or(0) {
                continue;
            }
            let tokens: &[i32] = match &feed[i] {
                None => &prompts[i],
                Some(t) => t,
            };
            entries.push(StepEntry {
                seq: seqs[i],
                tokens,
                sample: Some(&greedy),
                fresh: false,
                allowed: None,
                sample_all: false,
            });
            who.push(i);
        }
        let results = exec.step(&entries).expect("step");
        drop(entries);
        for (i, r) in who.into_iter().zip(results) {
            let t = r.expect("sampled").token;
            out[i].push(t);
            feed[i] = Some(vec![t]);
        }
        step += 1;
    }
    for s in seqs {
        exec.seq_release(s);
    }
    out
}
