//! Native engine, CPU backend: the forward pass of a decoder-only transformer over a batch of
//! tokens from many sequences, with K/V in the paged cache.
//!
//! One pass per step: every token of every entry goes through each layer together (the linear
//! layers are one matrix product for the whole batch); attention reads each token's own
//! sequence through its block table. The final norm and the output projection run only for the
//! tokens whose logits are sampled. Work runs on the engine's own thread pool (threads from the
//! engine config). LoRA adapters (ABI 1.6) add their low-rank updates after each targeted
//! projection's product, to the rows of their sequences only ([`lora`]).

pub mod attention;
pub mod lora;
pub mod mamba;
pub mod matmul;
pub mod moe;
pub mod ops;
pub mod panels;

use std::collections::HashMap;
use std::sync::Arc;

use gantry_engine_abi::{EngineError, Status};

use crate::backend::{Backend, Mixer, Mlp, StepInput, TensorLoader, load_stack};
use crate::config::ModelConfig;
use crate::kv::BlockCopy;
use crate::lora::{LoraWeights, Target};
use crate::weights::{TensorInfo, Weights};
use matmul::Linear;
use ops::{AttnShape, AttnTokens, LayerKv};

type Layer = crate::backend::Layer<Vec<f32>, Linear>;

pub struct CpuBackend {
    cfg: ModelConfig,
    weights: Arc<Weights>,
    embed: TensorInfo,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    lm_head: Linear,
    /// Inverse frequencies and cos/sin factor of each rotary setting.
    ropes: Vec<(Vec<f32>, f32)>,
    /// Per layer; empty for state-space layers.
    kv: Vec<LayerKv>,
    /// Per layer, every sequence slot's recurrent state; empty for attention layers.
    states: Vec<Vec<f32>>,
    block_size: usize,
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    /// Loaded LoRA adapters by id, f32.
    adapters: HashMap<u64, LoraWeights>,
}

/// Tensor loading with shape checks; errors name the tensor.
struct Loader<'a> {
    w: &'a Weights,
}

impl TensorLoader for Loader<'_> {
    type Vec = Vec<f32>;
    type Linear = Linear;

    fn vec(&mut self, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        let t = self.w.expect(name, &[len])?;
        Ok(self.w.to_f32(t))
    }

    fn linear_rows(
        &mut self,
        name: &str,
        shape: &[usize],
        start: usize,
        rows: usize,
    ) -> Result<Linear, EngineError> {
        let t = self.w.expect(&format!("{name}.weight"), shape)?;
        Ok(Linear::new(self.w, &self.w.rows_of(t, start, rows), None))
    }

    fn linear_f32(&mut self, name: &str, rows: usize, cols: usize) -> Result<Linear, EngineError> {
        let t = self.w.expect(&format!("{name}.weight"), &[rows, cols])?;
        Ok(Linear::f32(self.w, t))
    }

    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        let t = self.w.expect(name, shape)?;
        Ok(self.w.to_f32(t))
    }

    fn linear(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<Linear, EngineError> {
        let t = self.w.expect(&format!("{name}.weight"), &[rows, cols])?;
        let b = if bias {
            Some(self.vec(&format!("{name}.bias"), rows)?)
        } else {
            None
        };
        Ok(Linear::new(self.w, t, b))
    }
}

