//! Test support: the tiny random-weight `llama` model (spec, SentencePiece-style vocabulary, weights)
//! that inference tests load into real llama.cpp.
//!
//! Everything is a pure function of [`TinyModelSpec`]: the same spec (seed included) always gives
//! the same bytes, so tests can compare outputs across runs.
//!
//! This file holds the spec and the GGUF writer (metadata and random weights); the vocabulary,
//! its token ids and the chat template are in `tiny/vocab.rs`.

use std::path::Path;

use anyhow::{Result, ensure};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::gguf::{GgufValue, GgufWriter};

#[cfg(test)]
mod tests;
mod vocab;

pub use vocab::{
    BOS_ID, CHATML_TEMPLATE, EOS_ID, FIRST_BYTE_ID, FIRST_NORMAL_ID, IM_END_ID, IM_START_ID,
    SPACE_MARKER, UNK_ID, VocabEntry, tiny_vocab,
};

/// Shape and metadata of a tiny model. The weights are laid out for the `llama` architecture
/// whatever `architecture_name_override` says.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyModelSpec {
    /// Seeds the weight RNG; the file is a pure function of the spec.
    pub seed: u64,
    /// Extra normal pieces `▁x0`, `▁x1`, ... appended to the vocabulary (to test larger vocabs).
    pub n_vocab_extra: usize,
    pub n_embd: u32,
    pub n_layer: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub n_ff: u32,
    /// `llama.context_length` (the training context).
    pub context_length: u32,
    /// `tokenizer.chat_template`; `None` writes no template.
    pub chat_template: Option<String>,
    /// Adds `llama.pooling_type = 1` (mean), making the file an embedding model.
    pub embedding: bool,
    /// Written as `general.architecture` and as the prefix of the architecture keys instead of
    /// `llama`, e.g. to test how an unsupported architecture is reported.
    pub architecture_name_override: Option<String>,
    /// `general.file_type` (0 = ALL_F32, which is what the tensors really are).
    pub file_type: u32,
    /// `general.name`.
    pub name: String,
}

impl Default for TinyModelSpec {
    fn default() -> Self {
        Self {
            seed: 0,
            n_vocab_extra: 0,
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            n_head_kv: 2,
            n_ff: 128,
            context_length: 2048,
            chat_template: Some(CHATML_TEMPLATE.to_owned()),
            embedding: false,
            architecture_name_override: None,
            file_type: 0,
            name: "gantry-tiny".to_owned(),
        }
    }
}

impl TinyModelSpec {
    /// The architecture name written to the file.
    pub fn architecture(&self) -> &str {
        self.architecture_name_override
            .as_deref()
            .unwrap_or("llama")
    }
}
/// Standard-normal-ish samples from uniform ones (Irwin-Hall with 4 terms, scaled to unit
/// variance). Pure arithmetic, so the bits do not depend on the platform's libm.
fn normal(rng: &mut StdRng) -> f32 {
    let sum: f32 = (0..4).map(|_| rng.random::<f32>()).sum();
    (sum - 2.0) * 3.0f32.sqrt()
}

// Weight scales, tuned against real llama.cpp so that greedy continuations differ between prompts
// and seeds and do not fall into short cycles within 64 tokens. Embeddings have unit variance and
// dominate the residual stream; sharper attention (QK_GAIN) and stronger value/output projections
// (VO_GAIN) make the next token depend on the context, not just on the current token.
const EMBD_STD: f32 = 1.0;
const OUTPUT_STD: f32 = 0.5;
const ANTI_TIE: f32 = 0.6;
const QK_GAIN: f32 = 3.0;
const VO_GAIN: f32 = 2.0;
/// Output rows of special and byte tokens are multiplied by this, so greedy output is made of
/// normal pieces (printable UTF-8) and generation rarely ends on `</s>`/`<|im_end|>` by itself.
const SPECIAL_OUTPUT_SCALE: f32 = 0.02;

fn random_matrix(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    (0..n).map(|_| normal(rng) * std).collect()
}

