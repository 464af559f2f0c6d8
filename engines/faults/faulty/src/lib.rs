//! Fault-injection plugin (engine layer, tests only): a working toy engine whose models misbehave on cue.
//!
//! The model's behaviour comes from its primary file's stem:
//! - `panic*`: `step` panics (the SDK must turn it into INTERNAL);
//! - `hang*`: `step` never returns (for the node's watchdog tests);
//! - `abort*`: `step` aborts the process (SIGABRT);
//! - `segv*`: `step` writes through a null pointer (SIGSEGV);
//! - `oomkill*`: `step` ends the process with SIGKILL, which is what the kernel's OOM killer
//!   sends (a real OOM kill would need the test machine's memory);
//! - `slow*`: every `step` takes 25 ms (streams that last long enough to be cut);
//! - `sluggish*`: every `step` takes 250 ms (a candidate far slower than any real engine, even
//!   one on a contended CPU);
//! - `oom*`: `load_model` fails with OOM_VRAM;
//! - anything else: a deterministic toy — tokens are bytes, and the next
//!   token is the last one plus one (mod 256).
//!
//! Its id is `faulty`; tests write manifests for it (including two with the
//! same id, to test the conflict rule).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use gantry_engine_abi::ffi::GANTRY_MODALITY_COMPLETION;
use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    Backend, EngineConfig, EngineError, LogLevel, ModelDescriptor, ModelInfo, SampledToken, Status,
    StepEntry,
};

pub struct FaultyEngine {
    config: EngineConfig,
    log: HostLog,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Normal,
    Panic,
    Hang,
    Abort,
    Segv,
    OomKill,
    Slow,
    Sluggish,
}

pub struct FaultyModel {
    mode: Mode,
    max_sequences: u32,
    next: AtomicU64,
    /// Last token per open sequence.
    seqs: Mutex<HashMap<u64, i32>>,
}

impl Engine for FaultyEngine {
    type Model = FaultyModel;
    const ID: &'static str = "faulty";
    const VERSION: &'static str = "0.1.0";
    const BACKEND: Backend = Backend::Cpu;
    const DESCRIPTION: &'static str = "fault-injection engine for tests";

    fn create(config: EngineConfig, log: HostLog) -> Result<Self, EngineError> {
        log.log(LogLevel::Info, "faulty engine created");
        Ok(Self { config, log })
    }

    fn load_model(&self, desc: &ModelDescriptor) -> Result<FaultyModel, EngineError> {
        let stem = desc
            .primary_file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mode = if stem.starts_with("panic") {
            Mode::Panic
        } else if stem.starts_with("hang") {
            Mode::Hang
        } else if stem.starts_with("abort") {
            Mode::Abort
        } else if stem.starts_with("segv") {
            Mode::Segv
        } else if stem.starts_with("oomkill") {
            Mode::OomKill
        } else if stem.starts_with("slow") {
            Mode::Slow
        } else if stem.starts_with("sluggish") {
            Mode::Sluggish
        } else if stem.starts_with("oom") {
            return Err(EngineError::new(
                Status::OomVram,
                format!("{stem} does not fit (by design)"),
            ));
        } else {
            Mode::Normal
        };
        self.log.log(LogLevel::Info, &format!("loaded {stem}"));
        Ok(FaultyModel {
            mode,
            max_sequences: if desc.max_sequences > 0 {
                desc.max_sequences
            } else {
                self.config.max_batch_size.max(1)
            },
            next: AtomicU64::new(1),
            seqs: Mutex::new(HashMap::new()),
        })
    }
}

impl FaultyModel {
    fn seqs(&self) -> std::sync::MutexGuard<'_, HashMap<u64, i32>> {
        self.seqs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Model for FaultyModel {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            architecture: "toy".into(),
            vocab_size: 256,
            context_length: 256,
            trained_context_length: 256,
            kv_capacity_tokens: 256 * u64::from(self.max_sequences),
            max_sequences: self.max_sequences,
            modalities: GANTRY_MODALITY_COMPLETION,
            ..ModelInfo::default()
        }
    }

    fn tokenize(
        &self,
        text: &[u8],
        _add_special: bool,
        _parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        Ok(text.iter().map(|b| i32::from(*b)).collect())
    }

    fn detokenize(&self, tokens: &[i32], _render_special: bool) -> Result<Vec<u8>, EngineError> {
        Ok(tokens.iter().map(|t| (*t & 0xff) as u8).collect())
    }

    fn seq_open(&self) -> Result<u64, EngineError> {
        let mut seqs = self.seqs();
        if seqs.len() >= self.max_sequences as usize {
            return Err(EngineError::new(Status::OomVram, "no free sequence slot"));
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        seqs.insert(id, 0);
        Ok(id)
    }

    fn seq_release(&self, seq: u64) {
        self.seqs().remove(&seq);
    }

    fn step(&self, entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError> {
        match self.mode {
            Mode::Panic => panic!("injected panic in step"),
            Mode::Hang => loop {
                std::thread::park();
            },
            Mode::Abort => std::process::abort(),
            Mode::Segv => segfault(),
            Mode::OomKill => sigkill(),
            Mode::Slow => std::thread::sleep(std::time::Duration::from_millis(25)),
            Mode::Sluggish => std::thread::sleep(std::time::Duration::from_millis(250)),
            Mode::Normal => {}
        }
        let mut seqs = self.seqs();
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let last = seqs
                .get_mut(&e.seq)
                .ok_or_else(|| EngineError::internal(format!("unknown sequence {}", e.seq)))?;
            if let Some(t) = e.tokens.last() {
                *last = *t;
            }
            out.push(e.sample.map(|_| SampledToken {
                token: (*last + 1) % 256,
                logprob: 0.0,
                top: Vec::new(),
            }));
        }
        Ok(out)
    }

    fn embed(&self, _tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::unsupported(
            "faulty is not an embedding engine",
        ))
    }
}

/// The fault `segv*` models inject: a write through a null pointer.
#[allow(unsafe_code)] // The one deliberate fault of this plugin; nothing else here is unsafe.
fn segfault() -> ! {
    // SAFETY: none, by design: this write is the segmentation fault the test asks for. It
    // runs only for models named `segv*`, which only the fault tests load.
    unsafe { std::ptr::null_mut::<u8>().write_volatile(1) };
    unreachable!("a write through a null pointer returned")
}

/// The fault `oomkill*` models inject: SIGKILL, as the kernel's OOM killer sends it.
#[allow(unsafe_code)] // A deliberate fault, like `segfault`.
fn sigkill() -> ! {
    // SAFETY: raise takes a signal number and touches no memory; SIGKILL ends the process.
    unsafe { libc::raise(libc::SIGKILL) };
    unreachable!("SIGKILL returned")
}

gantry_engine_abi::declare_engine!(FaultyEngine);
