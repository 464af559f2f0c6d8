//! Native engine, Whisper's network (below `whisper/mod.rs`, which owns the sequences): the
//! config, the tensors by their transformers names, the encoder (run once per
//! `seq_set_input`) and the decoder (run by `step` over a batch of sequences).
//!
//! Encoder: two convolutions of 3 taps with GELU (the second of stride 2: 3,000 mel frames
//! become 1,500 positions), plus the stored sinusoidal positions, then pre-norm layers of
//! bidirectional attention (no bias on k) and a GELU MLP, and a final LayerNorm. Decoder:
//! token embeddings plus learned positions, pre-norm layers of causal self-attention,
//! cross-attention over the encoder's output (its keys and values computed once per input and
//! kept with the sequence) and a GELU MLP, a final LayerNorm, and the output layer tied to the
//! token embeddings.

use std::sync::Arc;

use gantry_engine_abi::{EngineError, Status};
use rayon::prelude::*;
use serde_json::Value;

use crate::cpu::matmul::{Linear, dot};
use crate::cpu::ops;
use crate::encoder::{LayerNorm, layer_norm};
use crate::weights::{TensorInfo, Weights};

use super::mel::FRAMES;

fn corrupt(msg: impl Into<String>) -> EngineError {
    EngineError::new(Status::ModelCorrupt, msg.into())
}

/// `WhisperConfig`'s fields this engine reads.
#[derive(Clone, Debug)]
pub struct WhisperConfig {
    pub d_model: usize,
    pub heads: usize,
    pub encoder_layers: usize,
    pub decoder_layers: usize,
    pub ffn: usize,
    pub n_mels: usize,
    pub vocab: usize,
    /// Decoder positions (448 as released).
    pub max_target: usize,
    pub eos: i32,
}

/// Encoder positions: 30 s of audio.
pub const SOURCE_POSITIONS: usize = FRAMES / 2;

impl WhisperConfig {
    pub fn parse(v: &Value) -> Result<Self, EngineError> {
        let get = |k: &str| -> Result<usize, EngineError> {
            v.get(k)
                .and_then(Value::as_u64)
                .filter(|n| *n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| corrupt(format!("config.json `{k}` must be a positive integer")))
        };
        let unsupported = |k: &str, what: String| {
            EngineError::unsupported(format!(
                "config.json `{k}` {what}: the native engine's Whisper does not run it"
            ))
        };
        if let Some(act) = v.get("activation_function").and_then(Value::as_str)
            && act != "gelu"
        {
            return Err(unsupported("activation_function", format!("`{act}`")));
        }
        if v.get("scale_embedding").and_then(Value::as_bool) == Some(true) {
            return Err(unsupported("scale_embedding", "true".into()));
        }
        let c = Self {
            d_model: get("d_model")?,
            heads: get("encoder_attention_heads")?,
            encoder_layers: get("encoder_layers")?,
            decoder_layers: get("decoder_layers")?,
            ffn: get("encoder_ffn_dim")?,
            n_mels: get("num_mel_bins")?,
            vocab: get("vocab_size")?,
            max_target: get("max_target_positions")?,
            eos: get("eos_token_id")? as i32,
        };
        for (k, want) in [
            ("decoder_attention_heads", c.heads),
            ("decoder_ffn_dim", c.ffn),
            ("max_source_positions", SOURCE_POSITIONS),
        ] {
            let got = get(k)?;
            if got != want {
                return Err(unsupported(k, format!("{got} (this engine runs {want})")));
            }
        }
        if !c.d_model.is_multiple_of(c.heads) {
            return Err(corrupt(format!(
                "config.json `d_model` ({}) is not a multiple of the heads ({})",
                c.d_model, c.heads
            )));
        }
        Ok(c)
    }
}

/// One attention's projections (`k` without a bias, as Whisper has it).
struct Attn {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
}

