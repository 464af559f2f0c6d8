//! Native engine, embedding models (engine layer, below the engine host's `embed`): BERT-style
//! encoders (`BertModel`) from a sentence-transformers directory, one input or a batch per
//! call.
//!
//! Load: `config.json` (the encoder's shape), the tensors by their transformers names (with or
//! without the `bert.` prefix of a checkpoint saved from a task head), and the pooling the
//! model declares: `modules.json` names a `Pooling` module whose `config.json` picks mean, CLS,
//! max or mean-sqrt-len pooling, and a `Normalize` module when the vector is L2-normalised
//! (`sentence_bert_config.json` `max_seq_length` caps the input). A directory without
//! `modules.json` gets mean pooling and L2 normalisation, the sentence-transformers default.
//!
//! Embed: word, position and token-type embeddings, a LayerNorm, then each post-LN layer
//! (bidirectional self-attention over the whole input, GELU feed-forward), then pooling. A
//! batch stacks its inputs' tokens as the rows of one matrix: the products run once over all
//! of them, attention and pooling within each input's rows. The linear layers are the CPU
//! backend's products ([`crate::cpu::matmul::Linear`]), on the engine's own thread pool. No KV cache, no sampling: `step` is refused, `embed` is the call.

use std::path::Path;
use std::sync::Arc;

use gantry_engine_abi::{EngineError, Status};
use serde_json::Value;

use rayon::prelude::*;

use crate::cpu::matmul::{Linear, dot};
use crate::cpu::ops;
use crate::weights::Weights;

/// How token vectors become one embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    Mean,
    Cls,
    Max,
    MeanSqrtLen,
}

/// Hyper-parameters of a BERT encoder and the pooling its directory declares.
#[derive(Clone, Debug)]
pub struct EncoderConfig {
    pub class: String,
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_position: usize,
    pub type_vocab: usize,
    pub eps: f32,
    pub pooling: Pooling,
    pub normalize: bool,
    /// The longest input embedded (`max_seq_length`, else the position table's length).
    pub max_tokens: usize,
}

/// The encoder classes this engine runs.
pub const CLASSES: [&str; 1] = ["BertModel"];

fn corrupt(msg: impl Into<String>) -> EngineError {
    EngineError::new(Status::ModelCorrupt, msg.into())
}

fn unsupported(msg: impl Into<String>) -> EngineError {
    EngineError::unsupported(msg.into())
}

/// A JSON file of the model directory, `None` when there is none.
pub(crate) fn read_json(path: &Path) -> Result<Option<Value>, EngineError> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| corrupt(format!("{} is not valid JSON: {e}", path.display()))),
        Err(_) => Ok(None),
    }
}

fn positive(v: &Value, key: &str) -> Result<usize, EngineError> {
    v.get(key)
        .and_then(Value::as_u64)
        .filter(|n| *n > 0 && *n <= 1 << 31)
        .map(|n| n as usize)
        .ok_or_else(|| corrupt(format!("config.json `{key}` must be a positive integer")))
}

