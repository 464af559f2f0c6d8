//! Test support: tiny random-weight Hugging Face model directories (`config.json`,
//! `tokenizer.json`, `tokenizer_config.json`, safetensors weights) for the native engine's
//! tests, one per architecture it runs.
//!
//! Each family is written with the details that set it apart, so a test that runs them all
//! covers them: Llama with llama3 RoPE scaling (f32, one file), Mistral with a sliding window
//! (f16, two shards and an index), Qwen2 with q/k/v biases, tied embeddings and YaRN (bf16,
//! byte-level tokenizer), Qwen3 with q/k norms and an explicit head size (bf16, shards, linear
//! scaling), Gemma 3 with sliding and global layers, two RoPE bases, (1 + w) norms, GELU and
//! soft-capping (f32). Everything is a pure function of the family and the seed.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};

use crate::tiny::{CHATML_TEMPLATE, TinyModelSpec, tiny_vocab};

/// The architectures `write_tiny_hf` can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfFamily {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl HfFamily {
    pub const ALL: [HfFamily; 5] = [
        HfFamily::Llama,
        HfFamily::Mistral,
        HfFamily::Qwen2,
        HfFamily::Qwen3,
        HfFamily::Gemma3,
    ];

    pub fn name(self) -> &'static str {
        match self {
            HfFamily::Llama => "llama",
            HfFamily::Mistral => "mistral",
            HfFamily::Qwen2 => "qwen2",
            HfFamily::Qwen3 => "qwen3",
            HfFamily::Gemma3 => "gemma3",
        }
    }

    pub fn parse(s: &str) -> Option<HfFamily> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    fn class(self) -> &'static str {
        match self {
            HfFamily::Llama => "LlamaForCausalLM",
            HfFamily::Mistral => "MistralForCausalLM",
            HfFamily::Qwen2 => "Qwen2ForCausalLM",
            HfFamily::Qwen3 => "Qwen3ForCausalLM",
            HfFamily::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    fn dtype(self) -> Dtype {
        match self {
            HfFamily::Llama | HfFamily::Gemma3 => Dtype::F32,
            HfFamily::Mistral => Dtype::F16,
            HfFamily::Qwen2 | HfFamily::Qwen3 => Dtype::BF16,
        }
    }

    fn shards(self) -> usize {
        match self {
            HfFamily::Mistral | HfFamily::Qwen3 => 2,
            _ => 1,
        }
    }

    fn byte_level(self) -> bool {
        matches!(self, HfFamily::Qwen2 | HfFamily::Qwen3)
    }
}

const HIDDEN: usize = 64;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const FF: usize = 128;

/// GPT-2's byte-to-unicode table (byte-level BPE writes every byte as one printable char).
fn byte_to_char() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        table[b as usize] = char::from_u32(c).unwrap_or('?');
    }
    table
}