/// Writes a tiny F32 `llama` model to `path` (atomically, via a temporary sibling file).
///
/// Weight scales are chosen so that greedy decoding depends on the prompt and does not collapse
/// onto a single token (see the constants above `random_matrix`). The output rows of the special
/// and byte tokens are scaled down 50x, so greedy (and most sampled) output consists of normal,
/// printable pieces; in particular the model practically never emits `</s>` or `<|im_end|>` by
/// itself, so generation runs to the token limit unless a stop string or grammar ends it.
pub fn write_tiny_gguf(path: &Path, spec: &TinyModelSpec) -> Result<()> {
    tiny_gguf_writer(spec)?.write_to(path)
}

/// Builds the writer for [`write_tiny_gguf`] without touching the file system.
pub fn tiny_gguf_writer(spec: &TinyModelSpec) -> Result<GgufWriter> {
    ensure!(
        spec.n_embd > 0 && spec.n_layer > 0 && spec.n_head > 0 && spec.n_head_kv > 0,
        "n_embd, n_layer, n_head and n_head_kv must be positive"
    );
    ensure!(spec.n_ff > 0, "n_ff must be positive");
    ensure!(
        spec.n_embd % spec.n_head == 0,
        "n_embd ({}) must be a multiple of n_head ({})",
        spec.n_embd,
        spec.n_head
    );
    ensure!(
        spec.n_head % spec.n_head_kv == 0,
        "n_head ({}) must be a multiple of n_head_kv ({})",
        spec.n_head,
        spec.n_head_kv
    );
    let head_dim = spec.n_embd / spec.n_head;
    ensure!(
        head_dim % 2 == 0,
        "head size {head_dim} must be even (RoPE)"
    );
    ensure!(spec.context_length > 0, "context_length must be positive");

    let vocab = tiny_vocab(spec);
    let n_vocab = vocab.len();
    let arch = spec.architecture().to_owned();
    ensure!(!arch.is_empty(), "architecture name must not be empty");
    let k = |suffix: &str| format!("{arch}.{suffix}");

    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", GgufValue::String(arch.clone()))?;
    w.add_kv("general.name", GgufValue::String(spec.name.clone()))?;
    w.add_kv("general.file_type", GgufValue::U32(spec.file_type))?;
    w.set_alignment(crate::gguf::DEFAULT_ALIGNMENT)?;

    // llama.cpp reads these with strict types: counts are u32, eps and rope base f32.
    w.add_kv(k("context_length"), GgufValue::U32(spec.context_length))?;
    w.add_kv(k("embedding_length"), GgufValue::U32(spec.n_embd))?;
    w.add_kv(k("block_count"), GgufValue::U32(spec.n_layer))?;
    w.add_kv(k("feed_forward_length"), GgufValue::U32(spec.n_ff))?;
    w.add_kv(k("attention.head_count"), GgufValue::U32(spec.n_head))?;
    w.add_kv(k("attention.head_count_kv"), GgufValue::U32(spec.n_head_kv))?;
    // llama requires n_rot == head size.
    w.add_kv(k("rope.dimension_count"), GgufValue::U32(head_dim))?;
    w.add_kv(k("attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-5))?;
    w.add_kv(k("rope.freq_base"), GgufValue::F32(10000.0))?;
    w.add_kv(k("vocab_size"), GgufValue::U32(n_vocab as u32))?;
    if spec.embedding {
        // LLM_KV_POOLING_TYPE, read for every architecture in llama_model_base::load_hparams.
        w.add_kv(k("pooling_type"), GgufValue::U32(1))?;
    }

    w.add_kv("tokenizer.ggml.model", GgufValue::String("llama".into()))?;
    w.add_kv(
        "tokenizer.ggml.tokens",
        GgufValue::ArrayString(vocab.iter().map(|e| e.piece.clone()).collect()),
    )?;
    w.add_kv(
        "tokenizer.ggml.scores",
        GgufValue::ArrayF32(vocab.iter().map(|e| e.score).collect()),
    )?;
    w.add_kv(
        "tokenizer.ggml.token_type",
        GgufValue::ArrayI32(vocab.iter().map(|e| e.token_type).collect()),
    )?;
    w.add_kv("tokenizer.ggml.bos_token_id", GgufValue::U32(BOS_ID))?;
    w.add_kv("tokenizer.ggml.eos_token_id", GgufValue::U32(EOS_ID))?;
    w.add_kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(UNK_ID))?;
    w.add_kv("tokenizer.ggml.eot_token_id", GgufValue::U32(IM_END_ID))?;
    w.add_kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(true))?;
    w.add_kv("tokenizer.ggml.add_eos_token", GgufValue::Bool(false))?;
    if let Some(template) = &spec.chat_template {
        w.add_kv(
            "tokenizer.chat_template",
            GgufValue::String(template.clone()),
        )?;
    }

    // Tensors, in ggml dim order ([in, out] for matrices) as llama_model_llama::load_arch_tensors
    // expects them.
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let e = spec.n_embd as usize;
    let ff = spec.n_ff as usize;
    let q_dim = e; // n_head * head_dim
    let kv_dim = (spec.n_head_kv * head_dim) as usize;
    let (e64, ff64, v64) = (e as u64, ff as u64, n_vocab as u64);
    let inv_sqrt = |n: usize| 1.0 / (n as f32).sqrt();

    let token_embd = random_matrix(&mut rng, e * n_vocab, EMBD_STD);
    w.add_tensor_f32("token_embd.weight", &[e64, v64], token_embd.clone())?;
    w.add_tensor_f32("output_norm.weight", &[e64], vec![1.0; e])?;
    let mut output = random_matrix(&mut rng, e * n_vocab, OUTPUT_STD);
    // Anti-tie: the residual stream is dominated by the current token's embedding, so subtracting
    // it from that token's output row keeps greedy decoding from sticking on one token.
    for (o, t) in output.iter_mut().zip(&token_embd) {
        *o -= ANTI_TIE * t;
    }
    // Row v (contiguous, length n_embd) produces the logit of token v.
    for row in output.chunks_mut(e).take(FIRST_NORMAL_ID as usize) {
        row.iter_mut().for_each(|x| *x *= SPECIAL_OUTPUT_SCALE);
    }
    w.add_tensor_f32("output.weight", &[e64, v64], output)?;

    for i in 0..spec.n_layer {
        let b = |name: &str| format!("blk.{i}.{name}.weight");
        w.add_tensor_f32(b("attn_norm"), &[e64], vec![1.0; e])?;
        w.add_tensor_f32(
            b("attn_q"),
            &[e64, q_dim as u64],
            random_matrix(&mut rng, e * q_dim, QK_GAIN * inv_sqrt(e)),
        )?;
        w.add_tensor_f32(
            b("attn_k"),
            &[e64, kv_dim as u64],
            random_matrix(&mut rng, e * kv_dim, QK_GAIN * inv_sqrt(e)),
        )?;
        w.add_tensor_f32(
            b("attn_v"),
            &[e64, kv_dim as u64],
            random_matrix(&mut rng, e * kv_dim, VO_GAIN * inv_sqrt(e)),
        )?;
        w.add_tensor_f32(
            b("attn_output"),
            &[q_dim as u64, e64],
            random_matrix(&mut rng, q_dim * e, VO_GAIN * inv_sqrt(q_dim)),
        )?;
        w.add_tensor_f32(b("ffn_norm"), &[e64], vec![1.0; e])?;
        w.add_tensor_f32(
            b("ffn_gate"),
            &[e64, ff64],
            random_matrix(&mut rng, e * ff, inv_sqrt(e)),
        )?;
        w.add_tensor_f32(
            b("ffn_up"),
            &[e64, ff64],
            random_matrix(&mut rng, e * ff, inv_sqrt(e)),
        )?;
        w.add_tensor_f32(
            b("ffn_down"),
            &[ff64, e64],
            random_matrix(&mut rng, ff * e, inv_sqrt(ff)),
        )?;
    }
    Ok(w)
}
