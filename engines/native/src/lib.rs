//! Native engine plugin (engine layer, below the engine host): runs Hugging Face safetensors
//! models in Rust, written against `gantry-engine-abi` alone.
//!
//! Load (`decoder_load.rs` for decoders, `encoder_model.rs` for encoders): `config.json`
//! chooses the architecture by its `architectures` class ([`config`]); the shards are
//! memory-mapped ([`weights`]); `tokenizer.json` and `tokenizer_config.json` give
//! the tokenizer, chat template and special tokens ([`tokenizer`]); the backend prepares the
//! weights and allocates the paged KV cache ([`cpu`] or [`cuda`], behind [`backend::Backend`],
//! by the engine config's backend).
//!
//! Step (`step.rs`): each entry's sequence is bound to its cached prefix on its first chunk
//! ([`kv`]), gets the blocks its new tokens need, the backend runs the batch in one forward
//! pass, and each sampling entry draws its token ([`sampler`]), or one after every token for
//! an entry that verifies drafted tokens (ABI 1.5 speculative decoding).
//!
//! Sequences: `seq_fork` (ABI 1.5) opens a sequence sharing its source's full blocks and a
//! private copy of its partly filled one; `seq_truncate` drops the positions past a length
//! (copying on write a kept block that others read) and the samples taken after them.
//!
//! Adapters ([`lora`], ABI 1.6): PEFT LoRA adapters loaded beside the model; each sequence runs
//! the base or one adapter, and one step mixes them (the CPU backend applies them per run of
//! rows; the CUDA backend refuses them at load).
#![allow(unsafe_code)] // An engine crate: memory-mapped weights and SIMD kernels. Each block has a SAFETY note.

pub mod backend;
pub mod config;
pub mod cpu;
pub mod cuda;
mod decoder_load;
pub mod encoder;
mod encoder_model;
mod gpt_oss;
pub mod kv;
pub mod lora;
mod nemotron_h;
pub mod sampler;
mod step;
pub mod tokenizer;
pub mod weights;
pub mod whisper;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    AdapterDescriptor, Backend as AbiBackend, EngineConfig, EngineError, Format, LoadedAdapter,
    ModelDescriptor, ModelInfo, SampledToken, Status, StepEntry,
};

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::encoder_model::EncoderModel;
use crate::kv::{BlockPool, SeqBlocks};
use crate::sampler::SeqSampler;
use crate::tokenizer::Tokenizer;

/// Token positions per KV block.
pub const BLOCK_SIZE: usize = 16;

/// The engine: settings shared by every model it loads.
pub struct NativeEngine {
    config: EngineConfig,
    log: HostLog,
}

impl Engine for NativeEngine {
    type Model = NativeModel;

    const ID: &'static str = "native";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    /// What this build is laid out for (`engines/native/{cpu,cuda}/`); the library itself runs
    /// either backend, as the engine config asks.
    const BACKEND: AbiBackend = if cfg!(feature = "cuda") {
        AbiBackend::Cuda
    } else {
        AbiBackend::Cpu
    };
    const DESCRIPTION: &'static str = "Hugging Face safetensors models in Rust (paged KV cache)";
    /// Adapters: the CPU backend runs them; a model on the CUDA backend refuses them at load.
    const CAPABILITIES: u32 = gantry_engine_abi::ffi::GANTRY_CAP_TOKEN_MASK
        | gantry_engine_abi::ffi::GANTRY_CAP_SPECULATE
        | gantry_engine_abi::ffi::GANTRY_CAP_ADAPTERS;

    fn build_info() -> String {
        format!(
            "cpu: {} matrix kernel; element-wise code built for {}; cuda: {}",
            if cpu::matmul::has_bf16_kernel() {
                format!(
                    "{} (bf16 weights read in place), gemm for f32",
                    cpu::matmul::bf16_kernel_name()
                )
            } else {
                "gemm f32 (bf16/f16 weights converted at load: no AVX2+FMA on this CPU)".to_string()
            },
            if cfg!(target_feature = "avx512f") {
                "AVX-512"
            } else if cfg!(target_feature = "avx2") {
                "AVX2"
            } else {
                "baseline x86-64"
            },
            match cuda::unavailable() {
                None => "cuBLAS + NVRTC kernels, available".to_string(),
                Some(why) => format!("unavailable ({why})"),
            }
        )
    }