/// SentencePiece-style vocabulary as a `tokenizers` BPE model: the tiny GGUF's vocabulary,
/// merges ranked by the merged piece's score (as transformers converts SentencePiece models).
fn spm_tokenizer() -> (Value, Value, usize) {
    let vocab = tiny_vocab(&TinyModelSpec::default());
    let ids: BTreeMap<&str, usize> = vocab
        .iter()
        .enumerate()
        .map(|(i, e)| (e.piece.as_str(), i))
        .collect();
    let mut merges: Vec<(f32, usize, String, String)> = Vec::new();
    for e in vocab.iter().filter(|e| e.token_type == 1) {
        let chars: Vec<char> = e.piece.chars().collect();
        let mut local = Vec::new();
        for k in 1..chars.len() {
            let (l, r): (String, String) =
                (chars[..k].iter().collect(), chars[k..].iter().collect());
            if let (Some(&li), Some(&ri)) = (ids.get(l.as_str()), ids.get(r.as_str()))
                && vocab[li].token_type == 1
                && vocab[ri].token_type == 1
            {
                local.push((li, ri, l, r));
            }
        }
        local.sort();
        for (n, (_, _, l, r)) in local.into_iter().enumerate() {
            merges.push((e.score, n, l, r));
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let added: Vec<Value> = vocab
        .iter()
        .enumerate()
        .filter(|(_, e)| e.token_type == 2 || e.token_type == 3)
        .map(|(i, e)| {
            json!({"id": i, "content": e.piece, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let vmap: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, e)| (e.piece.clone(), json!(i)))
        .collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vmap,
                  "merges": merges.iter().map(|m| json!([m.2, m.3])).collect::<Vec<_>>()}
    });
    let config = json!({
        "add_bos_token": true, "add_eos_token": false,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHATML_TEMPLATE,
    });
    (tok, config, vocab.len())
}

/// Byte-level BPE (Qwen's kind): the 256 byte characters, merges up to a few whole words, and
/// ChatML's special tokens after them.
fn byte_level_tokenizer() -> (Value, Value, usize) {
    let b2c = byte_to_char();
    let mut vocab: Vec<String> = b2c.iter().map(|c| c.to_string()).collect();
    let mut merges: Vec<(String, String)> = Vec::new();
    let words = [
        " the", " capital", " of", " France", " is", " Paris", "Question", "Answer", " Hello",
        " world", " city", " you", " are", " a", " and", "ing", " what", " What",
    ];
    for w in words {
        let chars: Vec<String> = w.bytes().map(|b| b2c[b as usize].to_string()).collect();
        let mut cur = chars[0].clone();
        for c in &chars[1..] {
            let next = format!("{cur}{c}");
            if !vocab.contains(&next) {
                merges.push((cur.clone(), c.clone()));
                vocab.push(next.clone());
            }
            cur = next;
        }
    }
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let first_special = vocab.len();
    let vmap: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, p)| (p.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": first_special + i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vmap,
                  "merges": merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>()}
    });
    let config = json!({
        "add_bos_token": false, "add_eos_token": false,
        "bos_token": null, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    });
    (tok, config, first_special + specials.len())
}

fn normal(rng: &mut StdRng) -> f32 {
    let sum: f32 = (0..4).map(|_| rng.random::<f32>()).sum();
    (sum - 2.0) * 3.0f32.sqrt()
}

struct Tensors {
    rng: StdRng,
    dtype: Dtype,
    tensors: Vec<(String, Vec<usize>, Vec<u8>)>,
}

