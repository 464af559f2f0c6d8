//! llama.cpp engine, at load (below the engine host's `load_model`): the GGUF file into a
//! llama.cpp model and context, with the memory checks that refuse before allocating, and the
//! model's description for the host ([`ModelInfo`]).

use std::mem::ManuallyDrop;
use std::num::NonZeroU32;
use std::sync::{Mutex, OnceLock};

use gantry_engine_abi::ffi::{GANTRY_MODALITY_COMPLETION, GANTRY_MODALITY_EMBEDDING};
use gantry_engine_abi::sdk::HostLog;
use gantry_engine_abi::{
    Backend, EngineConfig, EngineError, LogLevel, ModelDescriptor, ModelInfo, Status,
};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::{LlamaContextParams, LlamaPoolingType};
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::token::LlamaToken;

use crate::slots::{Exec, FreeSlot};
use crate::{BACKEND, LlamaLoaded, backend, ggml_cuda_device, oom};

/// Tokens of one ubatch of a generation context (llama.cpp builds one graph per ubatch).
const N_UBATCH: u32 = 512;

fn meta(model: &LlamaModel, key: &str) -> Option<String> {
    model.meta_val_str(key).ok().filter(|s| !s.is_empty())
}

fn to_i32(v: u32) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

impl LlamaLoaded {
    pub(crate) fn load(
        cfg: &EngineConfig,
        desc: &ModelDescriptor,
        log: HostLog,
    ) -> Result<Self, EngineError> {
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

        let threads = match desc.threads_in(cfg) {
            0 => std::thread::available_parallelism().map_or(4, |n| n.get() as u32),
            n => n,
        };
        let n_batch: u32 = 2048;
        let mut cparams = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(n_ctx))
            .with_n_batch(n_batch)
            .with_n_ubatch(if embedding { n_batch } else { N_UBATCH })
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
        let state_bytes = recurrent_state_bytes(model, &arch, path);
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
            bytes_used: model.size() + kv_bytes + state_bytes * u64::from(max_seqs),
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
            recurrent_state_bytes: state_bytes,
            audio_sample_rate: 0,
            audio_max_samples: 0,
            voices: Vec::new(),
        };
        let mut ctx: LlamaContext<'static> = ctx;
        // Sampling in llama.cpp's graph (`backend_sampling.rs`); not for embedding contexts.
        let raw = crate::backend_sampling::raw_context(&ctx, model);
        let attacher = if !embedding && crate::backend_sampling::enabled(BACKEND) {
            let found = raw
                .map(crate::backend_sampling::Attacher::new)
                .ok_or_else(|| "this llama-cpp-2 does not show its context pointer".to_string());
            match found.and_then(|a| a.probe(&mut ctx, n_vocab).map(|()| a)) {
                Ok(a) => Some(a),
                Err(why) => {
                    log.log(LogLevel::Warn, &format!("backend sampling is off: {why}"));
                    None
                }
            }
        } else {
            None
        };
        log.log(
            LogLevel::Info,
            &format!(
                "loaded {} ({arch}, {} params, ctx {per_seq} x {max_seqs} seqs, {} threads, \
                 sampling on the {})",
                desc.model_id,
                model.n_params(),
                threads,
                if attacher.is_some() {
                    "backend where the chain fits"
                } else {
                    "host"
                }
            ),
        );
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
                        adapter: 0,
                        backend: None,
                    })
                    .collect(),
                next_id: 1,
                clock: 0,
                n_swa,
                adapters: Default::default(),
                next_adapter: 1,
                active_adapter: 0,
                attacher,
                raw,
                n_ubatch: u64::from(if embedding { n_batch } else { N_UBATCH }),
                ubatches: 0,
            }),
            model,
            info,
            n_vocab,
            n_batch: n_batch as usize,
            embedding,
            // A CPU build's llama.cpp threads hold the cores between steps (ggml's pool spins
            // for a while after a graph): sampling beside them measured 0.86-0.88x at c = 8 on
            // 2 cores (bench/results/llama-cpp-host-sampling-ab-parallel-on-cpu.json), so rows are sampled
            // inline there; a GPU build samples them in parallel on the host's threads.
            sample_threads: if BACKEND == Backend::Cuda {
                threads as usize
            } else {
                1
            },
            path: path.clone(),
            base_tensors: OnceLock::new(),
        })
    }
}

/// KV bytes for `n_ctx` cells at f16: 2 (K and V) x layers x kv heads x head size x 2 bytes.
/// Bytes of recurrent state one sequence holds, as llama.cpp sizes it (f32, `n_embd_r` +
/// `n_embd_s` per recurrent layer): a short convolution's last `l_cache - 1` inputs (LFM2), or
/// a Mamba layer's last `conv_kernel - 1` convolution inputs and its scan state. The
/// recurrent layers are those with state-space or short-convolution tensors (`blk.N.ssm_*`,
/// `blk.N.shortconv.*`; every layer of Falcon-H1, some of a hybrid's), read from the file's
/// header. 0 for a model with K/V only.
fn recurrent_state_bytes(model: &LlamaModel, arch: &str, path: &std::path::Path) -> u64 {
    if !(model.is_recurrent() || model.is_hybrid()) {
        return 0;
    }
    let num = |key: &str| {
        meta(model, &format!("{arch}.{key}")).and_then(|v| v.trim().parse::<u64>().ok())
    };
    let n_embd = model.n_embd().max(0) as u64;
    let (r, s) = match num("shortconv.l_cache") {
        Some(l) => (l.saturating_sub(1) * n_embd, 0),
        None => {
            let kernel = num("ssm.conv_kernel").unwrap_or(0);
            let inner = num("ssm.inner_size").unwrap_or(0);
            let state = num("ssm.state_size").unwrap_or(0);
            let groups = num("ssm.group_count").unwrap_or(0);
            (
                kernel.saturating_sub(1) * (inner + 2 * groups * state),
                state * inner,
            )
        }
    };
    let layers = match crate::gguf_info::read(path) {
        Ok(header) => header
            .tensors
            .iter()
            .filter_map(|t| {
                let rest = t.name.strip_prefix("blk.")?;
                let (layer, tensor) = rest.split_once('.')?;
                (tensor.starts_with("ssm_") || tensor.starts_with("shortconv."))
                    .then(|| layer.to_string())
            })
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u64,
        // The file loaded a moment ago; were its header unreadable now, count every layer.
        Err(_) => u64::from(model.n_layer()),
    };
    4 * (r + s) * layers
}

fn estimate_kv_bytes(model: &LlamaModel, arch: &str, n_ctx: u32) -> u64 {
    let head_dim = meta(model, &format!("{arch}.attention.key_length"))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| (model.n_embd().max(1) as u64) / u64::from(model.n_head().max(1)));
    2 * u64::from(model.n_layer()) * u64::from(model.n_head_kv()) * head_dim * 2 * u64::from(n_ctx)
}