impl EncoderConfig {
    /// `config.json` (already parsed) and the sentence-transformers files beside it.
    pub fn read(dir: &Path, config: &Value, class: &str) -> Result<Self, EngineError> {
        if let Some(t) = config
            .get("position_embedding_type")
            .and_then(Value::as_str)
            && t != "absolute"
        {
            return Err(unsupported(format!(
                "config.json `position_embedding_type` `{t}`: the native engine's encoders take absolute positions"
            )));
        }
        match config.get("hidden_act").and_then(Value::as_str) {
            None | Some("gelu") => {}
            Some(other) => {
                return Err(unsupported(format!(
                    "config.json `hidden_act` `{other}`: the native engine's encoders run gelu"
                )));
            }
        }
        let hidden = positive(config, "hidden_size")?;
        let n_heads = positive(config, "num_attention_heads")?;
        if hidden % n_heads != 0 {
            return Err(corrupt(format!(
                "config.json `hidden_size` ({hidden}) is not a multiple of `num_attention_heads` ({n_heads})"
            )));
        }
        let max_position = positive(config, "max_position_embeddings")?;
        let (pooling, normalize) = pooling(dir)?;
        let max_tokens = read_json(&dir.join("sentence_bert_config.json"))?
            .and_then(|v| v.get("max_seq_length").and_then(Value::as_u64))
            .map_or(max_position, |n| (n as usize).min(max_position));
        Ok(Self {
            class: class.to_string(),
            hidden,
            n_layers: positive(config, "num_hidden_layers")?,
            n_heads,
            intermediate: positive(config, "intermediate_size")?,
            vocab: positive(config, "vocab_size")?,
            max_position,
            type_vocab: positive(config, "type_vocab_size")?,
            eps: config
                .get("layer_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-12) as f32,
            pooling,
            normalize,
            max_tokens,
        })
    }
}

/// The pooling and normalisation `modules.json` declares (sentence-transformers' layout).
fn pooling(dir: &Path) -> Result<(Pooling, bool), EngineError> {
    let Some(modules) = read_json(&dir.join("modules.json"))? else {
        return Ok((Pooling::Mean, true));
    };
    let Value::Array(modules) = modules else {
        return Err(corrupt("modules.json must be a list of modules"));
    };
    let of_type = |suffix: &str| {
        modules.iter().find(|m| {
            m.get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.ends_with(suffix))
        })
    };
    let normalize = of_type(".Normalize").is_some();
    let Some(pool) = of_type(".Pooling") else {
        return Err(unsupported(
            "modules.json has no Pooling module: the native engine embeds with pooled token vectors",
        ));
    };
    let sub = pool.get("path").and_then(Value::as_str).unwrap_or("");
    let cfg_path = dir.join(sub).join("config.json");
    let cfg = read_json(&cfg_path)?
        .ok_or_else(|| corrupt(format!("{} is missing", cfg_path.display())))?;
    let on = |key: &str| cfg.get(key).and_then(Value::as_bool).unwrap_or(false);
    let modes = [
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_max_tokens", Pooling::Max),
        ("pooling_mode_mean_sqrt_len_tokens", Pooling::MeanSqrtLen),
    ];
    let chosen: Vec<Pooling> = modes
        .iter()
        .filter(|(k, _)| on(k))
        .map(|(_, p)| *p)
        .collect();
    match chosen.as_slice() {
        [p] => Ok((*p, normalize)),
        [] => Err(unsupported(format!(
            "{} turns no pooling mode on",
            cfg_path.display()
        ))),
        _ => Err(unsupported(format!(
            "{} turns several pooling modes on (their concatenation is not implemented)",
            cfg_path.display()
        ))),
    }
}

pub(crate) struct LayerNorm {
    pub(crate) w: Vec<f32>,
    pub(crate) b: Vec<f32>,
}

struct EncoderLayer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    attn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    out_norm: LayerNorm,
}

/// A loaded encoder: its weights and the thread pool its products run on.
pub struct Encoder {
    pub cfg: EncoderConfig,
    weights: Arc<Weights>,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    embed_norm: LayerNorm,
    layers: Vec<EncoderLayer>,
    pool: rayon::ThreadPool,
}