impl Tensors {
    fn encode(&self, values: &[f32]) -> Vec<u8> {
        match self.dtype {
            Dtype::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::BF16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// Standard-normal values times `std`, plus `mean`.
    fn add(&mut self, name: impl Into<String>, shape: &[usize], std: f32, mean: f32) {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| mean + normal(&mut self.rng) * std).collect();
        let bytes = self.encode(&values);
        self.tensors.push((name.into(), shape.to_vec(), bytes));
    }
}

/// Write a tiny `family` model into `dir` (created if needed).
pub fn write_tiny_hf(dir: &Path, family: HfFamily, seed: u64) -> Result<()> {
    write_tiny_hf_with_head_dim(dir, family, seed, None)
}

/// [`write_tiny_hf`] with the attention heads' size set (the families that state it in their
/// config, Qwen3 and Gemma 3), for the head sizes real models have (128, 256) where kernels
/// take other paths than for the tiny default of 32.
pub fn write_tiny_hf_with_head_dim(
    dir: &Path,
    family: HfFamily,
    seed: u64,
    head_dim: Option<usize>,
) -> Result<()> {
    anyhow::ensure!(
        head_dim.is_none() || matches!(family, HfFamily::Qwen3 | HfFamily::Gemma3),
        "{}: its config has no head_dim to set",
        family.name()
    );
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    let (tokenizer, tok_config, n_tokens) = if family.byte_level() {
        byte_level_tokenizer()
    } else {
        spm_tokenizer()
    };
    let vocab = n_tokens + 3; // a few ids past the tokenizer, as real checkpoints pad
    let head_dim = match family {
        HfFamily::Qwen3 | HfFamily::Gemma3 => head_dim.unwrap_or(32),
        _ => HIDDEN / HEADS,
    };
    let mut config = json!({
        "architectures": [family.class()],
        "model_type": family.name(),
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": FF,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "torch_dtype": match family.dtype() { Dtype::F16 => "float16", Dtype::BF16 => "bfloat16", _ => "float32" },
    });
    let c = config.as_object_mut().context("object")?;
    let mut put = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    match family {
        HfFamily::Llama => {
            put("hidden_act", json!("silu"));
            put("rope_theta", json!(10000.0));
            put(
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            );
            put("tie_word_embeddings", json!(false));
            put("bos_token_id", json!(1));
            put("eos_token_id", json!(2));
        }
        HfFamily::Mistral => {
            put("hidden_act", json!("silu"));
            put("rope_theta", json!(10000.0));
            put("sliding_window", json!(8));
            put("tie_word_embeddings", json!(false));
            put("bos_token_id", json!(1));
            put("eos_token_id", json!(2));
        }
        HfFamily::Qwen2 => {
            put("hidden_act", json!("silu"));
            put("rope_theta", json!(10000.0));
            put(
                "rope_scaling",
                json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
            );
            put("tie_word_embeddings", json!(true));
            put("use_sliding_window", json!(false));
            put("sliding_window", json!(512));
            put("eos_token_id", json!(n_tokens - 1));
        }
        HfFamily::Qwen3 => {
            put("hidden_act", json!("silu"));
            put("head_dim", json!(head_dim));
            put("rope_theta", json!(1000000.0));
            put(
                "rope_scaling",
                json!({"rope_type": "linear", "factor": 2.0}),
            );
            put("tie_word_embeddings", json!(false));
            put("attention_bias", json!(false));
            put("eos_token_id", json!(n_tokens - 1));
        }
        HfFamily::Gemma3 => {
            put("hidden_activation", json!("gelu_pytorch_tanh"));
            put("head_dim", json!(head_dim));
            put("rope_theta", json!(1000000.0));
            put("rope_local_base_freq", json!(10000.0));
            put("sliding_window", json!(4));
            put(
                "layer_types",
                json!(["sliding_attention", "full_attention"]),
            );
            put("query_pre_attn_scalar", json!(24));
            put("attn_logit_softcapping", json!(5.0));
            put("final_logit_softcapping", json!(3.0));
            put("tie_word_embeddings", json!(true));
            put("bos_token_id", json!(1));
            put("eos_token_id", json!([2, 4]));
        }
    }

    let mut t = Tensors {
        rng: StdRng::seed_from_u64(seed ^ (family as u64).wrapping_mul(0x9E37_79B9)),
        dtype: family.dtype(),
        tensors: Vec::new(),
    };
    let inv = |n: usize| 1.0 / (n as f32).sqrt();
    let (q_dim, kv_dim) = (HEADS * head_dim, KV_HEADS * head_dim);
    // Gemma multiplies by (1 + w): its norm weights sit around 0, the others' around 1.
    let norm_mean = if family == HfFamily::Gemma3 { 0.0 } else { 1.0 };
    t.add("model.embed_tokens.weight", &[vocab, HIDDEN], 1.0, 0.0);
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        t.add(
            format!("{p}.input_layernorm.weight"),
            &[HIDDEN],
            0.1,
            norm_mean,
        );
        t.add(
            format!("{p}.self_attn.q_proj.weight"),
            &[q_dim, HIDDEN],
            2.0 * inv(HIDDEN),
            0.0,
        );
        t.add(
            format!("{p}.self_attn.k_proj.weight"),
            &[kv_dim, HIDDEN],
            2.0 * inv(HIDDEN),
            0.0,
        );
        t.add(
            format!("{p}.self_attn.v_proj.weight"),
            &[kv_dim, HIDDEN],
            2.0 * inv(HIDDEN),
            0.0,
        );
        t.add(
            format!("{p}.self_attn.o_proj.weight"),
            &[HIDDEN, q_dim],
            2.0 * inv(q_dim),
            0.0,
        );
        if family == HfFamily::Qwen2 {
            t.add(format!("{p}.self_attn.q_proj.bias"), &[q_dim], 0.5, 0.0);
            t.add(format!("{p}.self_attn.k_proj.bias"), &[kv_dim], 0.5, 0.0);
            t.add(format!("{p}.self_attn.v_proj.bias"), &[kv_dim], 0.5, 0.0);
        }
        if matches!(family, HfFamily::Qwen3 | HfFamily::Gemma3) {
            t.add(
                format!("{p}.self_attn.q_norm.weight"),
                &[head_dim],
                0.1,
                norm_mean,
            );
            t.add(
                format!("{p}.self_attn.k_norm.weight"),
                &[head_dim],
                0.1,
                norm_mean,
            );
        }
        t.add(
            format!("{p}.post_attention_layernorm.weight"),
            &[HIDDEN],
            0.1,
            norm_mean,
        );
        if family == HfFamily::Gemma3 {
            t.add(
                format!("{p}.pre_feedforward_layernorm.weight"),
                &[HIDDEN],
                0.1,
                norm_mean,
            );
            t.add(
                format!("{p}.post_feedforward_layernorm.weight"),
                &[HIDDEN],
                0.1,
                norm_mean,
            );
        }
        t.add(
            format!("{p}.mlp.gate_proj.weight"),
            &[FF, HIDDEN],
            inv(HIDDEN),
            0.0,
        );
        t.add(
            format!("{p}.mlp.up_proj.weight"),
            &[FF, HIDDEN],
            inv(HIDDEN),
            0.0,
        );
        t.add(
            format!("{p}.mlp.down_proj.weight"),
            &[HIDDEN, FF],
            inv(FF),
            0.0,
        );
    }
    t.add("model.norm.weight", &[HIDDEN], 0.1, norm_mean);
    if !matches!(family, HfFamily::Qwen2 | HfFamily::Gemma3) {
        t.add(
            "lm_head.weight",
            &[vocab, HIDDEN],
            0.5 * inv(HIDDEN) * 8.0,
            0.0,
        );
    }

