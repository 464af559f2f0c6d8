//! Native engine, CUDA backend, at load: the checkpoint's tensors into device memory.
//!
//! The decoder stack is read by [`load_stack`] (one place names an architecture's tensors)
//! into host views of the memory-mapped shards, then each layer is uploaded with its products
//! fused: q, k and v into one `[q | k | v]` matrix, gate and up into one `[gate | up]`, so a
//! layer runs three products instead of seven. Weights stay in their checkpoint dtype; a tensor
//! whose dtype differs from the embedding table's (the model's activation type) is converted on
//! the host first, so every product of a model reads one type.

use std::borrow::Cow;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use gantry_engine_abi::EngineError;

use super::cuda_err;
use crate::backend::{Mlp, TensorLoader, load_stack};
use crate::config::ModelConfig;
use crate::weights::{DType, TensorInfo, Weights};

/// A weight matrix `[rows, cols]` in device memory, with its bias (f32) when it has one.
pub(super) struct DevLinear {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    pub w: CudaSlice<u8>,
    pub bias: Option<CudaSlice<f32>>,
}

/// One decoder layer on the device.
pub(super) struct DevLayer {
    pub in_norm: CudaSlice<f32>,
    /// `[q heads | k heads | v heads] x head_dim` rows.
    pub qkv: DevLinear,
    pub o: DevLinear,
    pub q_norm: Option<CudaSlice<f32>>,
    pub k_norm: Option<CudaSlice<f32>>,
    pub post_attn_norm: Option<CudaSlice<f32>>,
    pub ffn_norm: CudaSlice<f32>,
    pub post_ffn_norm: Option<CudaSlice<f32>>,
    /// `[gate | up]` rows, `2 x intermediate`.
    pub gate_up: DevLinear,
    pub down: DevLinear,
}

/// The model's weights on the device.
pub(super) struct DevModel {
    pub embed: DevLinear,
    /// `None`: the output projection is the embedding table (tied).
    pub lm_head: Option<DevLinear>,
    pub layers: Vec<DevLayer>,
    pub final_norm: CudaSlice<f32>,
    /// Inverse frequencies and cos/sin factor of each rotary setting.
    pub ropes: Vec<(CudaSlice<f32>, f32)>,
    /// Device bytes of all of the above.
    pub bytes: u64,
}

/// A matrix as the host holds it before upload: the mapped bytes, or a converted copy.
struct HostLinear<'a> {
    rows: usize,
    cols: usize,
    dtype: DType,
    bytes: Cow<'a, [u8]>,
    bias: Option<Vec<f32>>,
}

/// Reads tensors as host views, converting to `act` where the dtype differs.
struct HostLoader<'a> {
    w: &'a Weights,
    act: DType,
}

impl<'a> HostLoader<'a> {
    fn matrix(&self, name: &str, t: &'a TensorInfo) -> HostLinear<'a> {
        let bytes = if t.dtype == self.act {
            Cow::Borrowed(self.w.bytes(t))
        } else {
            Cow::Owned(encode(&self.w.to_f32(t), self.act))
        };
        let _ = name;
        HostLinear {
            rows: t.shape[0],
            cols: t.shape[1],
            dtype: self.act,
            bytes,
            bias: None,
        }
    }
}

impl<'a> TensorLoader for HostLoader<'a> {
    type Vec = Vec<f32>;
    type Linear = HostLinear<'a>;

    fn vec(&mut self, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        let t = self.w.expect(name, &[len])?;
        Ok(self.w.to_f32(t))
    }

    fn linear(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<HostLinear<'a>, EngineError> {
        let wname = format!("{name}.weight");
        let t = self.w.expect(&wname, &[rows, cols])?;
        let mut l = self.matrix(&wname, t);
        if bias {
            l.bias = Some(self.vec(&format!("{name}.bias"), rows)?);
        }
        Ok(l)
    }
}

/// f32 values as little-endian bytes of `dtype`.
fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        DType::Bf16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

/// Uploads, counting the bytes it allocates; errors name the tensor.
struct Up<'s> {
    stream: &'s Arc<CudaStream>,
    bytes: u64,
}

