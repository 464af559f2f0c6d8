//! llama.cpp engine plugin (engine layer, below the engine host): runs GGUF models for the node.
//!
//! One llama.cpp context per loaded model, with one llama.cpp sequence slot
//! per open Gantry sequence and a unified KV cache shared by all slots. `step`
//! packs every entry's tokens into one `llama_batch`, decodes once and samples
//! each sequence that asked for a token with its own sampler chain. Releasing
//! a sequence removes its cells from the KV cache at once.
#![allow(unsafe_code)] // An engine crate: llama.cpp is C, reached through FFI. Each block has a SAFETY note.

mod cpu;
mod logging;
mod sampler;

use std::mem::ManuallyDrop;
use std::num::NonZeroU32;
use std::sync::{Mutex, OnceLock};

use gantry_engine_abi::ffi::{GANTRY_MODALITY_COMPLETION, GANTRY_MODALITY_EMBEDDING};
use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    Backend, EngineConfig, EngineError, Format, LogLevel, ModelDescriptor, ModelInfo, SampledToken,
    Status, StepEntry,
};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::{LlamaContextParams, LlamaPoolingType};
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::token::LlamaToken;

use crate::sampler::SeqSampler;

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
    const CAPABILITIES: u32 = gantry_engine_abi::ffi::GANTRY_CAP_TOKEN_MASK;

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

/// One open sequence: its llama.cpp slot, next position and sampler state.
struct Seq {
    /// Bound on the first step, when the prompt is known (see `bind`).
    slot: Option<i32>,
    n_past: i32,
    /// Tokens in this sequence's KV cells, in order.
    history: Vec<i32>,
    sampler: Option<SeqSampler>,
    /// Leading tokens of the first chunk taken from a warm slot (ABI 1.4 `seq_cached_tokens`);
    /// set by `bind`.
    cached: Option<usize>,
}

/// A llama.cpp sequence slot no open sequence holds. Its KV may still hold
/// the tokens of the sequence that last used it ("warm"), for prefix reuse.
struct FreeSlot {
    id: i32,
    tokens: Vec<i32>,
    released_at: u64,
}

/// A warm slot whose history goes on longer than this past a new sequence's prefix is shared
/// with it rather than cut. A shorter tail is usually the same conversation coming back (its
/// last reply re-tokenized, the token kept for its logits), which supersedes it.
const SHARE_MIN_TAIL: usize = 32;

/// Everything `step` mutates, behind one lock.
///
/// Prefix cache: a released sequence's cells stay in its slot. A new
/// sequence takes the free slot whose cached tokens share the longest prefix
/// with its first prompt chunk and skips those tokens. When that prefix is only
/// part of the warm slot's cells and an empty slot is free, the sequence takes
/// the empty slot with the prefix's cells shared into it (llama.cpp's unified
/// cache lets cells belong to several sequences), so the warm slot keeps its
/// whole history for the sequence that continues it. Warm cells are evicted
/// whenever the cache is full, so a release still gives its capacity back.
struct Exec {
    ctx: ManuallyDrop<LlamaContext<'static>>,
    batch: LlamaBatch<'static>,
    seqs: std::collections::HashMap<u64, Seq>,
    free_slots: Vec<FreeSlot>,
    next_id: u64,
    clock: u64,
    /// The model's attention window (`<arch>.attention.sliding_window`); 0 = none.
    n_swa: usize,
}