    fn create(config: EngineConfig, log: HostLog) -> Result<Self, EngineError> {
        match config.backend {
            AbiBackend::Cpu => {}
            AbiBackend::Cuda => {
                // No driver, device, cuBLAS or NVRTC: refuse clearly, never crash.
                if let Some(why) = cuda::unavailable() {
                    return Err(EngineError::unsupported(format!(
                        "backend: cuda unavailable: {why}"
                    )));
                }
            }
        }
        Ok(Self { config, log })
    }

    fn load_model(&self, desc: &ModelDescriptor) -> Result<NativeModel, EngineError> {
        if desc.format != Format::Safetensors {
            return Err(EngineError::unsupported(format!(
                "the native engine loads safetensors only, model {} is {}",
                desc.model_id, desc.format
            )));
        }
        let dir = model_dir(desc);
        let config_path = dir.join("config.json");
        let bytes = std::fs::read(&config_path).map_err(|e| {
            EngineError::new(
                Status::LoadFailed,
                format!("{}: {e}", config_path.display()),
            )
        })?;
        // Embedding models (encoders), speech recognition and decoders share nothing past
        // `config.json`.
        if class_of(&bytes).as_deref() == Some(whisper::CLASS) {
            return whisper::WhisperModel::load(&self.config, desc, &dir, &bytes, self.log)
                .map(|m| NativeModel::Whisper(Box::new(m)));
        }
        if let Some(class) = encoder_class(&bytes) {
            return EncoderModel::load(&self.config, desc, &dir, &bytes, &class, self.log)
                .map(|m| NativeModel::Encoder(Box::new(m)));
        }
        DecoderModel::load(&self.config, desc, &dir, &bytes, self.log)
            .map(|m| NativeModel::Decoder(Box::new(m)))
    }
}

/// One open sequence.
struct Seq {
    blocks: SeqBlocks,
    /// Its recurrent-state slot in the backend (state-space layers; every sequence has one).
    slot: usize,
    sampler: Option<SeqSampler>,
    /// Positions of the first chunk taken from the prefix cache (shared blocks plus a copied
    /// head; ABI 1.4 `seq_cached_tokens`); `None` until that chunk has been matched.
    cached: Option<usize>,
}

/// Everything `step` mutates, behind one lock.
struct Exec {
    backend: Box<dyn Backend>,
    pool: BlockPool,
    seqs: HashMap<u64, Seq>,
    next_id: u64,
    /// Loaded LoRA adapters' names by id (the backend holds their weights).
    adapters: HashMap<u64, String>,
    /// The next adapter id: never reused, since the prefix cache keys blocks by it.
    next_adapter: u64,
    /// Recurrent-state slots no open sequence holds.
    free_slots: Vec<usize>,
}

/// A loaded model: a decoder (completions, through `step`) or an encoder (embeddings, through
/// `embed`).
pub enum NativeModel {
    Decoder(Box<DecoderModel>),
    Encoder(Box<EncoderModel>),
    /// Speech recognition (audio through `seq_set_input`, then `step`).
    Whisper(Box<whisper::WhisperModel>),
}

/// `OOM_RAM` when `open` sequences already fill a model's `max` slots: no new sequence, nor a
/// fork of `fork_of`. Every kind of model of this engine opens and forks through it.
pub(crate) fn check_free_slot(
    open: usize,
    max: u32,
    fork_of: Option<u64>,
) -> Result<(), EngineError> {
    if open < max as usize {
        return Ok(());
    }
    let tail = fork_of.map_or(String::new(), |src| {
        format!(": sequence {src} cannot be forked")
    });
    Err(EngineError::new(
        Status::OomRam,
        format!("all {max} sequence slots are in use{tail}"),
    ))
}

/// The model directory of a descriptor (its primary file's when not given).
fn model_dir(desc: &ModelDescriptor) -> std::path::PathBuf {
    if desc.model_dir.as_os_str().is_empty() {
        desc.primary_file
            .parent()
            .unwrap_or(Path::new("."))
            .to_path_buf()
    } else {
        desc.model_dir.clone()
    }
}