    // Shards: tensors split in order; an index when there is more than one file.
    let n = family.shards();
    let per = t.tensors.len().div_ceil(n);
    let mut weight_map = serde_json::Map::new();
    for (s, chunk) in t.tensors.chunks(per).enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", s + 1)
        };
        let views: Vec<(String, TensorView<'_>)> = chunk
            .iter()
            .map(|(name, shape, bytes)| {
                weight_map.insert(name.clone(), json!(file));
                TensorView::new(family.dtype(), shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| anyhow::anyhow!("{name}: {e}"))
            })
            .collect::<Result<_>>()?;
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(views, Some(meta), &dir.join(&file))
            .map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
    }
    if n > 1 {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&json!({"metadata": {}, "weight_map": weight_map}))?,
        )?;
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_string(&tokenizer)?,
    )?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tok_config)?,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_writes_a_complete_directory() {
        for f in HfFamily::ALL {
            let dir = tempfile::tempdir().expect("tempdir");
            write_tiny_hf(dir.path(), f, 0).expect("write");
            let cfg: Value = serde_json::from_slice(
                &std::fs::read(dir.path().join("config.json")).expect("cfg"),
            )
            .expect("json");
            assert_eq!(cfg["architectures"][0], f.class());
            assert!(dir.path().join("tokenizer.json").is_file());
            if f.shards() > 1 {
                assert!(dir.path().join("model.safetensors.index.json").is_file());
                assert!(
                    dir.path()
                        .join("model-00002-of-00002.safetensors")
                        .is_file()
                );
            } else {
                assert!(dir.path().join("model.safetensors").is_file());
            }
        }
    }
}