impl Exec {
    /// Give `seq` a slot for a first chunk `tokens`; returns how many leading
    /// tokens its KV already holds. `keep_last` leaves the last token to be
    /// evaluated again when the caller needs its logits; `fresh` takes no
    /// cached prefix at all (`GANTRY_STEP_FRESH`: reproducible sampling).
    fn bind(
        &mut self,
        seq: u64,
        tokens: &[i32],
        keep_last: bool,
        fresh: bool,
    ) -> Result<usize, EngineError> {
        let common = |cached: &[i32]| {
            cached
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
        };
        // Longest shared prefix wins; then an empty slot; then the least recently released.
        let best = (0..self.free_slots.len())
            .max_by_key(|&i| {
                let f = &self.free_slots[i];
                (
                    // A fresh sequence takes no prefix: it spares the warm slots.
                    if fresh { 0 } else { common(&f.tokens) },
                    f.tokens.is_empty(),
                    std::cmp::Reverse(f.released_at),
                )
            })
            .ok_or_else(|| EngineError::internal("no free slot to bind a sequence"))?;
        let mut slot = self.free_slots.swap_remove(best);
        let mut reuse = if fresh { 0 } else { common(&slot.tokens) };
        if keep_last && reuse == tokens.len() {
            reuse -= 1;
        }
        // A sliding-window cache hands the cells that fell out of a sequence's window to
        // other sequences (warm slots included), oldest first, so a warm slot may have lost
        // its first cells. The prefix is still usable when the window its next token
        // attends to lies above them: always for a continuation of the slot's whole history
        // (the cells inside the window of its next position are never handed out), and, as
        // llama-server decides, when the first cell left is below `reuse - n_swa`. Otherwise
        // start cold.
        let pos_min = self.ctx.kv_cache_seq_pos_min(slot.id);
        let window_kept = reuse == slot.tokens.len()
            || (self.n_swa > 0 && (pos_min.max(0) as usize) < reuse.saturating_sub(self.n_swa));
        if reuse > 0 && pos_min > 0 && !window_kept {
            reuse = 0;
        }
        // Share rather than cut: the warm slot keeps the tail this sequence does not use.
        if reuse > 0
            && slot.tokens.len() - reuse > SHARE_MIN_TAIL
            && let Some(e) = self.free_slots.iter().position(|f| f.tokens.is_empty())
        {
            let empty = self.free_slots[e].id;
            if self
                .ctx
                .copy_kv_cache_seq(slot.id, empty, Some(0), Some(reuse as u32))
                .is_ok()
            {
                let warm = std::mem::replace(&mut slot, self.free_slots.swap_remove(e));
                self.free_slots.push(warm);
            }
        }
        // Drop the cached cells past the shared prefix. Caches that cannot cut a
        // sequence in the middle (recurrent models) refuse: start cold then.
        let cut = self
            .ctx
            .clear_kv_cache_seq(Some(slot.id as u32), Some(reuse as u32), None);
        if reuse > 0 && !matches!(cut, Ok(true)) {
            reuse = 0;
            let _ = self
                .ctx
                .clear_kv_cache_seq(Some(slot.id as u32), None, None);
        }
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| EngineError::internal("binding an unknown sequence"))?;
        s.slot = Some(slot.id);
        s.n_past = reuse as i32;
        s.history = tokens[..reuse].to_vec();
        s.cached = Some(reuse);
        // Tests read this line to check that reuse happened (what the engine evaluates).
        logging::debug(&format!(
            "sequence {seq}: first prompt chunk of {} tokens, {reuse} reused from a warm slot, {} evaluated",
            tokens.len(),
            tokens.len() - reuse
        ));
        Ok(reuse)
    }

    /// Forget every warm slot's cells; returns whether any were held.
    fn evict_warm(&mut self) -> bool {
        let mut any = false;
        for f in &mut self.free_slots {
            if !f.tokens.is_empty() {
                let _ = self.ctx.clear_kv_cache_seq(Some(f.id as u32), None, None);
                f.tokens.clear();
                any = true;
            }
        }
        any
    }
}

// SAFETY: a llama_context may be used from any thread as long as calls are not
// concurrent; `Exec` is only reached through `LlamaLoaded::exec`'s mutex.
unsafe impl Send for Exec {}

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
}

impl Drop for LlamaLoaded {
    fn drop(&mut self) {
        let exec = self.exec.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the context borrows the model, so it must go first; it is
        // dropped exactly once, here.
        unsafe { ManuallyDrop::drop(&mut exec.ctx) };
        // SAFETY: `model` came from Box::leak in `load`; the context that
        // borrowed it is gone and nothing else holds the reference.
        drop(unsafe { Box::from_raw(std::ptr::from_ref(self.model).cast_mut()) });
    }
}

fn meta(model: &LlamaModel, key: &str) -> Option<String> {
    model.meta_val_str(key).ok().filter(|s| !s.is_empty())
}

fn to_i32(v: u32) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