/// The `architectures` class of `config.json`.
fn class_of(config: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(config).ok()?;
    Some(v.get("architectures")?.get(0)?.as_str()?.to_string())
}

/// The `architectures` class of `config.json` when it is an encoder this engine runs.
fn encoder_class(config: &[u8]) -> Option<String> {
    class_of(config).filter(|c| encoder::CLASSES.contains(&c.as_str()))
}

/// A decoder-only language model: paged KV cache, batched steps, sampling.
pub struct DecoderModel {
    exec: Mutex<Exec>,
    tokenizer: Tokenizer,
    info: ModelInfo,
    vocab: usize,
    log: HostLog,
    /// The model's hyper-parameters (adapters are checked against its shapes).
    config: ModelConfig,
}

fn read_optional(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok()
}

impl DecoderModel {
    fn exec(&self) -> std::sync::MutexGuard<'_, Exec> {
        // A panic inside step poisons the lock; the bookkeeping it guards stays consistent
        // enough to release sequences, so keep going.
        self.exec.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The config this model was loaded with (for tests and tools).
    pub fn model_config(dir: &Path) -> Result<ModelConfig, EngineError> {
        let bytes = std::fs::read(dir.join("config.json"))
            .map_err(|e| EngineError::new(Status::LoadFailed, e.to_string()))?;
        config::parse(
            &bytes,
            read_optional(&dir.join("generation_config.json")).as_deref(),
        )
    }
}

impl Model for DecoderModel {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn tokenize(
        &self,
        text: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        self.tokenizer
            .encode_bytes(text, add_special, parse_special)
    }

    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        self.tokenizer.bytes_of(tokens, render_special)
    }

    fn seq_open(&self) -> Result<u64, EngineError> {
        let mut ex = self.exec();
        check_free_slot(ex.seqs.len(), self.info.max_sequences, None)?;
        let id = ex.next_id;
        ex.next_id += 1;
        let slot = ex
            .free_slots
            .pop()
            .ok_or_else(|| EngineError::internal("no free state slot below max_sequences"))?;
        ex.seqs.insert(
            id,
            Seq {
                blocks: SeqBlocks::default(),
                slot,
                sampler: None,
                cached: None,
            },
        );
        Ok(id)
    }

    fn seq_release(&self, seq: u64) {
        let mut guard = self.exec();
        let ex = &mut *guard;
        if let Some(mut s) = ex.seqs.remove(&seq) {
            ex.pool.release(&mut s.blocks);
            ex.free_slots.push(s.slot);
        }
    }

    fn step(&self, entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError> {
        self.run_step(entries)
    }

    fn seq_fork(&self, src: u64) -> Result<u64, EngineError> {
        let mut guard = self.exec();
        let ex = &mut *guard;
        check_free_slot(ex.seqs.len(), self.info.max_sequences, Some(src))?;
        let s = ex
            .seqs
            .get(&src)
            .ok_or_else(|| EngineError::internal(format!("fork of unknown sequence {src}")))?;
        if s.cached.is_none() {
            return Err(EngineError::internal(format!(
                "fork of sequence {src}, which has not been stepped"
            )));
        }
        let src_slot = s.slot;
        let slot = ex
            .free_slots
            .pop()
            .ok_or_else(|| EngineError::internal("no free state slot below max_sequences"))?;
        let (blocks, copies) = match ex.pool.fork(&s.blocks) {
            Ok(f) => f,
            Err(e) => {
                ex.free_slots.push(slot);
                return Err(e);
            }
        };
        ex.backend.copy_blocks(&copies);
        // The child continues from the parent's recurrent state too.
        ex.backend.copy_state(src_slot, slot);
        let id = ex.next_id;
        ex.next_id += 1;
        ex.seqs.insert(
            id,
            Seq {
                blocks,
                slot,
                // The child's first sample makes its own state from its own parameters.
                sampler: None,
                // Its first entry continues after the forked KV and is evaluated whole.
                cached: Some(0),
            },
        );
        Ok(id)
    }

    fn seq_truncate(&self, seq: u64, n_keep: usize) -> Result<(), EngineError> {
        let mut guard = self.exec();
        let ex = &mut *guard;
        let s = ex
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| EngineError::internal(format!("truncate of unknown sequence {seq}")))?;
        if n_keep > s.blocks.len {
            return Err(EngineError::internal(format!(
                "truncate of sequence {seq} to {n_keep} tokens: it holds {}",
                s.blocks.len
            )));
        }
        let dropped = s.blocks.len - n_keep;
        if dropped > 0 && self.config.mamba.is_some() {
            return Err(EngineError::unsupported(format!(
                "truncate of sequence {seq}: {} has state-space layers, whose state cannot be cut back",
                self.info.architecture
            )));
        }
        let copies = ex.pool.truncate(&mut s.blocks, n_keep)?;
        ex.backend.copy_blocks(&copies);
        // The samples taken after the dropped positions are forgotten with them.
        if let Some(sampler) = s.sampler.as_mut() {
            sampler.forget(dropped);
        }
        Ok(())
    }

    fn seq_cached_tokens(&self, seq: u64) -> Option<u64> {
        self.exec().seqs.get(&seq)?.cached.map(|n| n as u64)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.exec().backend.counters()
    }

    fn adapter_load(&self, desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        self.load_adapter(desc)
    }

    fn adapter_unload(&self, adapter: u64) {
        self.unload_adapter(adapter);
    }

    fn seq_set_adapter(&self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        self.set_seq_adapter(seq, adapter)
    }

    fn embed(&self, _tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::unsupported(format!(
            "{} is a causal language model; the native engine embeds with embedding models only",
            self.info.architecture
        )))
    }
}

