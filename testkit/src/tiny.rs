//! Test support: the tiny random-weight `llama` model (spec, SentencePiece-style vocabulary, weights)
//! that inference tests load into real llama.cpp.
//!
//! Everything is a pure function of [`TinyModelSpec`]: the same spec (seed included) always gives
//! the same bytes, so tests can compare outputs across runs.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{Result, ensure};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::gguf::{GgufValue, GgufWriter};

/// `<unk>`, llama.cpp's `tokenizer.ggml.unknown_token_id`.
pub const UNK_ID: u32 = 0;
/// `<s>`, added in front of every prompt (`add_bos_token = true`).
pub const BOS_ID: u32 = 1;
/// `</s>`, end of generation.
pub const EOS_ID: u32 = 2;
/// `<|im_start|>` (control token, ChatML).
pub const IM_START_ID: u32 = 3;
/// `<|im_end|>` (control token, ChatML); also `tokenizer.ggml.eot_token_id`, so it ends generation.
pub const IM_END_ID: u32 = 4;
/// `<0x00>`; byte `b` is token `FIRST_BYTE_ID + b`.
pub const FIRST_BYTE_ID: u32 = 5;
/// First normal piece (`▁`); normal pieces run from here to the end of the vocabulary.
pub const FIRST_NORMAL_ID: u32 = FIRST_BYTE_ID + 256;

/// SentencePiece's word-boundary marker (U+2581), which stands for a space.
pub const SPACE_MARKER: char = '\u{2581}';

/// A small ChatML template (the `<|im_start|>role\ncontent<|im_end|>\n` format), which llama.cpp
/// also recognises by name.
pub const CHATML_TEMPLATE: &str = concat!(
    "{% for message in messages %}",
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
    "{% endfor %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
);

/// Words that get whole-word pieces (with the `▁` prefix, and every prefix of them so that
/// SentencePiece's pairwise merging can reach them).
const WORDS: &[&str] = &[
    "the",
    "a",
    "an",
    "is",
    "of",
    "and",
    "to",
    "in",
    "it",
    "that",
    "what",
    "What",
    "The",
    "Paris",
    "capital",
    "France",
    "Question",
    "Answer",
    "Hello",
    "hello",
    "world",
    "city",
    "country",
    "you",
    "are",
    "was",
    "for",
    "on",
    "with",
    "this",
    "one",
    "two",
    "three",
    "yes",
    "no",
    "name",
    "user",
    "assistant",
    "system",
    "model",
    "test",
];

// llama.cpp's `llama_token_type` values written to `tokenizer.ggml.token_type`.
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_BYTE: i32 = 6;

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

/// One vocabulary entry.
#[derive(Debug, Clone, PartialEq)]
pub struct VocabEntry {
    pub piece: String,
    pub score: f32,
    /// llama.cpp token type (1 normal, 2 unknown, 3 control, 6 byte).
    pub token_type: i32,
}