impl LlamaLoaded {
    fn load(cfg: &EngineConfig, desc: &ModelDescriptor, log: HostLog) -> Result<Self, EngineError> {
        let backend = backend()?;
        let path = &desc.primary_file;
        if !path.is_file() {
            return Err(EngineError::new(
                Status::LoadFailed,
                format!("model file not found: {}", path.display()),
            ));
        }
        let max_seqs = match desc.max_sequences {
            0 => cfg.max_batch_size,
            n => n,
        }
        .max(1);
        let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if cfg.vram_limit_bytes > 0 && file_bytes > cfg.vram_limit_bytes {
            // Refuse before allocating anything: no partial loads, no CPU offload.
            return Err(oom(format!(
                "model {} needs at least {file_bytes} bytes for weights, limit is {} bytes",
                desc.model_id, cfg.vram_limit_bytes
            )));
        }

        let mut mparams = LlamaModelParams::default();
        if BACKEND == Backend::Cuda {
            mparams = mparams.with_n_gpu_layers(u32::MAX / 2);
            // The host's placement of this model (ABI 1.3), else the engine's devices.
            let placed = !desc.device_ids.is_empty();
            let devices = if placed {
                &desc.device_ids
            } else {
                &cfg.device_ids
            };
            if placed {
                // Only these devices, main first: ggml numbers devices its own way.
                let idx = devices
                    .iter()
                    .map(|d| {
                        ggml_cuda_device(*d).ok_or_else(|| {
                            EngineError::new(
                                Status::LoadFailed,
                                format!(
                                    "model {}: CUDA device {d} is not visible to ggml",
                                    desc.model_id
                                ),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                mparams = mparams
                    .with_devices(&idx)
                    .map_err(|e| EngineError::new(Status::LoadFailed, e.to_string()))?
                    .with_main_gpu(0);
            } else if let Some(dev) = devices.first() {
                mparams = mparams.with_main_gpu(*dev);
            }
        }
        let model = LlamaModel::load_from_file(backend, path, &mparams).map_err(|e| {
            EngineError::new(
                Status::ModelCorrupt,
                format!("llama.cpp could not load {}: {e}", path.display()),
            )
        })?;
        let model: &'static LlamaModel = Box::leak(Box::new(model));
        // From here on, any failure must free the leaked model.
        let free_model = || {
            // SAFETY: `model` was leaked above and nothing else refers to it yet.
            drop(unsafe { Box::from_raw(std::ptr::from_ref(model).cast_mut()) })
        };

        let arch = meta(model, "general.architecture").unwrap_or_else(|| "unknown".into());
        let pooling = meta(model, &format!("{arch}.pooling_type"))
            .and_then(|v| v.parse::<i32>().ok())
            .unwrap_or(0);
        let embedding = pooling > 0;
        let n_swa = meta(model, &format!("{arch}.attention.sliding_window"))
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        let trained = model.n_ctx_train();
        let wanted = match desc.context_length {
            0 => cfg.context_length,
            n => n,
        };
        let per_seq = if wanted == 0 {
            trained
        } else {
            wanted.min(trained.max(1))
        };
        let n_ctx = per_seq.saturating_mul(max_seqs);
        let kv_bytes = estimate_kv_bytes(model, &arch, n_ctx);
        if cfg.vram_limit_bytes > 0 && model.size() + kv_bytes > cfg.vram_limit_bytes {
            free_model();
            return Err(oom(format!(
                "model {} needs ~{} bytes (weights {} + KV {}), limit is {} bytes",
                desc.model_id,
                model.size() + kv_bytes,
                model.size(),
                kv_bytes,
                cfg.vram_limit_bytes
            )));
        }

        let threads = match cfg.n_threads {
            0 => std::thread::available_parallelism().map_or(4, |n| n.get() as u32),
            n => n,
        };
        let n_batch: u32 = 2048;
        let mut cparams = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(n_ctx))
            .with_n_batch(n_batch)
            .with_n_ubatch(if embedding { n_batch } else { 512 })
            .with_n_seq_max(max_seqs)
            .with_n_threads(to_i32(threads))
            .with_n_threads_batch(to_i32(threads))
            .with_kv_unified(true)
            .with_no_perf(true);
        if embedding {
            cparams = cparams
                .with_embeddings(true)
                .with_pooling_type(LlamaPoolingType::from(pooling));
        }
        let ctx = match model.new_context(backend, cparams) {
            Ok(ctx) => ctx,
            Err(e) => {
                free_model();
                return Err(oom(format!(
                    "could not allocate a context of {n_ctx} tokens: {e}"
                )));
            }
        };

        let vocab = model.vocab();
        let tok = |t: LlamaToken| (t.0 >= 0).then_some(t.0);
        let n_vocab = vocab.n_tokens();
        let eog_tokens: Vec<i32> = (0..n_vocab)
            .filter(|t| vocab.is_eog(LlamaToken(*t)))
            .collect();
        let text_of = |t: Option<i32>| {
            t.map(|t| {
                String::from_utf8_lossy(&vocab.token_to_piece(LlamaToken(t), true, None))
                    .into_owned()
            })
        };
        let bos = tok(vocab.bos());
        let eos = tok(vocab.eos());
        let info = ModelInfo {
            architecture: arch.clone(),
            vocab_size: n_vocab.max(0) as u32,
            context_length: per_seq,
            trained_context_length: trained,
            kv_capacity_tokens: u64::from(ctx.n_ctx()),
            max_sequences: max_seqs,
            bos_token: bos,
            eos_token: eos,
            eog_tokens,
            bos_text: text_of(bos),
            eos_text: text_of(eos),
            chat_template: meta(model, "tokenizer.chat_template"),
            bytes_used: model.size() + kv_bytes,
            modalities: if embedding {
                GANTRY_MODALITY_EMBEDDING
            } else {
                GANTRY_MODALITY_COMPLETION
            },
            embedding_dims: if embedding {
                model.n_embd().max(0) as u32
            } else {
                0
            },
            add_bos: vocab.should_add_bos(),
        };
        log.log(
            LogLevel::Info,
            &format!(
                "loaded {} ({arch}, {} params, ctx {per_seq} x {max_seqs} seqs, {} threads)",
                desc.model_id,
                model.n_params(),
                threads
            ),
        );
        let ctx: LlamaContext<'static> = ctx;
        Ok(Self {
            exec: Mutex::new(Exec {
                ctx: ManuallyDrop::new(ctx),
                batch: LlamaBatch::new(n_batch as usize, 1),
                seqs: Default::default(),
                free_slots: (0..to_i32(max_seqs))
                    .map(|id| FreeSlot {
                        id,
                        tokens: Vec::new(),
                        released_at: 0,
                    })
                    .collect(),
                next_id: 1,
                clock: 0,
                n_swa,
            }),
            model,
            info,
            n_vocab,
            n_batch: n_batch as usize,
            embedding,
        })
    }

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

/// KV bytes for `n_ctx` cells at f16: 2 (K and V) x layers x kv heads x head size x 2 bytes.
fn estimate_kv_bytes(model: &LlamaModel, arch: &str, n_ctx: u32) -> u64 {
    let head_dim = meta(model, &format!("{arch}.attention.key_length"))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| (model.n_embd().max(1) as u64) / u64::from(model.n_head().max(1)));
    2 * u64::from(model.n_layer()) * u64::from(model.n_head_kv()) * head_dim * 2 * u64::from(n_ctx)
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
        let mut ex = self.exec();
        if ex.seqs.len() >= self.info.max_sequences as usize {
            return Err(oom(format!(
                "all {} sequence slots are in use",
                self.info.max_sequences
            )));
        }
        let id = ex.next_id;
        ex.next_id += 1;
        ex.seqs.insert(
            id,
            Seq {
                slot: None,
                n_past: 0,
                history: Vec::new(),
                sampler: None,
                cached: None,
            },
        );
        Ok(id)
    }

    fn seq_release(&self, seq: u64) {
        let mut ex = self.exec();
        if let Some(s) = ex.seqs.remove(&seq)
            && let Some(id) = s.slot
        {
            // The cells stay warm for prefix reuse; they are evicted the
            // moment anyone needs the room (see `step`).
            ex.clock += 1;
            let released_at = ex.clock;
            ex.free_slots.push(FreeSlot {
                id,
                tokens: s.history,
                released_at,
            });
        }
    }

    fn step(&self, entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let mut guard = self.exec();
        let ex = &mut *guard;
        let total: usize = entries.iter().map(|e| e.tokens.len()).sum();
        if total == 0 {
            return Ok(vec![None; entries.len()]);
        }
        if total > self.n_batch {
            return Err(EngineError::internal(format!(
                "step carries {total} tokens, the batch holds {}",
                self.n_batch
            )));
        }
        // How many leading tokens of each entry are already in KV (prefix reuse).
        let mut skip = vec![0usize; entries.len()];
        for (i, e) in entries.iter().enumerate() {
            let s = ex.seqs.get(&e.seq).ok_or_else(|| {
                EngineError::internal(format!("step on unknown sequence {}", e.seq))
            })?;
            if e.sample.is_some() && e.tokens.is_empty() {
                return Err(EngineError::internal(format!(
                    "sequence {} asks for a sample without tokens",
                    e.seq
                )));
            }
            if s.slot.is_none() {
                skip[i] = ex.bind(e.seq, e.tokens, e.sample.is_some(), e.fresh)?;
            }
        }
        let mut evicted = false;
        let logits_at = loop {
            // Position in the batch whose logits each sampling entry reads.
            let mut logits_at: Vec<Option<i32>> = Vec::with_capacity(entries.len());
            ex.batch.clear();
            for (e, &k) in entries.iter().zip(&skip) {
                let s = &ex.seqs[&e.seq];
                let slot = s.slot.unwrap_or_default();
                let last = e.tokens.len().saturating_sub(1);
                for (i, &t) in e.tokens.iter().enumerate().skip(k) {
                    let want = e.sample.is_some() && i == last;
                    ex.batch
                        .add(LlamaToken(t), s.n_past + (i - k) as i32, &[slot], want)
                        .map_err(|err| EngineError::internal(format!("batch: {err}")))?;
                }
                logits_at.push(e.sample.map(|_| ex.batch.n_tokens() - 1));
            }
            if ex.batch.n_tokens() == 0 {
                break logits_at;
            }
            match ex.ctx.decode(&mut ex.batch) {
                Ok(()) => break logits_at,
                // Full: drop the warm cells of released sequences and try once more.
                Err(llama_cpp_2::DecodeError::NoKvCacheSlot) if !evicted && ex.evict_warm() => {
                    evicted = true;
                }
                Err(llama_cpp_2::DecodeError::NoKvCacheSlot) => {
                    return Err(oom("KV cache is full".to_string()));
                }
                Err(other) => {
                    return Err(EngineError::internal(format!(
                        "llama_decode failed: {other}"
                    )));
                }
            }
        };
        let mut out = Vec::with_capacity(entries.len());
        for ((e, at), &k) in entries.iter().zip(logits_at).zip(&skip) {
            let seq = ex
                .seqs
                .get_mut(&e.seq)
                .ok_or_else(|| EngineError::internal("sequence vanished"))?;
            seq.n_past += (e.tokens.len() - k) as i32;
            seq.history.extend_from_slice(&e.tokens[k..]);
            let (Some(params), Some(idx)) = (e.sample, at) else {
                out.push(None);
                continue;
            };
            let sampler = seq
                .sampler
                .get_or_insert_with(|| SeqSampler::new(params, self.n_vocab));
            out.push(Some(sampler.sample(&ex.ctx, idx, params, e.allowed)?));
        }
        Ok(out)
    }

    fn seq_cached_tokens(&self, seq: u64) -> Option<u64> {
        self.exec().seqs.get(&seq)?.cached.map(|n| n as u64)
    }

    fn embed(&self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        if !self.embedding {
            return Err(EngineError::unsupported(format!(
                "{} is not an embedding model",
                self.info.architecture
            )));
        }
        if tokens.is_empty() {
            return Err(EngineError::unsupported("cannot embed an empty input"));
        }
        if tokens.len() > self.n_batch {
            return Err(EngineError::unsupported(format!(
                "input has {} tokens, the most an embedding takes is {}",
                tokens.len(),
                self.n_batch
            )));
        }
        let mut guard = self.exec();
        let ex = &mut *guard;
        let free = ex
            .free_slots
            .last_mut()
            .ok_or_else(|| oom("no free sequence slot for embedding".into()))?;
        let slot = free.id;
        // An embedding takes the slot's cells for one pass: its warm prefix goes.
        free.tokens.clear();
        let _ = ex.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
        ex.batch.clear();
        for (i, &t) in tokens.iter().enumerate() {
            ex.batch
                .add(LlamaToken(t), i as i32, &[slot], true)
                .map_err(|err| EngineError::internal(format!("batch: {err}")))?;
        }
        let result = ex
            .ctx
            .decode(&mut ex.batch)
            .map_err(|err| EngineError::internal(format!("llama_decode failed: {err}")))
            .and_then(|()| {
                ex.ctx
                    .embeddings_seq_ith(slot)
                    .map(<[f32]>::to_vec)
                    .map_err(|err| EngineError::internal(format!("no pooled embedding: {err}")))
            });
        let _ = ex.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
        result
    }
}

gantry_engine_abi::declare_engine!(LlamaEngine);
