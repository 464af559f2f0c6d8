//! Native engine, an embedding model as the ABI sees it (engine layer, below the engine host):
//! the tokenizer and the [`Encoder`] behind `embed`; the decoder calls (`seq_open`, `step`) are
//! refused with the reason, and the model reports the embedding modality only, so the node
//! serves it on `/v1/embeddings` and answers completions with a clear 400.

use std::path::Path;
use std::sync::Arc;

use gantry_engine_abi::ffi::GANTRY_MODALITY_EMBEDDING;
use gantry_engine_abi::sdk::{HostLog, Model};
use gantry_engine_abi::{
    EngineConfig, EngineError, LogLevel, ModelDescriptor, ModelInfo, SampledToken, Status,
    StepEntry,
};

use crate::encoder::{Encoder, EncoderConfig};
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;

pub struct EncoderModel {
    encoder: Encoder,
    tokenizer: Tokenizer,
    info: ModelInfo,
}

impl EncoderModel {
    pub fn load(
        cfg: &EngineConfig,
        desc: &ModelDescriptor,
        dir: &Path,
        config: &[u8],
        class: &str,
        log: HostLog,
    ) -> Result<Self, EngineError> {
        if cfg.backend == gantry_engine_abi::Backend::Cuda {
            return Err(EngineError::unsupported(format!(
                "{class}: the CUDA backend of the native engine does not run embedding models yet (its CPU backend does)"
            )));
        }
        let json: serde_json::Value = serde_json::from_slice(config).map_err(|e| {
            EngineError::new(
                Status::ModelCorrupt,
                format!("config.json is not valid JSON: {e}"),
            )
        })?;
        let ec = EncoderConfig::read(dir, &json, class)?;
        let tokenizer = Tokenizer::load(dir, None)?;
        tokenizer.check_vocab(ec.vocab)?;
        let weights = Arc::new(Weights::open(dir, &desc.primary_file)?);
        let threads = (desc.threads_in(cfg).max(1)) as usize;
        let encoder = Encoder::load(ec, weights, threads)?;
        let ec = &encoder.cfg;
        let context = match desc.context_length {
            0 => ec.max_tokens,
            n => (n as usize).min(ec.max_tokens),
        } as u32;
        let info = ModelInfo {
            architecture: ec.class.clone(),
            vocab_size: ec.vocab as u32,
            context_length: context,
            trained_context_length: ec.max_position as u32,
            kv_capacity_tokens: u64::from(context),
            max_sequences: 1,
            bos_token: None,
            eos_token: None,
            eog_tokens: Vec::new(),
            bos_text: None,
            eos_text: None,
            chat_template: None,
            bytes_used: encoder.bytes_used(),
            modalities: GANTRY_MODALITY_EMBEDDING,
            embedding_dims: ec.hidden as u32,
            // "Add the special tokens": the tokenizer's post-processor wraps each input in
            // its markers ([CLS] … [SEP] for BERT), as the model was trained.
            add_bos: true,
            recurrent_state_bytes: 0,
            audio_sample_rate: 0,
            audio_max_samples: 0,
            voices: Vec::new(),
        };
        log.log(
            LogLevel::Info,
            &format!(
                "loaded {} ({}, {} layers, {} dims, {:?} pooling{}, up to {} tokens; cpu, {threads} threads)",
                desc.model_id,
                ec.class,
                ec.n_layers,
                ec.hidden,
                ec.pooling,
                if ec.normalize { ", normalised" } else { "" },
                ec.max_tokens
            ),
        );
        Ok(Self {
            encoder,
            tokenizer,
            info,
        })
    }

    fn not_a_decoder(&self) -> EngineError {
        EngineError::unsupported(format!(
            "{} is an embedding model: it embeds (/v1/embeddings) and does not generate",
            self.info.architecture
        ))
    }
}

impl Model for EncoderModel {
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
        Err(self.not_a_decoder())
    }

    fn seq_release(&self, _seq: u64) {}

    fn step(&self, _entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError> {
        Err(self.not_a_decoder())
    }

    fn embed(&self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        self.encoder.embed(tokens)
    }

    fn embed_batch(&self, inputs: &[&[i32]]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.encoder.embed_batch(inputs)
    }
}
