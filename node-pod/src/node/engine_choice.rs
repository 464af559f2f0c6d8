//! Node, model load, before the engine is fixed: when several loaded plugins support a model
//! (same format and architecture: two engines reading GGUF, or CPU and CUDA builds of one
//! engine) and its config pins none (`engine`), each candidate runs a bounded benchmark on the
//! model and the best by the rule below serves it. `/v1/status` shows the figures as the
//! model's `engineChoice`; `gantry-node engines bench` runs the same benchmark by hand.
//!
//! The benchmark, per candidate, one at a time (each unloaded before the next loads): load the
//! model with one sequence, one prefill of [`PROMPT`] with a greedy sample (time to first
//! token), [`DECODE_TOKENS`] greedy decode steps (tokens per second), unload. Peak memory is
//! the larger of the engine's `bytes_used` and what was measured: the process's resident
//! memory on a CPU node (the model's worker in `process` isolation), the devices' free memory
//! on a CUDA node.
//!
//! The rule: a candidate that failed, or whose peak is above 90 % of the node's memory budget
//! (the RAM or VRAM limit, else the machine's RAM or the devices' total), is out. Of the rest,
//! the highest tokens per second wins; candidates within 5 % of the best count as equal and
//! the lower time to first token wins among them, then the lower peak, then engine id order.
//!
//! Results are cached in `<cacheDir>/engine-choice.json`, keyed by the model's fingerprint
//! (size plus SHA-256 of its first and last MiB: cheap on multi-GB files, and it changes when
//! the file does), the engine's id and version, and the device (backend, threads or GPU
//! names), so a restart or a reload does not benchmark again. `GANTRY_ENGINE_CHOICE_CACHE=off`
//! switches the cache off.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Instant;

use gantry_api::{EngineBench, EngineChoice};
use gantry_engine_abi::{ModelDescriptor, Sampling, StepEntry};
use sha2::{Digest, Sha256};

use crate::devices::{DeviceSnapshot, measured_use};
use crate::engine_host::Plugin;

/// The benchmark prompt (about 60 tokens for common tokenizers).
pub const PROMPT: &str = "Engine benchmark. Read the notes and answer in one sentence. The city \
    council met on Tuesday to discuss the new library, the repair of the old bridge over the \
    river, and a plan to plant two hundred trees along the main street before the winter.";
/// Greedy decode steps timed after the first token.
pub const DECODE_TOKENS: usize = 16;
/// Share of the memory budget above which a candidate is rejected.
pub const MEMORY_SHARE: f64 = 0.90;
/// Tokens-per-second band within which candidates count as equal.
pub const TIE_BAND: f64 = 0.05;
/// The rule, as `/v1/status` states it.
pub const RULE: &str = "highest decode tokens/s; within 5 % of the best: lowest TTFT, then lowest peak memory, then engine id; failed candidates and those above 90 % of the memory budget are out";

/// Where the candidate runs, for the memory measurement.
pub struct Probe<'a> {
    /// The node's budget for the pool the model lives in (its limit, else the machine's).
    pub budget_bytes: u64,
    /// On a CUDA node: a fresh reading of the devices and the model's device ids, for the
    /// device's own measure of the load (`devices::measured_use`); `None` on a CPU node.
    pub devices: Option<(&'a dyn Fn() -> DeviceSnapshot, &'a [u32])>,
}

