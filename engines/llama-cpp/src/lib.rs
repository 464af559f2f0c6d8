//! llama.cpp engine plugin (engine layer, below the engine host): runs GGUF models for the node.
//!
//! One llama.cpp context per loaded model, with one llama.cpp sequence slot
//! per open Gantry sequence and a unified KV cache shared by all slots. `step`
//! packs every entry's tokens into one `llama_batch` (one per LoRA adapter in use),
//! decodes it once and samples each sequence that asked for a token with its own
//! sampler chain, in llama.cpp's backend or on the host. Releasing
//! a sequence removes its cells from the KV cache at once.
//!
//! ABI 1.5: `seq_fork` opens a sequence sharing its source's cells (a prompt evaluated once
//! for `n` > 1); a step entry with `GANTRY_STEP_SAMPLE_ALL` verifies drafted tokens, sampled
//! after each one, and `seq_truncate` drops the rejected ones (`GANTRY_CAP_SPECULATE`).
//!
//! ABI 1.6: GGUF LoRA adapters (`GANTRY_CAP_ADAPTERS`), checked against the model's tensors and
//! loaded through llama.cpp; each sequence runs one adapter or the base, and a step decodes
//! its entries in one batch per adapter, since llama.cpp sets adapters per context.
//!
//! By job: `load.rs` (the GGUF file into a model and context), `slots.rs` (sequences, the
//! warm slots of prefix reuse, fork and truncate), `step.rs` (the batches, the decodes,
//! sampling the rows in parallel, verification entries), `adapters.rs` (LoRA adapters),
//! `sampler.rs` (one sequence's sampler on the host), `backend_sampling.rs` (its chain in
//! llama.cpp's graph instead, where it fits), `cpu.rs` and `logging.rs` (llama.cpp's CPU variants
//! and log lines).
#![allow(unsafe_code)] // An engine crate: llama.cpp is C, reached through FFI. Each block has a SAFETY note.

mod adapters;
mod backend_sampling;
mod cpu;
mod gguf_info;
mod load;
mod logging;
mod sampler;
mod slots;
mod step;
#[cfg(test)]
mod testing;

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    AdapterDescriptor, Backend, EngineConfig, EngineError, Format, LoadedAdapter, LogLevel,
    ModelDescriptor, ModelInfo, SampledToken, Status, StepEntry,
};
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::slots::Exec;

#[cfg(not(feature = "cuda"))]
const BACKEND: Backend = Backend::Cpu;
#[cfg(feature = "cuda")]
const BACKEND: Backend = Backend::Cuda;

/// llama.cpp's backend may be initialised once per process (per copy of this
/// library); the cell makes concurrent first calls wait for the one init.
static LLAMA_BACKEND: OnceLock<Result<LlamaBackend, String>> = OnceLock::new();

fn backend() -> Result<&'static LlamaBackend, EngineError> {
    LLAMA_BACKEND
        .get_or_init(|| {
            // The CPU modules (feature `cpu-variants`) must be registered before the backend.
            cpu::load_variants();
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| EngineError::internal(format!("llama backend: {e}")))
}

/// ggml's device index of CUDA ordinal `ordinal` (ggml names it `CUDA<ordinal>`).
fn ggml_cuda_device(ordinal: i32) -> Option<usize> {
    let want = format!("CUDA{ordinal}");
    // SAFETY: ggml's device registry is initialised by the backend (loaded before any
    // model); the name pointers are static strings of the registry.
    unsafe {
        (0..llama_cpp_sys_2::ggml_backend_dev_count()).find(|i| {
            let dev = llama_cpp_sys_2::ggml_backend_dev_get(*i);
            let name = llama_cpp_sys_2::ggml_backend_dev_name(dev);
            !name.is_null() && std::ffi::CStr::from_ptr(name).to_bytes() == want.as_bytes()
        })
    }
}

/// The engine: settings shared by every model it loads.
pub struct LlamaEngine {
    config: EngineConfig,
    log: HostLog,
    /// Keeps llama.cpp's log lines flowing to this engine's host until drop.
    _logs: logging::Registration,
}

impl Engine for LlamaEngine {
    type Model = LlamaLoaded;

    const ID: &'static str = "llama_cpp";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const BACKEND: Backend = BACKEND;
    const DESCRIPTION: &'static str = "GGUF models through llama.cpp";
    const CAPABILITIES: u32 = gantry_engine_abi::ffi::GANTRY_CAP_TOKEN_MASK
        | gantry_engine_abi::ffi::GANTRY_CAP_SPECULATE
        | gantry_engine_abi::ffi::GANTRY_CAP_ADAPTERS;

    fn build_info() -> String {
        cpu::describe()
    }