impl Encoder {
    pub fn load(
        cfg: EncoderConfig,
        weights: Arc<Weights>,
        threads: usize,
    ) -> Result<Self, EngineError> {
        let prefix = if weights.contains("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        let w = &*weights;
        let h = cfg.hidden;
        let vec = |name: &str, len: usize| -> Result<Vec<f32>, EngineError> {
            Ok(w.to_f32(w.expect(&format!("{prefix}{name}"), &[len])?))
        };
        let table = |name: &str, rows: usize| -> Result<Vec<f32>, EngineError> {
            Ok(w.to_f32(w.expect(&format!("{prefix}{name}"), &[rows, h])?))
        };
        let norm = |name: &str| -> Result<LayerNorm, EngineError> {
            Ok(LayerNorm {
                w: vec(&format!("{name}.weight"), h)?,
                b: vec(&format!("{name}.bias"), h)?,
            })
        };
        let linear = |name: &str, rows: usize, cols: usize| -> Result<Linear, EngineError> {
            let t = w.expect(&format!("{prefix}{name}.weight"), &[rows, cols])?;
            Ok(Linear::new(w, t, Some(vec(&format!("{name}.bias"), rows)?)))
        };
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let p = format!("encoder.layer.{i}");
                Ok(EncoderLayer {
                    q: linear(&format!("{p}.attention.self.query"), h, h)?,
                    k: linear(&format!("{p}.attention.self.key"), h, h)?,
                    v: linear(&format!("{p}.attention.self.value"), h, h)?,
                    o: linear(&format!("{p}.attention.output.dense"), h, h)?,
                    attn_norm: norm(&format!("{p}.attention.output.LayerNorm"))?,
                    up: linear(&format!("{p}.intermediate.dense"), cfg.intermediate, h)?,
                    down: linear(&format!("{p}.output.dense"), h, cfg.intermediate)?,
                    out_norm: norm(&format!("{p}.output.LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("native-encoder-{i}"))
            .build()
            .map_err(|e| EngineError::internal(format!("thread pool: {e}")))?;
        Ok(Self {
            word: table("embeddings.word_embeddings.weight", cfg.vocab)?,
            position: table("embeddings.position_embeddings.weight", cfg.max_position)?,
            token_type: table("embeddings.token_type_embeddings.weight", cfg.type_vocab)?,
            embed_norm: norm("embeddings.LayerNorm")?,
            layers,
            cfg,
            weights,
            pool,
        })
    }

    /// Memory the encoder holds: the mapping and its f32 copies.
    pub fn bytes_used(&self) -> u64 {
        let owned = self
            .layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.up, &l.down])
            .map(Linear::owned_bytes)
            .sum::<u64>();
        let tables = (self.word.len() + self.position.len() + self.token_type.len()) * 4;
        self.weights.mapped_bytes() + owned + tables as u64
    }

    /// The pooled (and, as declared, normalised) embedding of one input.
    pub fn embed(&self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        let mut v = self.embed_batch(&[tokens])?;
        Ok(v.remove(0))
    }

    /// The embeddings of several inputs in one pass (ABI 1.8 `embed_batch`): their tokens are
    /// the rows of one matrix, so each product reads its weights once for all of them and
    /// runs as one large matrix product; attention and pooling stay within each input's rows.
    /// An input that cannot be embedded fails the call, named by its index when there are
    /// several.
    pub fn embed_batch(&self, inputs: &[&[i32]]) -> Result<Vec<Vec<f32>>, EngineError> {
        for (i, tokens) in inputs.iter().enumerate() {
            self.check(tokens)
                .map_err(|e| e.for_input(i, inputs.len()))?;
        }
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.pool.install(|| self.run(inputs)))
    }

    /// Whether one input can be embedded: not empty, not too long, every token in the
    /// vocabulary.
    fn check(&self, tokens: &[i32]) -> Result<(), EngineError> {
        if tokens.is_empty() {
            return Err(unsupported("cannot embed an empty input"));
        }
        if tokens.len() > self.cfg.max_tokens {
            return Err(unsupported(format!(
                "input has {} tokens, the most this model embeds is {}",
                tokens.len(),
                self.cfg.max_tokens
            )));
        }
        match tokens
            .iter()
            .find(|&&t| usize::try_from(t).map_or(true, |id| id >= self.cfg.vocab))
        {
            Some(t) => Err(unsupported(format!(
                "token id {t} is outside the vocabulary"
            ))),
            None => Ok(()),
        }
    }

    /// The forward pass over checked inputs.
    fn run(&self, inputs: &[&[i32]]) -> Vec<Vec<f32>> {
        let cfg = &self.cfg;
        let h = cfg.hidden;
        let w = &*self.weights;
        // Each input's rows in the stacked matrix.
        let mut spans = Vec::with_capacity(inputs.len());
        let mut n = 0;
        for t in inputs {
            spans.push(n..n + t.len());
            n += t.len();
        }
        let mut x = vec![0.0f32; n * h];
        for (tokens, span) in inputs.iter().zip(&spans) {
            for (i, &t) in tokens.iter().enumerate() {
                // Checked by embed_batch: inside the vocabulary.
                let id = t as usize;
                let row = &mut x[(span.start + i) * h..(span.start + i + 1) * h];
                let word = &self.word[id * h..(id + 1) * h];
                // Positions count from each input's start.
                let pos = &self.position[i * h..(i + 1) * h];
                // Every token is of segment 0 (one text per input).
                let seg = &self.token_type[..h];
                for d in 0..h {
                    row[d] = word[d] + pos[d] + seg[d];
                }
            }
        }
        layer_norm(&mut x, &self.embed_norm, h, cfg.eps);
        let mut scratch = Vec::new();
        let (mut q, mut k, mut v, mut att, mut o) = (
            vec![0.0f32; n * h],
            vec![0.0f32; n * h],
            vec![0.0f32; n * h],
            vec![0.0f32; n * h],
            vec![0.0f32; n * h],
        );
        let mut up = vec![0.0f32; n * cfg.intermediate];
        for layer in &self.layers {
            layer.q.forward(w, &x, n, &mut q, &mut scratch);
            layer.k.forward(w, &x, n, &mut k, &mut scratch);
            layer.v.forward(w, &x, n, &mut v, &mut scratch);
            attention(&q, &k, &v, &spans, cfg.n_heads, h / cfg.n_heads, &mut att);
            layer.o.forward(w, &att, n, &mut o, &mut scratch);
            x.par_iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            layer_norm(&mut x, &layer.attn_norm, h, cfg.eps);
            layer.up.forward(w, &x, n, &mut up, &mut scratch);
            // Both threads, a row each at a time.
            up.par_chunks_mut(cfg.intermediate).for_each(ops::gelu_erf);
            layer.down.forward(w, &up, n, &mut o, &mut scratch);
            x.par_iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            layer_norm(&mut x, &layer.out_norm, h, cfg.eps);
        }
        spans
            .iter()
            .map(|s| {
                pool(
                    &x[s.start * h..s.end * h],
                    s.len(),
                    h,
                    cfg.pooling,
                    cfg.normalize,
                )
            })
            .collect()
    }
}

/// LayerNorm of every `h`-wide row of `x`, in place, the rows on the encoder's threads.
pub(crate) fn layer_norm(x: &mut [f32], n: &LayerNorm, h: usize, eps: f32) {
    x.par_chunks_exact_mut(h).for_each(|row| {
        let mean = row.iter().sum::<f32>() / h as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, w), b) in row.iter_mut().zip(&n.w).zip(&n.b) {
            *v = (*v - mean) * inv * w + b;
        }
    });
}

