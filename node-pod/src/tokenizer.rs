//! Tokenization (after the chat template, before the model limits): text to token ids.
//!
//! A model directory with a `tokenizer.json` uses the `tokenizers` crate (the
//! Hugging Face reference implementation); otherwise the engine plugin's own
//! tokenizer (for GGUF, the vocabulary in the file) does the work. Output
//! tokens are always turned back into text through the plugin's per-token
//! bytes, so streaming sees exactly what the engine sampled.

use std::path::Path;
use std::sync::Arc;

use gantry_engine_abi::{EngineError, ModelInfo};

use crate::engine_host::ModelShared;

pub enum Tokenizer {
    Plugin(Arc<ModelShared>),
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    pub fn for_model(dir: &Path, shared: Arc<ModelShared>) -> Result<Self, String> {
        let path = dir.join("tokenizer.json");
        if path.is_file() {
            let mut t = tokenizers::Tokenizer::from_file(&path)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            // Padding and truncation in tokenizer.json are its training batches' (a
            // sentence-transformers model pads every input to 128): each input is taken whole,
            // and the model limits say when one is too long.
            t.with_padding(None);
            t.with_truncation(None)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            // Ids must mean the same thing to the engine: a tokenizer with a
            // larger vocabulary than the model's belongs to another model.
            let (hf, model) = (t.get_vocab_size(true), shared.info().vocab_size as usize);
            if hf <= model {
                return Ok(Tokenizer::Hf(Box::new(t)));
            }
            tracing::warn!(path = %path.display(), hf, model, "tokenizer.json does not match the model's vocabulary; using the engine's tokenizer");
        }
        Ok(Tokenizer::Plugin(shared))
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Tokenizer::Plugin(_) => "plugin",
            Tokenizer::Hf(_) => "tokenizer.json",
        }
    }

    /// Encode a rendered chat template: special-token text becomes the
    /// special tokens, and BOS is added only when the model wants one and
    /// the template did not already write it (templates usually do).
    pub fn encode_chat(&self, text: &str, info: &ModelInfo) -> Result<Vec<i32>, EngineError> {
        let add_bos = info.add_bos
            && !info
                .bos_text
                .as_deref()
                .is_some_and(|b| !b.is_empty() && text.starts_with(b));
        self.encode(text, add_bos, true)
    }

    /// Encode a completion prompt or an embedding input: BOS when the model
    /// wants one; special-token text stays text.
    pub fn encode_prompt(&self, text: &str, info: &ModelInfo) -> Result<Vec<i32>, EngineError> {
        self.encode(text, info.add_bos, false)
    }

    /// Encode `text`. `add_special` prepends BOS when the model wants it;
    /// `parse_special` turns special-token text into the special tokens
    /// (needed for rendered chat templates).
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        match self {
            Tokenizer::Plugin(m) => m.tokenize(text, add_special, parse_special),
            Tokenizer::Hf(t) => {
                let enc = t
                    .encode(text, add_special)
                    .map_err(|e| EngineError::internal(format!("tokenizer: {e}")))?;
                Ok(enc.get_ids().iter().map(|&i| i as i32).collect())
            }
        }
    }
}