    fn create(config: EngineConfig, log: HostLog) -> Result<Self, EngineError> {
        if config.backend != BACKEND {
            return Err(EngineError::unsupported(format!(
                "this build of llama_cpp runs on {BACKEND}, the host asked for {}",
                config.backend
            )));
        }
        let logs = logging::route_to_host(log);
        backend()?;
        log.log(
            LogLevel::Info,
            &format!("llama_cpp engine ready ({BACKEND})"),
        );
        Ok(Self {
            config,
            log,
            _logs: logs,
        })
    }

    fn load_model(&self, desc: &ModelDescriptor) -> Result<LlamaLoaded, EngineError> {
        if desc.format != Format::Gguf {
            return Err(EngineError::unsupported(format!(
                "llama_cpp loads GGUF only, model {} is {}",
                desc.model_id, desc.format
            )));
        }
        LlamaLoaded::load(&self.config, desc, self.log)
    }
}

/// A loaded model. The weights are shared read-only (tokenize/detokenize run
/// beside `step`); the context and sequences sit behind `exec`.
pub struct LlamaLoaded {
    exec: Mutex<Exec>,
    /// Leaked `Box<LlamaModel>`; freed in `Drop` after the context.
    model: &'static LlamaModel,
    info: ModelInfo,
    n_vocab: i32,
    n_batch: usize,
    embedding: bool,
    /// Threads that sample a step's rows (the engine's thread count).
    sample_threads: usize,
    /// The GGUF file, and its tensors' shapes once an adapter needs them (`adapters.rs`).
    path: PathBuf,
    base_tensors: OnceLock<Result<HashMap<String, Vec<u64>>, String>>,
}

impl Drop for LlamaLoaded {
    fn drop(&mut self) {
        let exec = self.exec.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the context borrows the model, so it must go first; it is
        // dropped exactly once, here.
        unsafe { ManuallyDrop::drop(&mut exec.ctx) };
        // Adapters next: freeing one unregisters it from its model, which must still be there.
        exec.adapters.clear();
        // SAFETY: `model` came from Box::leak in `load`; the context that
        // borrowed it is gone and nothing else holds the reference.
        drop(unsafe { Box::from_raw(std::ptr::from_ref(self.model).cast_mut()) });
    }
}

impl LlamaLoaded {
    fn exec(&self) -> std::sync::MutexGuard<'_, Exec> {
        // A panic inside step poisons the lock; the state it guards is still
        // consistent enough to release sequences, so keep going.
        self.exec.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn oom(message: String) -> EngineError {
    let status = if BACKEND == Backend::Cuda {
        Status::OomVram
    } else {
        Status::OomRam
    };
    EngineError::new(status, message)
}

impl Model for LlamaLoaded {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn tokenize(
        &self,
        text: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        let toks = self
            .model
            .vocab()
            .tokenize(text, add_special, parse_special);
        Ok(toks.into_iter().map(|t| t.0).collect())
    }

    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        let vocab = self.model.vocab();
        let mut out = Vec::with_capacity(tokens.len() * 4);
        for &t in tokens {
            if t < 0 || t >= self.n_vocab {
                return Err(EngineError::unsupported(format!(
                    "token id {t} is outside the vocabulary"
                )));
            }
            out.extend_from_slice(&vocab.token_to_piece(LlamaToken(t), render_special, None));
        }
        Ok(out)
    }

    fn seq_open(&self) -> Result<u64, EngineError> {
        let max = self.info.max_sequences;
        self.exec()
            .open(max as usize)
            .ok_or_else(|| oom(format!("all {max} sequence slots are in use")))
    }

    fn seq_release(&self, seq: u64) {
        self.exec().release(seq);
    }

    fn step(&self, entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError> {
        self.run_step(entries)
    }

    fn seq_cached_tokens(&self, seq: u64) -> Option<u64> {
        self.exec().seqs.get(&seq)?.cached.map(|n| n as u64)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.exec().counters()
    }

    fn seq_fork(&self, src: u64) -> Result<u64, EngineError> {
        self.exec().fork(src, self.info.max_sequences as usize)
    }

    fn seq_truncate(&self, seq: u64, n_keep: usize) -> Result<(), EngineError> {
        self.exec().truncate(seq, n_keep, self.n_batch)
    }

    fn embed(&self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        self.run_embed(tokens)
    }

    fn embed_batch(&self, inputs: &[&[i32]]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.run_embed_batch(inputs)
    }

    fn adapter_load(&self, desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        self.load_adapter(desc)
    }

    fn adapter_unload(&self, adapter: u64) {
        self.exec().unload_adapter(adapter);
    }

    fn seq_set_adapter(&self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        self.exec().set_seq_adapter(seq, adapter)
    }
}

gantry_engine_abi::declare_engine!(LlamaEngine);