/// Every call goes to the model the directory held.
macro_rules! each {
    ($self:ident, $m:ident => $e:expr) => {
        match $self {
            NativeModel::Decoder($m) => $e,
            NativeModel::Encoder($m) => $e,
            NativeModel::Whisper($m) => $e,
        }
    };
}

impl Model for NativeModel {
    fn info(&self) -> ModelInfo {
        each!(self, m => m.info())
    }

    fn tokenize(
        &self,
        text: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        each!(self, m => m.tokenize(text, add_special, parse_special))
    }

    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        each!(self, m => m.detokenize(tokens, render_special))
    }

    fn seq_open(&self) -> Result<u64, EngineError> {
        each!(self, m => m.seq_open())
    }

    fn seq_release(&self, seq: u64) {
        each!(self, m => m.seq_release(seq))
    }

    fn step(&self, entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError> {
        each!(self, m => m.step(entries))
    }

    fn embed(&self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        each!(self, m => m.embed(tokens))
    }

    fn embed_batch(&self, inputs: &[&[i32]]) -> Result<Vec<Vec<f32>>, EngineError> {
        each!(self, m => m.embed_batch(inputs))
    }

    fn seq_cached_tokens(&self, seq: u64) -> Option<u64> {
        each!(self, m => m.seq_cached_tokens(seq))
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        each!(self, m => m.counters())
    }

    fn seq_fork(&self, src: u64) -> Result<u64, EngineError> {
        each!(self, m => m.seq_fork(src))
    }

    fn seq_truncate(&self, seq: u64, n_keep: usize) -> Result<(), EngineError> {
        each!(self, m => m.seq_truncate(seq, n_keep))
    }

    fn adapter_load(&self, desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        each!(self, m => m.adapter_load(desc))
    }

    fn adapter_unload(&self, adapter: u64) {
        each!(self, m => m.adapter_unload(adapter))
    }

    fn seq_set_adapter(&self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        each!(self, m => m.seq_set_adapter(seq, adapter))
    }

    fn seq_set_input(
        &self,
        seq: u64,
        input: &gantry_engine_abi::Input<'_>,
    ) -> Result<(), EngineError> {
        each!(self, m => m.seq_set_input(seq, input))
    }

    fn seq_token_times(&self, seq: u64, first: usize) -> Result<Vec<f32>, EngineError> {
        each!(self, m => m.seq_token_times(seq, first))
    }

    fn seq_token_prob(&self, seq: u64, n_fed: usize, token: i32) -> Result<f32, EngineError> {
        each!(self, m => m.seq_token_prob(seq, n_fed, token))
    }
}

gantry_engine_abi::declare_engine!(NativeEngine);
