//! Native engine, load of a decoder (`NativeEngine::load_model` in `lib.rs`, for a
//! `config.json` that is not an encoder's): the config and tokenizer, the mapped weights, the
//! sequence and KV budget checked against the memory limit (K/V for attention layers, a state
//! per sequence for state-space ones), the backend the engine config names, and the model
//! info the host reads.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use gantry_engine_abi::ffi::GANTRY_MODALITY_COMPLETION;
use gantry_engine_abi::sdk::HostLog;
use gantry_engine_abi::{
    Backend as AbiBackend, EngineConfig, EngineError, LogLevel, ModelDescriptor, ModelInfo, Status,
};

use crate::backend::Backend;
use crate::kv::BlockPool;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;
use crate::{BLOCK_SIZE, DecoderModel, Exec, config, cpu, cuda, read_optional};

impl DecoderModel {
    pub(crate) fn load(
        cfg: &EngineConfig,
        desc: &ModelDescriptor,
        dir: &Path,
        bytes: &[u8],
        log: HostLog,
    ) -> Result<Self, EngineError> {
        let dir = dir.to_path_buf();
        let generation = read_optional(&dir.join("generation_config.json"));
        let mc = config::parse(bytes, generation.as_deref())?;
        let tokenizer = Tokenizer::load(&dir, mc.bos_token)?;
        tokenizer.check_vocab(mc.vocab)?;
        let mut weights = Weights::open_quantized(&dir, &desc.primary_file, mc.fp8, mc.mxfp4)?;
        if mc.architecture == config::Architecture::GptOss {
            crate::gpt_oss::split_experts(&mc, &mut weights)?;
        }
        let weights = Arc::new(weights);

        let max_seqs = match desc.max_sequences {
            0 => cfg.max_batch_size,
            n => n,
        }
        .max(1);
        let wanted = match desc.context_length {
            0 => cfg.context_length,
            n => n,
        };
        let per_seq = if wanted == 0 {
            mc.max_position
        } else {
            wanted.min(mc.max_position)
        };
        let capacity = u64::from(per_seq) * u64::from(max_seqs);
        // Room for every sequence's partial last block, and a copy per sequence.
        let n_blocks = (capacity as usize).div_ceil(BLOCK_SIZE) + 2 * max_seqs as usize;
        let kv_bytes =
            (n_blocks * BLOCK_SIZE * mc.n_kv_heads * mc.head_dim * 2 * 4 * mc.attention_layers())
                as u64;
        // State-space layers hold a state per open sequence instead of K/V.
        let state_bytes = (mc.state_floats_per_sequence() * 4) as u64 * u64::from(max_seqs);
        let needed = weights.mapped_bytes() + kv_bytes + state_bytes;
        if cfg.vram_limit_bytes > 0 && needed > cfg.vram_limit_bytes {
            return Err(EngineError::new(
                Status::OomRam,
                format!(
                    "model {} needs ~{needed} bytes (weights {} + KV {kv_bytes} + recurrent state {state_bytes}), the limit is {} bytes",
                    desc.model_id,
                    weights.mapped_bytes(),
                    cfg.vram_limit_bytes
                ),
            ));
        }
        let backend: Box<dyn Backend> = if cfg.backend == AbiBackend::Cuda {
            let devices = if desc.device_ids.is_empty() {
                &cfg.device_ids
            } else {
                &desc.device_ids
            };
            if devices.len() > 1 {
                return Err(EngineError::unsupported(format!(
                    "model {} is placed on {} GPUs; the native engine runs a model on one (ask for gpus: 1, or replicas)",
                    desc.model_id,
                    devices.len()
                )));
            }
            let ordinal = devices.first().copied().unwrap_or(0);
            let ordinal = usize::try_from(ordinal).map_err(|_| {
                EngineError::unsupported(format!("device id {ordinal} is not a CUDA ordinal"))
            })?;
            let mut b = cuda::CudaBackend::new(&mc, &weights, n_blocks, BLOCK_SIZE, ordinal)?;
            // The step's buffers for every sequence at once and a prompt chunk beside them.
            b.reserve(max_seqs as usize, max_seqs as usize + 512)?;
            Box::new(b)
        } else {
            let threads = match desc.threads_in(cfg) {
                0 => std::thread::available_parallelism().map_or(4, |n| n.get()),
                n => n as usize,
            };
            Box::new(cpu::CpuBackend::new(
                &mc,
                Arc::clone(&weights),
                n_blocks,
                BLOCK_SIZE,
                threads,
                max_seqs as usize,
            )?)
        };

        let mut eog: Vec<i32> = mc.eos_tokens.clone();
        if let Some(e) = tokenizer.eos {
            eog.push(e);
        }
        // End-of-turn markers of chat templates end generation too.
        for marker in [
            "<end_of_turn>",
            "<|im_end|>",
            "<|eot_id|>",
            "<|endoftext|>",
            "</s>",
        ] {
            if let Some(id) = tokenizer.id(marker) {
                eog.push(id);
            }
        }
        eog.sort_unstable();
        eog.dedup();
        let eos = tokenizer.eos.or(mc.eos_tokens.first().copied());
        let info = ModelInfo {
            architecture: mc.class.clone(),
            vocab_size: mc.vocab as u32,
            context_length: per_seq,
            trained_context_length: mc.max_position,
            kv_capacity_tokens: capacity,
            max_sequences: max_seqs,
            bos_token: tokenizer.bos,
            eos_token: eos,
            eog_tokens: eog,
            bos_text: tokenizer.bos_text.clone(),
            eos_text: tokenizer.eos_text.clone(),
            chat_template: tokenizer.chat_template.clone(),
            bytes_used: backend.bytes_used(),
            modalities: GANTRY_MODALITY_COMPLETION,
            embedding_dims: 0,
            add_bos: tokenizer.add_bos,
            recurrent_state_bytes: (mc.state_floats_per_sequence() * 4) as u64,
            audio_sample_rate: 0,
            audio_max_samples: 0,
            voices: Vec::new(),
        };
        log.log(
            LogLevel::Info,
            &format!(
                "loaded {} ({}, {} layers, ctx {per_seq} x {max_seqs} seqs, {n_blocks} KV blocks of {BLOCK_SIZE}; {})",
                desc.model_id,
                mc.class,
                mc.n_layers,
                backend.describe()
            ),
        );
        let mut pool = BlockPool::new(n_blocks, BLOCK_SIZE);
        // A recurrent state summarises a whole prefix and cannot be shared by block: models
        // with state-space layers reuse no prefix.
        pool.prefix_cache = mc.mamba.is_none()
            && std::env::var("GANTRY_NATIVE_PREFIX_CACHE").map_or(true, |v| v != "0");
        Ok(Self {
            exec: Mutex::new(Exec {
                backend,
                pool,
                seqs: HashMap::new(),
                next_id: 1,
                adapters: HashMap::new(),
                next_adapter: 1,
                free_slots: (0..max_seqs as usize).rev().collect(),
            }),
            tokenizer,
            info,
            vocab: mc.vocab,
            log,
            config: mc,
        })
    }
}
