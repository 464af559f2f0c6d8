//! Native engine, CUDA backend, in the step: the launches of one forward pass, and of the
//! sampler after it.
//!
//! [`CudaBackend::encode`] issues every kernel and product of a step on the backend's stream
//! and nothing else: no allocation, copy or synchronisation, and every per-step value is read
//! from the input area. That is what lets a decode step be captured once per batch size and
//! replayed (`graph.rs`). Per layer: the QKV product, q/k norms + RoPE + K/V append, attention
//! (`attend.rs`), the output product, residual + norms, the gate/up product, the gated
//! activation, the down product, residual + norms (the next layer's input norm): four products
//! and five kernels.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gantry_engine_abi::EngineError;

use super::attend::LayerAttention;
use super::{CudaBackend, cuda_err, int};
use crate::config::Activation;

/// Threads per block of the grid-stride kernels.
const THREADS: u32 = 256;

/// Threads per block of the norms (one block per token): about two values of the row each,
/// so a decode step of one token, one block on the whole GPU, is not a long serial loop.
fn norm_threads(dim: usize) -> u32 {
    ((dim / 2).div_ceil(32) * 32).clamp(256, 1024) as u32
}

/// Threads per block of the sampler (one block per row over the whole vocabulary).
const SAMPLE_THREADS: u32 = 1024;

/// Grid-stride launch over `n` elements.
fn flat(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 4096) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// What one encoded step covers.
pub(super) struct Shape {
    /// Token slots (a graph's batch size when padded).
    pub tokens: usize,
    /// Logits rows.
    pub rows: usize,
    /// Gather the rows first (a prompt step); a decode step's rows are its tokens.
    pub gather: bool,
    /// Run the sampler after the output product.
    pub sample: bool,
}