impl Up<'_> {
    fn f32s(&mut self, v: &[f32], what: &str) -> Result<CudaSlice<f32>, EngineError> {
        self.bytes += (v.len() * 4) as u64;
        self.stream.clone_htod(v).map_err(cuda_err(what))
    }

    fn opt(
        &mut self,
        v: &Option<Vec<f32>>,
        what: &str,
    ) -> Result<Option<CudaSlice<f32>>, EngineError> {
        v.as_deref().map(|v| self.f32s(v, what)).transpose()
    }

    /// The parts stacked by rows into one device matrix (they share cols and dtype); the
    /// bias stacked the same way when any part has one (zeros for the parts without).
    fn fused(&mut self, parts: &[&HostLinear<'_>], what: &str) -> Result<DevLinear, EngineError> {
        let (cols, dtype) = (parts[0].cols, parts[0].dtype);
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let total: usize = parts.iter().map(|p| p.bytes.len()).sum();
        let e = cuda_err(what);
        let mut w = self.stream.alloc_zeros::<u8>(total).map_err(&e)?;
        let mut off = 0;
        for p in parts {
            let mut dst = w.slice_mut(off..off + p.bytes.len());
            self.stream
                .memcpy_htod(p.bytes.as_ref(), &mut dst)
                .map_err(&e)?;
            off += p.bytes.len();
        }
        self.bytes += total as u64;
        let bias = if parts.iter().any(|p| p.bias.is_some()) {
            let mut b = Vec::with_capacity(rows);
            for p in parts {
                match &p.bias {
                    Some(v) => b.extend_from_slice(v),
                    None => b.extend(std::iter::repeat_n(0.0, p.rows)),
                }
            }
            Some(self.f32s(&b, what)?)
        } else {
            None
        };
        Ok(DevLinear {
            rows,
            cols,
            dtype,
            w,
            bias,
        })
    }
}

/// The model's weights into device memory through `stream`; `act` is the embedding table's
/// dtype, which every product is made to read.
pub(super) fn upload(
    cfg: &ModelConfig,
    weights: &Weights,
    stream: &Arc<CudaStream>,
) -> Result<DevModel, EngineError> {
    let et = weights.expect("model.embed_tokens.weight", &[cfg.vocab, cfg.hidden])?;
    let mut loader = HostLoader {
        w: weights,
        act: et.dtype,
    };
    let embed_host = loader.matrix("model.embed_tokens.weight", et);
    let stack = load_stack(cfg, weights, &mut loader)?;
    let mut up = Up { stream, bytes: 0 };
    let embed = up.fused(&[&embed_host], "model.embed_tokens.weight")?;
    let lm_head = match &stack.lm_head {
        Some(l) => Some(up.fused(&[l], "lm_head.weight")?),
        None => None,
    };
    let mut layers = Vec::with_capacity(stack.layers.len());
    for (i, l) in stack.layers.iter().enumerate() {
        let what = format!("model.layers.{i}");
        let Mlp::Dense(mlp) = &l.mlp else {
            return Err(EngineError::internal(format!(
                "{what}: mixture-of-experts layers are refused before the upload"
            )));
        };
        let Some(a) = l.mixer.attention() else {
            return Err(EngineError::internal(format!(
                "{what}: state-space layers are refused before the upload"
            )));
        };
        let Some(gate) = &mlp.gate else {
            return Err(EngineError::internal(format!(
                "{what}: MLPs without a gate are refused before the upload"
            )));
        };
        layers.push(DevLayer {
            in_norm: up.f32s(&l.in_norm, &what)?,
            qkv: up.fused(&[&a.q, &a.k, &a.v], &what)?,
            o: up.fused(&[&a.o], &what)?,
            q_norm: up.opt(&a.q_norm, &what)?,
            k_norm: up.opt(&a.k_norm, &what)?,
            post_attn_norm: up.opt(&l.post_attn_norm, &what)?,
            ffn_norm: up.f32s(&l.ffn_norm, &what)?,
            post_ffn_norm: up.opt(&l.post_ffn_norm, &what)?,
            gate_up: up.fused(&[gate, &mlp.up], &what)?,
            down: up.fused(&[&mlp.down], &what)?,
        });
    }
    let final_norm = up.f32s(&stack.final_norm, "model.norm.weight")?;
    let mut ropes = Vec::with_capacity(cfg.ropes.len());
    for r in &cfg.ropes {
        let (inv, factor) = r.inv_freq(cfg.head_dim);
        ropes.push((up.f32s(&inv, "rotary frequencies")?, factor));
    }
    Ok(DevModel {
        embed,
        lm_head,
        layers,
        final_norm,
        ropes,
        bytes: up.bytes,
    })
}