/// The vocabulary: specials (ids 0..=4), the 256 byte tokens (ids 5..=260), then normal pieces
/// starting at [`FIRST_NORMAL_ID`]. Pieces are unique (llama.cpp asserts that).
///
/// Normal pieces score their length in characters, so the SentencePiece merger prefers longer
/// pieces; specials and bytes score 0 (bytes are only a fallback).
pub fn tiny_vocab(spec: &TinyModelSpec) -> Vec<VocabEntry> {
    let mut entries = Vec::new();
    let mut push = |piece: String, score: f32, token_type: i32| {
        entries.push(VocabEntry {
            piece,
            score,
            token_type,
        });
    };
    push("<unk>".into(), 0.0, TYPE_UNKNOWN);
    push("<s>".into(), 0.0, TYPE_CONTROL);
    push("</s>".into(), 0.0, TYPE_CONTROL);
    push("<|im_start|>".into(), 0.0, TYPE_CONTROL);
    push("<|im_end|>".into(), 0.0, TYPE_CONTROL);
    for b in 0..=255u8 {
        push(format!("<0x{b:02X}>"), 0.0, TYPE_BYTE);
    }

    let mut normal: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut add = |piece: String| {
        if seen.insert(piece.clone()) {
            normal.push(piece);
        }
    };
    add(SPACE_MARKER.to_string());
    // Printable ASCII except the space (which SentencePiece turns into `▁`).
    for c in '!'..='~' {
        add(c.to_string());
    }
    for c in '!'..='~' {
        add(format!("{SPACE_MARKER}{c}"));
    }
    for word in WORDS {
        // Every prefix `▁w`, `▁wo`, ... up to the whole word: the SPM merger only joins two
        // adjacent pieces when their concatenation is itself a piece.
        let mut piece = SPACE_MARKER.to_string();
        for c in word.chars() {
            piece.push(c);
            add(piece.clone());
        }
    }
    for i in 0..spec.n_vocab_extra {
        add(format!("{SPACE_MARKER}x{i}"));
    }
    for piece in normal {
        let score = piece.chars().count() as f32;
        push(piece, score, TYPE_NORMAL);
    }
    entries
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{read_gguf_header, read_gguf_metadata};
    use serde_json::json;
    use std::fs;

    fn write(spec: &TinyModelSpec) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, spec).expect("write tiny gguf");
        (dir, path)
    }

    #[test]
    fn vocabulary_layout() {
        let vocab = tiny_vocab(&TinyModelSpec::default());
        assert!(
            (400..=600).contains(&vocab.len()),
            "vocab size {}",
            vocab.len()
        );
        let piece = |id: u32| vocab[id as usize].piece.as_str();
        assert_eq!(piece(UNK_ID), "<unk>");
        assert_eq!(piece(BOS_ID), "<s>");
        assert_eq!(piece(EOS_ID), "</s>");
        assert_eq!(piece(IM_START_ID), "<|im_start|>");
        assert_eq!(piece(IM_END_ID), "<|im_end|>");
        assert_eq!(piece(FIRST_BYTE_ID), "<0x00>");
        assert_eq!(piece(FIRST_BYTE_ID + 0x0A), "<0x0A>");
        assert_eq!(piece(FIRST_NORMAL_ID - 1), "<0xFF>");
        assert_eq!(piece(FIRST_NORMAL_ID), "▁");
        assert_eq!(vocab[IM_END_ID as usize].token_type, 3);
        assert_eq!(vocab[FIRST_BYTE_ID as usize].token_type, 6);

        let unique: HashSet<&str> = vocab.iter().map(|e| e.piece.as_str()).collect();
        assert_eq!(unique.len(), vocab.len(), "pieces must be unique");
        // Whole words are reachable by pairwise merges: every prefix is a piece too.
        for p in [
            "▁P", "▁Pa", "▁Par", "▁Pari", "▁Paris", "▁the", "a", "▁a", "?",
        ] {
            assert!(unique.contains(p), "missing {p}");
        }

        let extra = tiny_vocab(&TinyModelSpec {
            n_vocab_extra: 20,
            ..TinyModelSpec::default()
        });
        assert_eq!(extra.len(), vocab.len() + 20);
    }

    #[test]
    fn metadata_is_what_llama_cpp_reads() {
        let (_dir, path) = write(&TinyModelSpec::default());
        let m = read_gguf_metadata(&path).expect("metadata");
        let n_vocab = tiny_vocab(&TinyModelSpec::default()).len();
        assert_eq!(m["general.architecture"], json!("llama"));
        assert_eq!(m["general.name"], json!("gantry-tiny"));
        assert_eq!(m["general.file_type"], json!(0));
        assert_eq!(m["general.alignment"], json!(32));
        assert_eq!(m["llama.context_length"], json!(2048));
        assert_eq!(m["llama.embedding_length"], json!(64));
        assert_eq!(m["llama.block_count"], json!(2));
        assert_eq!(m["llama.feed_forward_length"], json!(128));
        assert_eq!(m["llama.attention.head_count"], json!(4));
        assert_eq!(m["llama.attention.head_count_kv"], json!(2));
        assert_eq!(m["llama.rope.dimension_count"], json!(16));
        assert_eq!(m["llama.vocab_size"], json!(n_vocab));
        assert!(
            m["llama.attention.layer_norm_rms_epsilon"]
                .as_f64()
                .is_some()
        );
        assert_eq!(m["llama.rope.freq_base"], json!(10000.0));
        assert!(!m.contains_key("llama.pooling_type"));
        assert_eq!(m["tokenizer.ggml.model"], json!("llama"));
        assert_eq!(
            m["tokenizer.ggml.tokens"].as_array().map(Vec::len),
            Some(n_vocab)
        );
        assert_eq!(
            m["tokenizer.ggml.scores"].as_array().map(Vec::len),
            Some(n_vocab)
        );
        assert_eq!(
            m["tokenizer.ggml.token_type"].as_array().map(Vec::len),
            Some(n_vocab)
        );
        assert_eq!(m["tokenizer.ggml.bos_token_id"], json!(BOS_ID));
        assert_eq!(m["tokenizer.ggml.eos_token_id"], json!(EOS_ID));
        assert_eq!(m["tokenizer.ggml.unknown_token_id"], json!(UNK_ID));
        assert_eq!(m["tokenizer.ggml.eot_token_id"], json!(IM_END_ID));
        assert_eq!(m["tokenizer.ggml.add_bos_token"], json!(true));
        assert_eq!(m["tokenizer.ggml.add_eos_token"], json!(false));
        assert_eq!(m["tokenizer.chat_template"], json!(CHATML_TEMPLATE));
    }

    #[test]
    fn tensors_are_complete_aligned_and_sized() {
        let spec = TinyModelSpec::default();
        let (_dir, path) = write(&spec);
        let h = read_gguf_header(&path).expect("header");
        let n_vocab = tiny_vocab(&spec).len() as u64;
        // 3 global tensors + 9 per block.
        assert_eq!(h.tensors.len(), 3 + 9 * spec.n_layer as usize);
        assert_eq!(h.data_offset % 32, 0);
        let by_name = |n: &str| {
            h.tensors
                .iter()
                .find(|t| t.name == n)
                .unwrap_or_else(|| panic!("missing tensor {n}"))
        };
        assert_eq!(by_name("token_embd.weight").dims, vec![64, n_vocab]);
        assert_eq!(by_name("output.weight").dims, vec![64, n_vocab]);
        assert_eq!(by_name("output_norm.weight").dims, vec![64]);
        assert_eq!(by_name("blk.1.attn_q.weight").dims, vec![64, 64]);
        assert_eq!(by_name("blk.1.attn_k.weight").dims, vec![64, 32]);
        assert_eq!(by_name("blk.1.attn_v.weight").dims, vec![64, 32]);
        assert_eq!(by_name("blk.1.attn_output.weight").dims, vec![64, 64]);
        assert_eq!(by_name("blk.0.ffn_gate.weight").dims, vec![64, 128]);
        assert_eq!(by_name("blk.0.ffn_up.weight").dims, vec![64, 128]);
        assert_eq!(by_name("blk.0.ffn_down.weight").dims, vec![128, 64]);

        // Offsets are aligned and contiguous (llama.cpp requires offset == running padded size).
        let mut expected = 0u64;
        for t in &h.tensors {
            assert_eq!(t.offset % 32, 0, "{} misaligned", t.name);
            assert_eq!(t.offset, expected, "{} not contiguous", t.name);
            let bytes = t.dims.iter().product::<u64>() * 4;
            expected += bytes.div_ceil(32) * 32;
        }
        let bytes = fs::read(&path).expect("bytes");
        assert_eq!(bytes.len() as u64, h.data_offset + expected);

        // Norm weights are exactly 1.0; all weights are finite.
        let t = by_name("blk.1.ffn_norm.weight");
        let start = (h.data_offset + t.offset) as usize;
        let data = &bytes[start..start + 64 * 4];
        assert!(
            data.chunks(4)
                .all(|c| f32::from_le_bytes(c.try_into().expect("4")) == 1.0)
        );
        let all = &bytes[h.data_offset as usize..];
        assert!(
            all.chunks(4)
                .all(|c| f32::from_le_bytes(c.try_into().expect("4")).is_finite())
        );
    }

    #[test]
    fn deterministic_per_seed() {
        let a = tiny_gguf_writer(&TinyModelSpec::default())
            .expect("a")
            .to_bytes();
        let b = tiny_gguf_writer(&TinyModelSpec::default())
            .expect("b")
            .to_bytes();
        assert_eq!(a, b);
        let (_dir, path) = write(&TinyModelSpec::default());
        assert_eq!(fs::read(&path).expect("file"), a, "file == in-memory bytes");
        let c = tiny_gguf_writer(&TinyModelSpec {
            seed: 1,
            ..TinyModelSpec::default()
        })
        .expect("c")
        .to_bytes();
        assert_eq!(a.len(), c.len());
        assert_ne!(a, c);
    }

    #[test]
    fn variants() {
        let (_d1, emb) = write(&TinyModelSpec {
            embedding: true,
            ..TinyModelSpec::default()
        });
        let m = read_gguf_metadata(&emb).expect("metadata");
        assert_eq!(m["llama.pooling_type"], json!(1));

        let (_d2, unknown) = write(&TinyModelSpec {
            architecture_name_override: Some("unknownarch".into()),
            chat_template: None,
            context_length: 512,
            file_type: 7,
            ..TinyModelSpec::default()
        });
        let m = read_gguf_metadata(&unknown).expect("metadata");
        assert_eq!(m["general.architecture"], json!("unknownarch"));
        assert_eq!(m["unknownarch.context_length"], json!(512));
        assert_eq!(m["general.file_type"], json!(7));
        assert!(!m.contains_key("llama.context_length"));
        assert!(!m.contains_key("tokenizer.chat_template"));
    }

    #[test]
    fn rejects_inconsistent_shapes() {
        for spec in [
            TinyModelSpec {
                n_head: 5,
                ..TinyModelSpec::default()
            },
            TinyModelSpec {
                n_head_kv: 3,
                ..TinyModelSpec::default()
            },
            TinyModelSpec {
                n_layer: 0,
                ..TinyModelSpec::default()
            },
        ] {
            assert!(tiny_gguf_writer(&spec).is_err(), "{spec:?}");
        }
    }
}