/// Benchmark one candidate. Never panics; a failure is a `failed` result with the reason.
pub fn bench(
    plugin_id: &str,
    plugin: &Plugin,
    desc: &ModelDescriptor,
    probe: &Probe<'_>,
) -> EngineBench {
    let version = plugin.info().engine_version.clone();
    let mut result = EngineBench {
        plugin: plugin_id.to_string(),
        version,
        outcome: "failed".into(),
        tokens_per_second: None,
        ttft_ms: None,
        peak_bytes: None,
        message: None,
        cached: false,
    };
    let rss_before = rss_bytes(None).unwrap_or(0);
    let dev_before = probe.devices.map(|(read, _)| read());
    let desc = ModelDescriptor {
        max_sequences: 1,
        ..desc.clone()
    };
    let (shared, mut exec) = match plugin.load_model(&desc) {
        Ok(x) => x,
        Err(e) => {
            result.message = Some(format!("load failed: {e}"));
            return result;
        }
    };
    let mut run = || -> Result<(f64, f64), String> {
        let prompt = shared
            .tokenize(PROMPT, true, false)
            .map_err(|e| format!("tokenize: {e}"))?;
        if prompt.is_empty() {
            return Err("the prompt tokenized to nothing".into());
        }
        let seq = exec
            .seq_open()
            .map_err(|e| format!("open a sequence: {e}"))?;
        let greedy = Sampling::greedy();
        let step = |exec: &mut crate::engine_host::ModelExec, tokens: &[i32], fresh: bool| {
            exec.step(&[StepEntry {
                seq,
                tokens,
                sample: Some(&greedy),
                fresh,
                allowed: None,
                sample_all: false,
            }])
            .map_err(|e| format!("step: {e}"))?
            .into_iter()
            .next()
            .flatten()
            .map(|t| t.token)
            .ok_or_else(|| "the engine sampled no token".to_string())
        };
        let t0 = Instant::now();
        let out = (|| {
            let mut next = step(&mut exec, &prompt, true)?;
            let ttft = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            for _ in 0..DECODE_TOKENS {
                next = step(&mut exec, &[next], false)?;
            }
            let decode = t1.elapsed().as_secs_f64();
            Ok((ttft, DECODE_TOKENS as f64 / decode.max(1e-9)))
        })();
        exec.seq_release(seq);
        out
    };
    let measured = run();
    // What the load held at its largest: after the run every weight has been read.
    let reported = shared.info().bytes_used;
    let measured_bytes = match (probe.devices, &dev_before) {
        (Some((read, on)), Some(before)) => measured_use(before, &read(), on),
        _ => match shared.worker_pid() {
            Some(pid) => rss_bytes(Some(pid)),
            None => rss_bytes(None).map(|now| now.saturating_sub(rss_before)),
        },
    };
    let peak = reported.max(measured_bytes.unwrap_or(0));
    drop(exec);
    drop(shared);
    result.peak_bytes = Some(peak);
    match measured {
        Ok((ttft, tps)) => {
            result.ttft_ms = Some(ttft * 1e3);
            result.tokens_per_second = Some(tps);
            let limit = (probe.budget_bytes as f64 * MEMORY_SHARE) as u64;
            if probe.budget_bytes > 0 && peak > limit {
                result.outcome = "rejected".into();
                result.message = Some(format!(
                    "peak memory {} is above 90 % of the budget ({} of {})",
                    crate::memory::human(peak),
                    crate::memory::human(limit),
                    crate::memory::human(probe.budget_bytes)
                ));
            } else {
                result.outcome = "slower".into();
            }
        }
        Err(e) => result.message = Some(e),
    }
    result
}

/// Apply the rule: mark the winner `chosen` and return its index, or `None` when every
/// candidate failed or was rejected. `results` are in engine id order.
pub fn decide(results: &mut [EngineBench]) -> Option<usize> {
    let passing: Vec<usize> = (0..results.len())
        .filter(|&i| results[i].outcome == "slower" || results[i].outcome == "chosen")
        .collect();
    let best_tps = passing
        .iter()
        .filter_map(|&i| results[i].tokens_per_second)
        .fold(0.0, f64::max);
    let tied = passing
        .iter()
        .copied()
        .filter(|&i| results[i].tokens_per_second.unwrap_or(0.0) >= best_tps * (1.0 - TIE_BAND));
    let key = |i: usize| {
        (
            results[i].ttft_ms.unwrap_or(f64::MAX),
            results[i].peak_bytes.unwrap_or(u64::MAX),
            i,
        )
    };
    let winner = tied.min_by(|&a, &b| {
        let (ta, pa, ia) = key(a);
        let (tb, pb, ib) = key(b);
        ta.total_cmp(&tb).then(pa.cmp(&pb)).then(ia.cmp(&ib))
    })?;
    for (i, r) in results.iter_mut().enumerate() {
        if r.outcome == "chosen" || r.outcome == "slower" {
            r.outcome = if i == winner { "chosen" } else { "slower" }.into();
        }
    }
    Some(winner)
}

/// The choice as `/v1/status` shows it.
pub fn status(results: Vec<EngineBench>, winner: usize) -> EngineChoice {
    EngineChoice {
        chosen: results[winner].plugin.clone(),
        rule: RULE.into(),
        candidates: results,
    }
}

/// Resident memory of a process (this one when `None`), from `/proc/<pid>/statm`.
pub fn rss_bytes(pid: Option<u32>) -> Option<u64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/statm"),
        None => "/proc/self/statm".to_string(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    let pages: u64 = text.split_whitespace().nth(1)?.parse().ok()?;
    // Every Linux platform Gantry runs on (x86-64, aarch64 with 4 KiB pages) uses 4 KiB
    // pages for anonymous and file memory; huge pages still count in 4 KiB units here.
    Some(pages * 4096)
}

/// The machine's RAM, from `/proc/meminfo`.
pub fn machine_ram_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Size plus SHA-256 of the first and last MiB of the model's primary file.
pub fn fingerprint(primary: &Path) -> std::io::Result<String> {
    const PART: u64 = 1 << 20;
    let mut f = std::fs::File::open(primary)?;
    let size = f.metadata()?.len();
    let mut h = Sha256::new();
    h.update(size.to_le_bytes());
    let mut buf = Vec::new();
    (&mut f).take(PART).read_to_end(&mut buf)?;
    h.update(&buf);
    if size > PART {
        buf.clear();
        f.seek(SeekFrom::Start(size.saturating_sub(PART).max(PART)))?;
        f.take(PART).read_to_end(&mut buf)?;
        h.update(&buf);
    }
    Ok(format!("{size}-{}", &hex::encode(h.finalize())[..32]))
}