/// A layer's MLP half: LayerNorm, `fc1`, GELU, `fc2`, added to the residual stream.
struct Mlp {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    /// `x` (`n` rows of `d`) += the MLP of its normalised rows; `h`, `up` and `o` are scratch.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &self,
        w: &Weights,
        x: &mut [f32],
        n: usize,
        d: usize,
        (h, up, o): (&mut [f32], &mut [f32], &mut [f32]),
        scratch: &mut Vec<u16>,
    ) {
        h.copy_from_slice(x);
        layer_norm(h, &self.norm, d, 1e-5);
        self.fc1.forward(w, h, n, up, scratch);
        up.par_chunks_mut(up.len() / n.max(1))
            .for_each(ops::gelu_erf);
        self.fc2.forward(w, up, n, o, scratch);
        x.par_iter_mut().zip(&*o).for_each(|(x, o)| *x += o);
    }
}

struct EncLayer {
    attn_norm: LayerNorm,
    attn: Attn,
    mlp: Mlp,
}

struct DecLayer {
    self_norm: LayerNorm,
    self_attn: Attn,
    cross_norm: LayerNorm,
    cross: Attn,
    mlp: Mlp,
}

/// What a sequence's input left for the decoder: each layer's cross-attention keys and
/// values over the encoder's output, `[SOURCE_POSITIONS][d_model]` each.
pub struct Encoded {
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
}

/// A sequence's decoder state: its self-attention keys and values so far, per layer.
#[derive(Clone)]
pub struct SelfKv {
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub len: usize,
}

impl SelfKv {
    /// No keys or values yet, for `layers` layers.
    pub fn empty(layers: usize) -> SelfKv {
        SelfKv {
            k: vec![Vec::new(); layers],
            v: vec![Vec::new(); layers],
            len: 0,
        }
    }

    pub fn truncate(&mut self, n: usize, d: usize) {
        self.len = self.len.min(n);
        for l in self.k.iter_mut().chain(self.v.iter_mut()) {
            l.truncate(self.len * d);
        }
    }
}

pub struct Net {
    pub cfg: WhisperConfig,
    weights: Arc<Weights>,
    conv1: Linear,
    conv2: Linear,
    source_pos: Vec<f32>,
    enc: Vec<EncLayer>,
    enc_norm: LayerNorm,
    embed: Vec<f32>,
    target_pos: Vec<f32>,
    dec: Vec<DecLayer>,
    dec_norm: LayerNorm,
    out: Linear,
}

/// One row of a decoder batch: which sequence, at which position, which token.
pub struct Row {
    pub seq: usize,
    pub pos: usize,
    pub token: i32,
}