impl CpuBackend {
    /// `slots`: sequences that may hold recurrent state at once (the model's most open
    /// sequences).
    pub fn new(
        cfg: &ModelConfig,
        weights: Arc<Weights>,
        n_blocks: usize,
        block_size: usize,
        threads: usize,
        slots: usize,
    ) -> Result<Self, EngineError> {
        let (h, hd, nkv) = (cfg.hidden, cfg.head_dim, cfg.n_kv_heads);
        let embed = weights.expect(cfg.embed_name(), &[cfg.vocab, h])?.clone();
        let stack = load_stack(cfg, &weights, &mut Loader { w: &weights })?;
        let lm_head = stack
            .lm_head
            .unwrap_or_else(|| Linear::new(&weights, &embed, None));
        let ropes = cfg
            .ropes
            .iter()
            .map(|r| r.inv_freq(cfg.rotary_dim))
            .collect();
        let cells = n_blocks * block_size * nkv * hd;
        let state_floats = cfg.mamba.as_ref().map_or(0, |m| m.state_floats());
        let mut states = Vec::with_capacity(cfg.n_layers);
        for l in &cfg.layers {
            let n = if l.mamba { slots * state_floats } else { 0 };
            let mut v = Vec::new();
            v.try_reserve_exact(n).map_err(|_| {
                EngineError::new(
                    Status::OomRam,
                    format!("cannot allocate the recurrent state ({} bytes)", n * 4),
                )
            })?;
            v.resize(n, 0.0);
            states.push(v);
        }
        let kv = cfg
            .layers
            .iter()
            .map(|l| {
                if !l.attends() {
                    return Ok(LayerKv {
                        k: Vec::new(),
                        v: Vec::new(),
                    });
                }
                let mut k = Vec::new();
                let mut v = Vec::new();
                k.try_reserve_exact(cells)
                    .and_then(|()| v.try_reserve_exact(cells))
                    .map_err(|_| {
                        EngineError::new(
                            Status::OomRam,
                            format!(
                                "cannot allocate the KV cache ({} bytes)",
                                cells * 8 * cfg.n_layers
                            ),
                        )
                    })?;
                k.resize(cells, 0.0);
                v.resize(cells, 0.0);
                Ok(LayerKv { k, v })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("native-cpu-{i}"))
            .build()
            .map(Arc::new)
            .map_err(|e| EngineError::internal(format!("thread pool: {e}")))?;
        Ok(Self {
            cfg: cfg.clone(),
            weights,
            embed,
            layers: stack.layers,
            final_norm: stack.final_norm,
            lm_head,
            ropes,
            kv,
            states,
            block_size,
            pool,
            threads,
            adapters: HashMap::new(),
        })
    }

    fn run(&mut self, input: &StepInput<'_>) -> Result<Vec<f32>, EngineError> {
        let cfg = &self.cfg;
        let w = &*self.weights;
        let t = input.tokens.len();
        let (h, hd, nh, nkv, ff) = cfg.dims();
        let (qd, kvd) = (nh * hd, nkv * hd);
        let mut scratch = Vec::new();

        // Embeddings, scaled (Gemma: by sqrt(hidden)).
        let mut x = vec![0.0f32; t * h];
        let row_bytes = h * self.embed.dtype.size();
        let table = w.bytes(&self.embed);
        for (i, &tok) in input.tokens.iter().enumerate() {
            let id = usize::try_from(tok)
                .ok()
                .filter(|&id| id < cfg.vocab)
                .ok_or_else(|| {
                    EngineError::unsupported(format!("token id {tok} is outside the vocabulary"))
                })?;
            let row = crate::weights::to_f32(
                &table[id * row_bytes..(id + 1) * row_bytes],
                self.embed.dtype,
            );
            for (d, s) in x[i * h..(i + 1) * h].iter_mut().zip(row) {
                *d = s * cfg.embed_scale;
            }
        }

        let tables: Vec<(Vec<f32>, Vec<f32>)> = self
            .ropes
            .iter()
            .map(|(f, a)| ops::rope_table(input.positions, f, *a))
            .collect();
        let toks = AttnTokens {
            positions: input.positions,
            tables: input.tables,
            seq_of: input.seq_of,
        };
        let mut hbuf = vec![0.0f32; t * h];
        let mut q = vec![0.0f32; t * qd];
        let mut k = vec![0.0f32; t * kvd];
        let mut v = vec![0.0f32; t * kvd];
        let mut att = vec![0.0f32; t * qd];
        let mut o = vec![0.0f32; t * h];
        let mut g = vec![0.0f32; t * ff];
        let mut u = vec![0.0f32; t * ff];
        let bs = self.block_size;
        let mut lora = lora::Runs::new(input.adapters, &self.adapters)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let kind = &cfg.layers[li];
            // An MLP-only block (Nemotron-H) mixes no tokens: straight to the MLP half.
            if !matches!(layer.mixer, Mixer::None) {
                ops::rms_norm(
                    &x,
                    &layer.in_norm,
                    cfg.rms_eps,
                    cfg.norm_plus_one,
                    &mut hbuf,
                );
                let attn = match &layer.mixer {
                    Mixer::Mamba(m) => {
                        let spec = cfg
                            .mamba
                            .as_ref()
                            .expect("a state-space layer has its spec");
                        let toks = mamba::Tokens {
                            positions: input.positions,
                            seq_of: input.seq_of,
                            slots: input.slots,
                        };
                        mamba::forward(
                            w,
                            m,
                            spec,
                            cfg.rms_eps,
                            &hbuf,
                            &toks,
                            h,
                            &mut self.states[li],
                            &mut o,
                            &mut scratch,
                        );
                        None
                    }
                    Mixer::Attention(a) => Some(a),
                    Mixer::None => None,
                };
                if let Some(layer_attn) = attn {
                    layer_attn.q.forward(w, &hbuf, t, &mut q, &mut scratch);
                    layer_attn.k.forward(w, &hbuf, t, &mut k, &mut scratch);
                    layer_attn.v.forward(w, &hbuf, t, &mut v, &mut scratch);
                    lora.apply(li, Target::Q, &hbuf, &mut q);
                    lora.apply(li, Target::K, &hbuf, &mut k);
                    lora.apply(li, Target::V, &hbuf, &mut v);
                    if let (Some(qn), Some(kn)) = (&layer_attn.q_norm, &layer_attn.k_norm) {
                        ops::rms_norm_inplace(&mut q, qn, cfg.rms_eps, cfg.norm_plus_one);
                        ops::rms_norm_inplace(&mut k, kn, cfg.rms_eps, cfg.norm_plus_one);
                    }
                    let (cos, sin) = &tables[kind.rope];
                    ops::rope(&mut q, nh, hd, cos, sin);
                    ops::rope(&mut k, nkv, hd, cos, sin);
                    // Append this step's K/V at each token's position.
                    let kvl = &mut self.kv[li];
                    for i in 0..t {
                        let p = input.positions[i];
                        let table = input.tables[input.seq_of[i]];
                        let cell = table[p / bs] as usize * bs + p % bs;
                        kvl.k[cell * kvd..(cell + 1) * kvd]
                            .copy_from_slice(&k[i * kvd..(i + 1) * kvd]);
                        kvl.v[cell * kvd..(cell + 1) * kvd]
                            .copy_from_slice(&v[i * kvd..(i + 1) * kvd]);
                    }
                    let shape = AttnShape {
                        n_heads: nh,
                        n_kv_heads: nkv,
                        head_dim: hd,
                        block_size: bs,
                        window: kind.window,
                        scale: cfg.attn_scale,
                        softcap: cfg.attn_softcap,
                        sinks: layer_attn.sinks.as_deref(),
                    };
                    ops::attention(&q, &self.kv[li], &toks, &shape, &mut att);
                    layer_attn.o.forward(w, &att, t, &mut o, &mut scratch);
                    lora.apply(li, Target::O, &att, &mut o);
                }
                if let Some(n) = &layer.post_attn_norm {
                    ops::rms_norm_inplace(&mut o, n, cfg.rms_eps, cfg.norm_plus_one);
                }
                x.iter_mut()
                    .zip(&o)
                    .for_each(|(x, o)| *x += o * cfg.residual_scale);
            }
            if matches!(layer.mlp, Mlp::None) {
                // A mixer-only block (Nemotron-H).
                continue;
            }
            ops::rms_norm(
                &x,
                &layer.ffn_norm,
                cfg.rms_eps,
                cfg.norm_plus_one,
                &mut hbuf,
            );
            match &layer.mlp {
                Mlp::Experts {
                    router,
                    choice_bias,
                    experts,
                    shared,
                    spec,
                } => moe::forward(
                    w,
                    (router, choice_bias.as_deref()),
                    experts,
                    shared.as_ref(),
                    spec,
                    cfg.activation,
                    &hbuf,
                    t,
                    h,
                    &mut o,
                    &mut scratch,
                ),
                Mlp::Dense(f) => {
                    f.up.forward(w, &hbuf, t, &mut u, &mut scratch);
                    lora.apply(li, Target::Up, &hbuf, &mut u);
                    if let Some(gate) = &f.gate {
                        gate.forward(w, &hbuf, t, &mut g, &mut scratch);
                        lora.apply(li, Target::Gate, &hbuf, &mut g);
                    }
                    ops::activate(cfg.activation, &mut g, &u);
                    f.down.forward(w, &g, t, &mut o, &mut scratch);
                    lora.apply(li, Target::Down, &g, &mut o);
                }
                Mlp::None => unreachable!("a block without an MLP skipped it above"),
            }
            if let Some(n) = &layer.post_ffn_norm {
                ops::rms_norm_inplace(&mut o, n, cfg.rms_eps, cfg.norm_plus_one);
            }
            x.iter_mut()
                .zip(&o)
                .for_each(|(x, o)| *x += o * cfg.residual_scale);
        }

        let rows = input.logits_rows.len();
        let mut last = vec![0.0f32; rows * h];
        for (r, &i) in input.logits_rows.iter().enumerate() {
            ops::rms_norm(
                &x[i * h..(i + 1) * h],
                &self.final_norm,
                cfg.rms_eps,
                cfg.norm_plus_one,
                &mut last[r * h..(r + 1) * h],
            );
        }
        let mut logits = vec![0.0f32; rows * cfg.vocab];
        self.lm_head
            .forward(w, &last, rows, &mut logits, &mut scratch);
        if let Some(cap) = cfg.final_softcap {
            logits.iter_mut().for_each(|l| *l = (*l / cap).tanh() * cap);
        }
        if cfg.logit_divisor != 1.0 {
            logits.iter_mut().for_each(|l| *l /= cfg.logit_divisor);
        }
        Ok(logits)
    }
}