impl CudaBackend {
    /// Issue the step's kernels and products over the buffers (see the module header).
    pub(super) fn encode(&self, s: &Shape) -> Result<(), EngineError> {
        let c = &self.cfg;
        let b = &self.bufs;
        let n = s.tokens;
        let input = b.input;
        let (act, kvdt) = (self.act_dt, self.kv_dt);
        let (h, hd, nh, nkv, ff) = (
            c.hidden,
            c.head_dim,
            c.n_heads,
            c.n_kv_heads,
            c.intermediate,
        );
        let (h32, hd32, nh32, nkv32, ff32) = (int(h)?, int(hd)?, int(nh)?, int(nkv)?, int(ff)?);
        let eps = c.rms_eps;
        let plus_one = i32::from(c.norm_plus_one);
        let m = &self.model;
        self.profile.mark("start", &self.stream);
        let opt =
            |v: &Option<cudarc::driver::CudaSlice<f32>>| v.as_ref().map_or(0u64, |v| self.addr(v));

        {
            let (table, tdt) = (self.addr(&m.embed.w), self.act_dt);
            let w0 = self.addr(&m.layers[0].in_norm);
            let mut lb = self.stream.launch_builder(&self.k.embed_norm);
            lb.arg(&table)
                .arg(&tdt)
                .arg(&input)
                .arg(&b.x)
                .arg(&w0)
                .arg(&b.h)
                .arg(&act)
                .arg(&h32)
                .arg(&c.embed_scale)
                .arg(&eps)
                .arg(&plus_one);
            // SAFETY: the table holds vocab x hidden values (token ids were checked on the
            // host), x and h hold the buffers' token capacity >= n rows of hidden.
            unsafe { lb.launch(per_row(n, norm_threads(h))) }.map_err(cuda_err("embed_norm"))?;
            self.profile.mark("embed_norm", &self.stream);
        }

        let rope_threads = (hd / 2).div_ceil(32).max(1) as u32 * 32;
        for (li, layer) in m.layers.iter().enumerate() {
            let kind = &c.layers[li];
            let kv = &self.kv[li];
            let (kc, vc) = (self.addr(&kv.k), self.addr(&kv.v));
            self.gemm.run(&layer.qkv, b.h, n, b.qkv)?;
            self.profile.mark("gemm_qkv", &self.stream);
            {
                let (inv, factor) = &m.ropes[kind.rope];
                let inv = self.addr(inv);
                let (bias, qn, kn) = (opt(&layer.qkv.bias), opt(&layer.q_norm), opt(&layer.k_norm));
                let mut lb = self.stream.launch_builder(&self.k.qkv_rope_store);
                lb.arg(&b.qkv)
                    .arg(&bias)
                    .arg(&qn)
                    .arg(&kn)
                    .arg(&inv)
                    .arg(factor)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&kvdt)
                    .arg(&nh32)
                    .arg(&nkv32)
                    .arg(&hd32)
                    .arg(&eps)
                    .arg(&plus_one)
                    .arg(&input);
                let cfg = LaunchConfig {
                    grid_dim: (n as u32, (nh + nkv) as u32, 1),
                    block_dim: (rope_threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: qkv holds n rows of (nh + 2 nkv) x hd; every cell of the input area
                // is inside the cache (the pool's blocks, or the dummy block past them).
                unsafe { lb.launch(cfg) }.map_err(cuda_err("qkv_rope_store"))?;
                self.profile.mark("qkv_rope_store", &self.stream);
            }
            self.attention(&LayerAttention {
                k_cache: kc,
                v_cache: vc,
                window: int(kind.window.unwrap_or(0))?,
                tokens: n,
            })?;
            self.gemm.run(&layer.o, b.att, n, b.o)?;
            self.profile.mark("gemm_o", &self.stream);
            self.residual_norm(
                b.o,
                opt(&layer.o.bias),
                opt(&layer.post_attn_norm),
                self.addr(&layer.ffn_norm),
                n,
            )?;
            self.gemm.run(&layer.gate_up, b.h, n, b.gu)?;
            self.profile.mark("gemm_gate_up", &self.stream);
            {
                let bias = opt(&layer.gate_up.bias);
                let kind = match c.activation {
                    Activation::Silu => 0i32,
                    Activation::GeluTanh => 1,
                    Activation::Relu2 | Activation::ClampedSwiglu { .. } => {
                        unreachable!("refused at load (cuda/mod.rs)")
                    }
                };
                let mut lb = self.stream.launch_builder(&self.k.gated_act);
                lb.arg(&b.gu)
                    .arg(&bias)
                    .arg(&b.g)
                    .arg(&act)
                    .arg(&ff32)
                    .arg(&kind)
                    .arg(&input);
                // SAFETY: gu holds n rows of 2 x ff, g n rows of ff.
                unsafe { lb.launch(flat(n * ff)) }.map_err(cuda_err("gated_act"))?;
                self.profile.mark("gated_act", &self.stream);
            }
            self.gemm.run(&layer.down, b.g, n, b.o)?;
            self.profile.mark("gemm_down", &self.stream);
            let next = match m.layers.get(li + 1) {
                Some(l) => self.addr(&l.in_norm),
                None => self.addr(&m.final_norm),
            };
            self.residual_norm(
                b.o,
                opt(&layer.down.bias),
                opt(&layer.post_ffn_norm),
                next,
                n,
            )?;
        }

        let rows = s.rows;
        if rows == 0 {
            return Ok(());
        }
        let src = if s.gather {
            let mut lb = self.stream.launch_builder(&self.k.gather_rows);
            lb.arg(&b.h).arg(&act).arg(&input).arg(&b.hrows).arg(&h32);
            // SAFETY: every row index is a token of this step; hrows holds rows x hidden.
            unsafe { lb.launch(flat(rows * h)) }.map_err(cuda_err("gather_rows"))?;
            b.hrows
        } else {
            b.h
        };
        let head = m.lm_head.as_ref().unwrap_or(&m.embed);
        self.gemm.run(head, src, rows, b.logits)?;
        self.profile.mark("gemm_lm_head", &self.stream);
        if let Some(cap) = c.final_softcap {
            let n = (rows * c.vocab) as i64;
            let mut lb = self.stream.launch_builder(&self.k.softcap);
            lb.arg(&b.logits).arg(&cap).arg(&n);
            // SAFETY: logits holds rows x vocab values.
            unsafe { lb.launch(flat(rows * c.vocab)) }.map_err(cuda_err("softcap"))?;
            self.profile.mark("softcap", &self.stream);
        }
        if s.sample {
            self.launch_sample(rows)?;
        }
        Ok(())
    }

    /// The sampler over `rows` rows of logits, by the parameters in the input area.
    pub(super) fn launch_sample(&self, rows: usize) -> Result<(), EngineError> {
        let b = &self.bufs;
        let vocab = int(self.cfg.vocab)?;
        let mut lb = self.stream.launch_builder(&self.k.sample);
        lb.arg(&b.logits)
            .arg(&vocab)
            .arg(&b.input)
            .arg(&b.adj_orig)
            .arg(&b.out);
        // SAFETY: logits holds rows x vocab, out rows x OUT_WORDS, adj_orig the step's
        // adjustments; the parameters, adjustments and masks are in the input area.
        unsafe { lb.launch(per_row(rows, SAMPLE_THREADS)) }.map_err(cuda_err("sample"))?;
        self.profile.mark("sample", &self.stream);
        Ok(())
    }

    /// The end of a sub-layer: `x += post_norm(dlt + bias)`, then `h = norm(x) * next`.
    fn residual_norm(
        &self,
        dlt: u64,
        bias: u64,
        post: u64,
        next: u64,
        n: usize,
    ) -> Result<(), EngineError> {
        let c = &self.cfg;
        let b = &self.bufs;
        let (h32, eps, plus_one) = (int(c.hidden)?, c.rms_eps, i32::from(c.norm_plus_one));
        let mut lb = self.stream.launch_builder(&self.k.residual_norm);
        lb.arg(&b.x)
            .arg(&dlt)
            .arg(&bias)
            .arg(&post)
            .arg(&next)
            .arg(&b.h)
            .arg(&self.act_dt)
            .arg(&h32)
            .arg(&eps)
            .arg(&plus_one)
            .arg(&b.input);
        // SAFETY: x, dlt and h hold n rows of hidden; the norm weights hidden values.
        unsafe { lb.launch(per_row(n, norm_threads(c.hidden))) }
            .map_err(cuda_err("residual_norm"))?;
        self.profile.mark("residual_norm", &self.stream);
        Ok(())
    }
}