/// The node's cache of benchmark results: one JSON object, key -> result.
pub struct ChoiceCache {
    path: Option<PathBuf>,
}

impl ChoiceCache {
    /// At `dir/engine-choice.json`; off (nothing read or written) without a directory or with
    /// `GANTRY_ENGINE_CHOICE_CACHE=off`.
    pub fn new(dir: Option<PathBuf>) -> Self {
        let off = std::env::var("GANTRY_ENGINE_CHOICE_CACHE").is_ok_and(|v| v == "off");
        Self {
            path: if off {
                None
            } else {
                dir.map(|d| d.join("engine-choice.json"))
            },
        }
    }

    pub fn key(fingerprint: &str, plugin: &str, version: &str, device: &str) -> String {
        format!("{fingerprint}|{plugin}@{version}|{device}")
    }

    fn read(&self) -> BTreeMap<String, EngineBench> {
        self.path
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    pub fn get(&self, key: &str) -> Option<EngineBench> {
        self.read()
            .remove(key)
            .map(|b| EngineBench { cached: true, ..b })
    }

    /// Record a result (a failed one too: a broken engine is not benchmarked again until its
    /// version changes). Written to a temporary file and renamed, so a crash leaves the old
    /// cache whole.
    pub fn put(&self, key: &str, result: &EngineBench) {
        let Some(path) = &self.path else {
            return;
        };
        let mut all = self.read();
        all.insert(
            key.to_string(),
            EngineBench {
                cached: false,
                ..result.clone()
            },
        );
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, serde_json::to_vec_pretty(&all).unwrap_or_default())?;
            std::fs::rename(&tmp, path)
        };
        if let Err(e) = write() {
            tracing::warn!(path = %path.display(), "cannot write the engine choice cache: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(plugin: &str, outcome: &str, tps: f64, ttft: f64, peak: u64) -> EngineBench {
        EngineBench {
            plugin: plugin.into(),
            version: "1".into(),
            outcome: outcome.into(),
            tokens_per_second: Some(tps),
            ttft_ms: Some(ttft),
            peak_bytes: Some(peak),
            message: None,
            cached: false,
        }
    }

    #[test]
    fn the_fastest_wins_and_near_ties_go_to_the_lower_ttft_then_peak_then_id() {
        let mut rs = vec![
            r("a", "slower", 100.0, 50.0, 10),
            r("b", "slower", 120.0, 80.0, 10),
        ];
        assert_eq!(decide(&mut rs), Some(1));
        assert_eq!(
            (rs[0].outcome.as_str(), rs[1].outcome.as_str()),
            ("slower", "chosen")
        );
        // Within 5 %: the lower TTFT.
        let mut rs = vec![
            r("a", "slower", 100.0, 50.0, 10),
            r("b", "slower", 104.0, 80.0, 10),
        ];
        assert_eq!(decide(&mut rs), Some(0));
        // Same TTFT: the lower peak; then the id order.
        let mut rs = vec![
            r("a", "slower", 100.0, 50.0, 20),
            r("b", "slower", 100.0, 50.0, 10),
        ];
        assert_eq!(decide(&mut rs), Some(1));
        let mut rs = vec![
            r("a", "slower", 100.0, 50.0, 10),
            r("b", "slower", 100.0, 50.0, 10),
        ];
        assert_eq!(decide(&mut rs), Some(0));
    }

    #[test]
    fn failed_and_rejected_candidates_never_win() {
        let mut rs = vec![
            r("a", "failed", 0.0, 0.0, 0),
            r("b", "rejected", 500.0, 1.0, 1),
            r("c", "slower", 10.0, 90.0, 5),
        ];
        assert_eq!(decide(&mut rs), Some(2));
        assert_eq!(rs[1].outcome, "rejected");
        let mut none = vec![r("a", "failed", 0.0, 0.0, 0)];
        assert_eq!(decide(&mut none), None);
    }

    #[test]
    fn the_cache_round_trips_and_can_be_switched_off() {
        let dir = tempfile::tempdir().expect("tmp");
        let cache = ChoiceCache::new(Some(dir.path().to_path_buf()));
        let key = ChoiceCache::key("42-ab", "llama_cpp", "0.1.0", "cpu/2t");
        assert!(cache.get(&key).is_none());
        cache.put(&key, &r("llama_cpp", "chosen", 20.0, 70.0, 1 << 30));
        let got = cache.get(&key).expect("cached");
        assert!(got.cached);
        assert_eq!(got.tokens_per_second, Some(20.0));
        assert!(ChoiceCache::new(None).get(&key).is_none());
    }

    #[test]
    fn a_fingerprint_changes_with_the_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, vec![7u8; 3 << 20]).expect("write");
        let a = fingerprint(&p).expect("fp");
        assert_eq!(a, fingerprint(&p).expect("fp"));
        let mut bytes = vec![7u8; 3 << 20];
        bytes[(3 << 20) - 1] = 8;
        std::fs::write(&p, bytes).expect("write");
        assert_ne!(a, fingerprint(&p).expect("fp"));
    }
}