impl Backend for CpuBackend {
    fn forward(&mut self, input: &StepInput<'_>) -> Result<Vec<f32>, EngineError> {
        // A handle of its own, so `run` can borrow the backend mutably inside the pool.
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.run(input))
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        let per = self.cfg.n_kv_heads * self.cfg.head_dim;
        let bs = self.block_size;
        for c in copies {
            let n = c.slots * per;
            let (src, dst) = (c.src as usize * bs * per, c.dst as usize * bs * per);
            for l in self.kv.iter_mut().filter(|l| !l.k.is_empty()) {
                l.k.copy_within(src..src + n, dst);
                l.v.copy_within(src..src + n, dst);
            }
        }
    }

    fn bytes_used(&self) -> u64 {
        let kv: u64 = self
            .kv
            .iter()
            .map(|l| ((l.k.len() + l.v.len()) * 4) as u64)
            .sum();
        let states: u64 = self.states.iter().map(|s| (s.len() * 4) as u64).sum();
        let owned: u64 = self
            .layers
            .iter()
            .map(|l| {
                l.mixer
                    .linears()
                    .into_iter()
                    .chain(l.mlp.linears())
                    .map(Linear::owned_bytes)
                    .sum::<u64>()
            })
            .sum::<u64>()
            + self.lm_head.owned_bytes();
        let adapters: u64 = self.adapters.values().map(LoraWeights::bytes).sum();
        self.weights.mapped_bytes() + owned + kv + states + adapters
    }

    fn copy_state(&mut self, src: usize, dst: usize) {
        let Some(per) = self.cfg.mamba.as_ref().map(|m| m.state_floats()) else {
            return;
        };
        for s in self.states.iter_mut().filter(|s| !s.is_empty()) {
            s.copy_within(src * per..(src + 1) * per, dst * per);
        }
    }

    fn runs_adapters(&self) -> Result<(), EngineError> {
        Ok(())
    }

    fn adapter_load(&mut self, id: u64, lora: LoraWeights) -> Result<u64, EngineError> {
        let bytes = lora.bytes();
        self.adapters.insert(id, lora);
        Ok(bytes)
    }

    fn adapter_unload(&mut self, id: u64) {
        self.adapters.remove(&id);
    }

    fn describe(&self) -> String {
        format!(
            "cpu, {} threads, {} kernel",
            self.threads,
            if matmul::has_bf16_kernel() {
                matmul::bf16_kernel_name()
            } else {
                "gemm (f32; bf16/f16 weights converted at load)"
            }
        )
    }
}