/// Bidirectional multi-head attention (`[rows][heads * hd]` each) into `out`: every row
/// attends to the rows of its own input (`spans`, consecutive and covering every row).
pub(crate) fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    spans: &[std::ops::Range<usize>],
    heads: usize,
    hd: usize,
    out: &mut [f32],
) {
    use rayon::prelude::*;
    let h = heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let span_of: Vec<std::ops::Range<usize>> = spans
        .iter()
        .flat_map(|s| std::iter::repeat_n(s.clone(), s.len()))
        .collect();
    out.par_chunks_mut(h).enumerate().for_each(|(i, row)| {
        let span = span_of[i].clone();
        let mut scores = vec![0.0f32; span.len()];
        for head in 0..heads {
            let qi = &q[i * h + head * hd..i * h + (head + 1) * hd];
            let mut max = f32::NEG_INFINITY;
            for (j, s) in span.clone().zip(scores.iter_mut()) {
                let kj = &k[j * h + head * hd..j * h + (head + 1) * hd];
                *s = dot(qi, kj) * scale;
                max = max.max(*s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = ops::exp(*s - max);
                sum += *s;
            }
            let inv = 1.0 / sum;
            let dst = &mut row[head * hd..(head + 1) * hd];
            dst.fill(0.0);
            for (j, s) in span.clone().zip(&scores) {
                let vj = &v[j * h + head * hd..j * h + (head + 1) * hd];
                let p = s * inv;
                for (d, x) in dst.iter_mut().zip(vj) {
                    *d += p * x;
                }
            }
        }
    });
}

/// One vector from the `n` token vectors of `x`.
fn pool(x: &[f32], n: usize, h: usize, how: Pooling, normalize: bool) -> Vec<f32> {
    let mut out = match how {
        Pooling::Cls => x[..h].to_vec(),
        Pooling::Max => (0..h)
            .map(|d| {
                (0..n)
                    .map(|i| x[i * h + d])
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect(),
        Pooling::Mean | Pooling::MeanSqrtLen => {
            let mut sum = vec![0.0f32; h];
            for row in x.chunks_exact(h) {
                sum.iter_mut().zip(row).for_each(|(s, v)| *s += v);
            }
            let div = if how == Pooling::Mean {
                n as f32
            } else {
                (n as f32).sqrt()
            };
            sum.iter_mut().for_each(|s| *s /= div);
            sum
        }
    };
    if normalize {
        // sentence-transformers' Normalize: x / max(||x||, 1e-12).
        let norm = out.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
        out.iter_mut().for_each(|v| *v /= norm);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_modes_and_normalisation() {
        // Two tokens of width 2.
        let x = [1.0, -2.0, 3.0, 4.0];
        assert_eq!(pool(&x, 2, 2, Pooling::Mean, false), [2.0, 1.0]);
        assert_eq!(pool(&x, 2, 2, Pooling::Cls, false), [1.0, -2.0]);
        assert_eq!(pool(&x, 2, 2, Pooling::Max, false), [3.0, 4.0]);
        let s = 2f32.sqrt();
        assert_eq!(
            pool(&x, 2, 2, Pooling::MeanSqrtLen, false),
            [4.0 / s, 2.0 / s]
        );
        let n = pool(&x, 2, 2, Pooling::Mean, true);
        assert!((n[0] - 2.0 / 5f32.sqrt()).abs() < 1e-6 && (n[1] - 1.0 / 5f32.sqrt()).abs() < 1e-6);
    }

    #[test]
    fn the_pooling_comes_from_modules_json() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(pooling(dir.path()).expect("default"), (Pooling::Mean, true));
        std::fs::write(
            dir.path().join("modules.json"),
            r#"[{"path": "", "type": "sentence_transformers.models.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]"#,
        )
        .expect("write");
        std::fs::create_dir(dir.path().join("1_Pooling")).expect("dir");
        std::fs::write(
            dir.path().join("1_Pooling/config.json"),
            r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}"#,
        )
        .expect("write");
        assert_eq!(pooling(dir.path()).expect("cls"), (Pooling::Cls, false));
        std::fs::write(
            dir.path().join("1_Pooling/config.json"),
            r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true}"#,
        )
        .expect("write");
        let e = pooling(dir.path()).expect_err("two modes");
        assert!(e.message.contains("several pooling modes"), "{}", e.message);
    }
}