impl Net {
    pub fn load(cfg: WhisperConfig, weights: Arc<Weights>) -> Result<Self, EngineError> {
        let w = &*weights;
        let (d, ffn) = (cfg.d_model, cfg.ffn);
        let vec = |n: &str, len: usize| Ok::<_, EngineError>(w.to_f32(w.expect(n, &[len])?));
        let norm = |p: &str| -> Result<LayerNorm, EngineError> {
            Ok(LayerNorm {
                w: vec(&format!("{p}.weight"), d)?,
                b: vec(&format!("{p}.bias"), d)?,
            })
        };
        // `long`: a layer that only sees the encoder's 1,500 or 3,000 rows (`Linear::unpacked`:
        // the `gemm` crate's kernels, faster there than the panels the decoder's few rows use).
        let linear = |p: &str, (rows, cols): (usize, usize), bias: bool, long: bool| {
            let t = w.expect(&format!("{p}.weight"), &[rows, cols])?;
            let b = match bias {
                true => Some(vec(&format!("{p}.bias"), rows)?),
                false => None,
            };
            Ok::<_, EngineError>(match long {
                true => Linear::unpacked(w, t, b),
                false => Linear::new(w, t, b),
            })
        };
        // `qo`, `kv`: whether those projections see only the encoder's rows.
        let attn = |p: &str, qo: bool, kv: bool| -> Result<Attn, EngineError> {
            Ok(Attn {
                q: linear(&format!("{p}.q_proj"), (d, d), true, qo)?,
                k: linear(&format!("{p}.k_proj"), (d, d), false, kv)?,
                v: linear(&format!("{p}.v_proj"), (d, d), true, kv)?,
                o: linear(&format!("{p}.out_proj"), (d, d), true, qo)?,
            })
        };
        // A convolution `[out][in][taps]` read as the matrix `[out][in × taps]`.
        let conv = |p: &str, cin: usize| -> Result<Linear, EngineError> {
            let t = w.expect(&format!("{p}.weight"), &[d, cin, 3])?;
            let flat = TensorInfo {
                shape: vec![d, cin * 3],
                ..t.clone()
            };
            Ok(Linear::unpacked(
                w,
                &flat,
                Some(vec(&format!("{p}.bias"), d)?),
            ))
        };
        let mlp = |p: &str, long: bool| -> Result<Mlp, EngineError> {
            Ok(Mlp {
                norm: norm(&format!("{p}.final_layer_norm"))?,
                fc1: linear(&format!("{p}.fc1"), (ffn, d), true, long)?,
                fc2: linear(&format!("{p}.fc2"), (d, ffn), true, long)?,
            })
        };
        let enc = (0..cfg.encoder_layers)
            .map(|i| {
                let p = format!("model.encoder.layers.{i}");
                Ok(EncLayer {
                    attn_norm: norm(&format!("{p}.self_attn_layer_norm"))?,
                    attn: attn(&format!("{p}.self_attn"), true, true)?,
                    mlp: mlp(&p, true)?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let dec = (0..cfg.decoder_layers)
            .map(|i| {
                let p = format!("model.decoder.layers.{i}");
                Ok(DecLayer {
                    self_norm: norm(&format!("{p}.self_attn_layer_norm"))?,
                    self_attn: attn(&format!("{p}.self_attn"), false, false)?,
                    cross_norm: norm(&format!("{p}.encoder_attn_layer_norm"))?,
                    cross: attn(&format!("{p}.encoder_attn"), false, true)?,
                    mlp: mlp(&p, false)?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let table = |n: &str, rows: usize| Ok::<_, EngineError>(w.to_f32(w.expect(n, &[rows, d])?));
        let embed_t = w.expect("model.decoder.embed_tokens.weight", &[cfg.vocab, d])?;
        // The output layer is the token embeddings (tied), unless the file has its own.
        let out = match w.get("proj_out.weight") {
            Some(_) => linear("proj_out", (cfg.vocab, d), false, false)?,
            None => Linear::new(w, embed_t, None),
        };
        Ok(Self {
            conv1: conv("model.encoder.conv1", cfg.n_mels)?,
            conv2: conv("model.encoder.conv2", d)?,
            source_pos: table("model.encoder.embed_positions.weight", SOURCE_POSITIONS)?,
            enc,
            enc_norm: norm("model.encoder.layer_norm")?,
            embed: w.to_f32(embed_t),
            target_pos: table("model.decoder.embed_positions.weight", cfg.max_target)?,
            dec,
            dec_norm: norm("model.decoder.layer_norm")?,
            out,
            cfg,
            weights,
        })
    }

    /// Bytes the network holds beyond the mapping.
    pub fn bytes_used(&self) -> u64 {
        let tables = (self.embed.len() + self.source_pos.len() + self.target_pos.len()) as u64 * 4;
        self.weights.mapped_bytes() + tables
    }

    /// The encoder over `[n_mels][FRAMES]` features, and each decoder layer's cross keys and
    /// values over its output.
    pub fn encode(&self, features: &[f32]) -> Encoded {
        let (d, w) = (self.cfg.d_model, &*self.weights);
        let mut scratch = Vec::new();
        // Convolutions as products: each output position's 3-tap window of every channel.
        let windows =
            |x: &(dyn Fn(usize, isize) -> f32 + Sync), cin: usize, n: usize, stride: usize| {
                let mut cols = vec![0.0f32; n * cin * 3];
                cols.par_chunks_mut(cin * 3)
                    .enumerate()
                    .for_each(|(t, row)| {
                        for c in 0..cin {
                            for k in 0..3 {
                                row[c * 3 + k] = x(c, (t * stride + k) as isize - 1);
                            }
                        }
                    });
                cols
            };
        let mels = |c: usize, t: isize| {
            if (0..FRAMES as isize).contains(&t) {
                features[c * FRAMES + t as usize]
            } else {
                0.0
            }
        };
        let cols = windows(&mels, self.cfg.n_mels, FRAMES, 1);
        let mut h1 = vec![0.0f32; FRAMES * d];
        self.conv1.forward(w, &cols, FRAMES, &mut h1, &mut scratch);
        h1.par_chunks_mut(d).for_each(ops::gelu_erf);
        let first = |c: usize, t: isize| {
            if (0..FRAMES as isize).contains(&t) {
                h1[t as usize * d + c]
            } else {
                0.0
            }
        };
        let n = SOURCE_POSITIONS;
        let cols = windows(&first, d, n, 2);
        let mut x = vec![0.0f32; n * d];
        self.conv2.forward(w, &cols, n, &mut x, &mut scratch);
        x.par_chunks_mut(d).for_each(ops::gelu_erf);
        x.par_iter_mut()
            .zip(&self.source_pos)
            .for_each(|(x, p)| *x += p);
        // One input: every position attends to all of them (`cpu::attention::full`).
        let heads = self.cfg.heads;
        let [mut h, mut q, mut k, mut v, mut att, mut o] =
            std::array::from_fn(|_| vec![0.0f32; n * d]);
        let mut up = vec![0.0f32; n * self.cfg.ffn];
        for l in &self.enc {
            h.copy_from_slice(&x);
            layer_norm(&mut h, &l.attn_norm, d, 1e-5);
            l.attn.q.forward(w, &h, n, &mut q, &mut scratch);
            l.attn.k.forward(w, &h, n, &mut k, &mut scratch);
            l.attn.v.forward(w, &h, n, &mut v, &mut scratch);
            let hd = d / heads;
            crate::cpu::attention::full(
                &q,
                &k,
                &v,
                n,
                heads,
                hd,
                1.0 / (hd as f32).sqrt(),
                &mut att,
            );
            l.attn.o.forward(w, &att, n, &mut o, &mut scratch);
            x.par_iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            l.mlp
                .add(w, &mut x, n, d, (&mut h, &mut up, &mut o), &mut scratch);
        }
        layer_norm(&mut x, &self.enc_norm, d, 1e-5);
        let kv = self
            .dec
            .iter()
            .map(|l| {
                let (mut k, mut v) = (vec![0.0f32; n * d], vec![0.0f32; n * d]);
                l.cross.k.forward(w, &x, n, &mut k, &mut scratch);
                l.cross.v.forward(w, &x, n, &mut v, &mut scratch);
                (k, v)
            })
            .collect();
        Encoded { kv }
    }

    /// The decoder over a batch of rows (each sequence's rows consecutive and in position
    /// order): appends every row's keys and values to its sequence's `caches`, and returns the
    /// logits (`[rows in `want`][vocab]`) of the rows `want` names. For the rows of the
    /// sequences `align.1` marks, also the cross-attention scores (scaled, before the softmax)
    /// of the heads `align.0` names (`(layer, head)`): `[row][head][SOURCE_POSITIONS]`, empty
    /// for the other rows.
    pub fn decode(
        &self,
        rows: &[Row],
        caches: &mut [&mut SelfKv],
        encoded: &[&Encoded],
        want: &[usize],
        align: (&[(usize, usize)], &[bool]),
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let (heads_to_keep, record) = align;
        let per_row = heads_to_keep.len() * SOURCE_POSITIONS;
        let mut kept: Vec<Vec<f32>> = rows
            .iter()
            .map(|r| match record.get(r.seq) {
                Some(true) => vec![0.0; per_row],
                _ => Vec::new(),
            })
            .collect();
        let (d, w, heads) = (self.cfg.d_model, &*self.weights, self.cfg.heads);
        let hd = d / heads;
        let n = rows.len();
        let mut x = vec![0.0f32; n * d];
        for (r, row) in rows.iter().enumerate() {
            let (t, p) = (row.token as usize, row.pos);
            for j in 0..d {
                x[r * d + j] = self.embed[t * d + j] + self.target_pos[p * d + j];
            }
        }
        let mut scratch = Vec::new();
        let [mut h, mut q, mut k, mut v, mut att, mut o] =
            std::array::from_fn(|_| vec![0.0f32; n * d]);
        let mut up = vec![0.0f32; n * self.cfg.ffn];
        for (li, l) in self.dec.iter().enumerate() {
            h.copy_from_slice(&x);
            layer_norm(&mut h, &l.self_norm, d, 1e-5);
            l.self_attn.q.forward(w, &h, n, &mut q, &mut scratch);
            l.self_attn.k.forward(w, &h, n, &mut k, &mut scratch);
            l.self_attn.v.forward(w, &h, n, &mut v, &mut scratch);
            for (r, row) in rows.iter().enumerate() {
                let c = &mut caches[row.seq];
                let at = row.pos * d;
                // Rows come in position order, so each one appends.
                c.k[li].truncate(at);
                c.v[li].truncate(at);
                c.k[li].extend_from_slice(&k[r * d..(r + 1) * d]);
                c.v[li].extend_from_slice(&v[r * d..(r + 1) * d]);
            }
            {
                let caches = &*caches;
                att.par_chunks_mut(d).enumerate().for_each(|(r, out)| {
                    let row = &rows[r];
                    let c = &caches[row.seq];
                    let upto = row.pos + 1;
                    attend(
                        &q[r * d..(r + 1) * d],
                        &c.k[li],
                        &c.v[li],
                        upto,
                        heads,
                        hd,
                        out,
                    );
                });
            }
            l.self_attn.o.forward(w, &att, n, &mut o, &mut scratch);
            x.par_iter_mut().zip(&o).for_each(|(x, o)| *x += o);

            h.copy_from_slice(&x);
            layer_norm(&mut h, &l.cross_norm, d, 1e-5);
            l.cross.q.forward(w, &h, n, &mut q, &mut scratch);
            att.par_chunks_mut(d).enumerate().for_each(|(r, out)| {
                let (ck, cv) = &encoded[rows[r].seq].kv[li];
                attend(
                    &q[r * d..(r + 1) * d],
                    ck,
                    cv,
                    SOURCE_POSITIONS,
                    heads,
                    hd,
                    out,
                );
            });
            if heads_to_keep.iter().any(|&(layer, _)| layer == li) {
                kept.par_iter_mut().enumerate().for_each(|(r, dst)| {
                    if dst.is_empty() {
                        return;
                    }
                    let (ck, _) = &encoded[rows[r].seq].kv[li];
                    for (a, &(_, head)) in heads_to_keep
                        .iter()
                        .enumerate()
                        .filter(|(_, (layer, _))| *layer == li)
                    {
                        scores(
                            &q[r * d..(r + 1) * d],
                            ck,
                            (head, hd),
                            &mut dst[a * SOURCE_POSITIONS..(a + 1) * SOURCE_POSITIONS],
                        );
                    }
                });
            }
            l.cross.o.forward(w, &att, n, &mut o, &mut scratch);
            x.par_iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            l.mlp
                .add(w, &mut x, n, d, (&mut h, &mut up, &mut o), &mut scratch);
        }
        let mut picked = Vec::with_capacity(want.len() * d);
        for &r in want {
            picked.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        layer_norm(&mut picked, &self.dec_norm, d, 1e-5);
        let mut logits = vec![0.0f32; want.len() * self.cfg.vocab];
        self.out
            .forward(w, &picked, want.len(), &mut logits, &mut scratch);
        (logits, kept)
    }
}

/// One head's attention scores of the query row `q` over every row of `keys` (scaled as
/// [`attend`] scales them, before the softmax), into `out`.
fn scores(q: &[f32], keys: &[f32], (head, hd): (usize, usize), out: &mut [f32]) {
    let d = q.len();
    let scale = 1.0 / (hd as f32).sqrt();
    let qh = &q[head * hd..(head + 1) * hd];
    for (j, s) in out.iter_mut().enumerate() {
        *s = dot(qh, &keys[j * d + head * hd..j * d + (head + 1) * hd]) * scale;
    }
}

/// One query row (`heads × hd`) over the first `n` rows of `keys` and `values`, into `out`.
fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    heads: usize,
    hd: usize,
    out: &mut [f32],
) {
    let d = heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = vec![0.0f32; n];
    for head in 0..heads {
        let qh = &q[head * hd..(head + 1) * hd];
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            *s = dot(qh, &keys[j * d + head * hd..j * d + (head + 1) * hd]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = ops::exp(*s - max);
            sum += *s;
        }
        let dst = &mut out[head * hd..(head + 1) * hd];
        dst.fill(0.0);
        for (j, s) in scores.iter().enumerate() {
            let p = s / sum;
            for (o, v) in dst
                .iter_mut()
                .zip(&values[j * d + head * hd..j * d + (head + 1) * hd])
            {
                *o += p * v;
            }
        }
    }
}
