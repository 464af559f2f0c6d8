//! Native engine, the backend boundary (below the step's bookkeeping): what a compute backend
//! does for one step, whatever device it runs on.
//!
//! The model-level code (`lib.rs`) owns the sequences, the block tables and each sequence's
//! sampling state; a backend owns the weights in its memory, the K/V blocks, and the forward
//! pass. The CPU backend (`cpu`) and the CUDA backend (`cuda`: cuBLAS for the linear layers,
//! NVRTC kernels for the rest) implement the same trait and hand back the same logits; a
//! backend that samples on its device ([`Backend::samples_on_device`], CUDA) also takes the
//! step's sampling rows and hands back only the tokens (except in a step that verifies drafted
//! tokens, ABI 1.5: that one takes [`Backend::forward`] and samples on the host). Both read the checkpoint's decoder
//! stack through [`load_stack`], each into its own memory ([`TensorLoader`]).

use gantry_engine_abi::{EngineError, SampledToken, Sampling};

use crate::config::{Architecture, Mamba2, ModelConfig, MoeNaming};
use crate::kv::BlockCopy;
use crate::lora::{AdapterRun, LoraWeights};
use crate::weights::Weights;

/// One step's tokens, flattened across sequences.
pub struct StepInput<'a> {
    pub tokens: &'a [i32],
    /// Position of each token in its sequence.
    pub positions: &'a [usize],
    /// Index into `tables` of each token's sequence.
    pub seq_of: &'a [usize],
    pub tables: &'a [&'a [u32]],
    /// Token indices whose logits are wanted, in the order the rows come back.
    pub logits_rows: &'a [usize],
    /// Runs of consecutive tokens whose sequences run under a LoRA adapter (ABI 1.6); empty
    /// when every sequence runs the base model.
    pub adapters: &'a [AdapterRun],
    /// The recurrent-state slot of each sequence (index as `tables`), for state-space layers.
    pub slots: &'a [usize],
}

/// One sampled row of a step, for a backend that samples on its device: what the request
/// asks for and what the sequence's sampling state holds (the host keeps that state, so a
/// sequence samples alike on every backend).
pub struct SampleRow<'a> {
    pub params: &'a Sampling,
    /// Allowed-token bitset (ABI 1.1 structured output), one bit per vocabulary entry.
    pub allowed: Option<&'a [u32]>,
    /// Tokens this sequence generated so far (the penalties' window is taken from its end).
    pub generated: &'a [i32],
    /// Draws this sequence made before this one (the seeded generator's counter).
    pub draw: u64,
}

pub trait Backend: Send {
    /// Run the step: append every token's K/V at its position and return the logits of
    /// `logits_rows`, `[rows][vocab]`.
    fn forward(&mut self, input: &StepInput<'_>) -> Result<Vec<f32>, EngineError>;
    /// Whether [`Backend::forward_sample`] samples on the device.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Run the step and sample row `i` of `logits_rows` by `rows[i]` on the device: only
    /// the tokens (and the log-probabilities asked for) come back.
    fn forward_sample(
        &mut self,
        _input: &StepInput<'_>,
        _rows: &[SampleRow<'_>],
    ) -> Result<Vec<SampledToken>, EngineError> {
        Err(EngineError::unsupported(
            "this backend samples on the host (forward, then the sampler)",
        ))
    }
    /// Copy K/V slots between blocks (prefix reuse's copy on write), before the next forward.
    fn copy_blocks(&mut self, copies: &[BlockCopy]);
    /// Copy one sequence slot's recurrent state to another (a fork); nothing without
    /// state-space layers.
    fn copy_state(&mut self, _src: usize, _dst: usize) {}
    /// Memory this backend holds: weights (mapped or owned) and the KV cache.
    fn bytes_used(&self) -> u64;
    /// One line for logs and the build report.
    fn describe(&self) -> String;
    /// The backend's event counters, cumulative since load (ABI 1.12 `model_counters`): the
    /// CUDA backend's decode graphs captured and replayed. None by default.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
    /// Whether this backend runs LoRA adapters (ABI 1.6); the refusal says why not. Asked
    /// before an adapter's files are read.
    fn runs_adapters(&self) -> Result<(), EngineError> {
        Err(EngineError::unsupported(
            "this backend of the native engine does not run LoRA adapters",
        ))
    }
    /// Take adapter `id` (its rows come as [`StepInput::adapters`] from now on); the bytes it
    /// holds. A refusal keeps nothing.
    fn adapter_load(&mut self, _id: u64, _lora: LoraWeights) -> Result<u64, EngineError> {
        Err(self.runs_adapters().err().unwrap_or_else(|| {
            EngineError::internal("this backend declares adapters but does not load them")
        }))
    }
    /// Free adapter `id` (unknown: nothing happens).
    fn adapter_unload(&mut self, _id: u64) {}
}

/// One decoder layer's tensors as a backend holds them: `V` a norm vector, `L` a linear layer.
pub struct Layer<V, L> {
    pub in_norm: V,
    /// What mixes the tokens: attention or a state-space scan.
    pub mixer: Mixer<V, L>,
    pub post_attn_norm: Option<V>,
    pub ffn_norm: V,
    pub post_ffn_norm: Option<V>,
    pub mlp: Mlp<L>,
}

/// A layer's token mixer.
pub enum Mixer<V, L> {
    Attention(Attention<V, L>),
    /// A Mamba-2 mixer ([`crate::config::Mamba2`]).
    Mamba(Mamba<V, L>),
    /// None: the layer is an MLP alone (Nemotron-H's `mlp` and `moe` blocks).
    None,
}

/// Self-attention's projections and per-head norms.
pub struct Attention<V, L> {
    pub q: L,
    pub k: L,
    pub v: L,
    pub o: L,
    pub q_norm: Option<V>,
    pub k_norm: Option<V>,
    /// A learned logit per head in each softmax's denominator (gpt-oss's sinks).
    pub sinks: Option<V>,
}

/// A Mamba-2 mixer's tensors ([`crate::config::Mamba2`] says how they are used).
pub struct Mamba<V, L> {
    pub in_proj: L,
    /// `conv1d.weight`, `[conv_dim][conv_kernel]` (one filter per channel).
    pub conv: V,
    pub conv_bias: Option<V>,
    /// Per head: the time step's bias, `A_log` (A = -exp(A_log)) and the skip `D`.
    pub dt_bias: V,
    pub a_log: V,
    pub d: V,
    /// The gated RMSNorm's weight, `[heads × head_dim]`.
    pub norm: V,
    pub out_proj: L,
}

impl<V, L> Mixer<V, L> {
    /// The attention of an attention layer.
    pub fn attention(&self) -> Option<&Attention<V, L>> {
        match self {
            Mixer::Attention(a) => Some(a),
            Mixer::Mamba(_) | Mixer::None => None,
        }
    }

    /// Every linear layer of the mixer.
    pub fn linears(&self) -> Vec<&L> {
        match self {
            Mixer::Attention(a) => vec![&a.q, &a.k, &a.v, &a.o],
            Mixer::Mamba(m) => vec![&m.in_proj, &m.out_proj],
            Mixer::None => Vec::new(),
        }
    }
}

/// An MLP: `down(act(gate(x)) * up(x))`, or `down(act(up(x)))` without a gate
/// ([`crate::config::Activation::gated`]).
pub struct Ffn<L> {
    pub gate: Option<L>,
    pub up: L,
    pub down: L,
}

impl<L> Ffn<L> {
    /// Its linear layers, gate first when it has one.
    pub fn linears(&self) -> impl Iterator<Item = &L> {
        self.gate.iter().chain([&self.up, &self.down])
    }
}

/// A layer's MLP: one dense [`Ffn`], or a mixture of experts ([`crate::config::Moe`]).
pub enum Mlp<L> {
    Dense(Ffn<L>),
    Experts {
        router: L,
        /// The per-expert bias added to the scores when choosing (not when weighting): the
        /// router's `e_score_correction_bias` ([`crate::config::Routing::Sigmoid`]).
        choice_bias: Option<Vec<f32>>,
        experts: Vec<Ffn<L>>,
        /// The shared expert and its one-row gate, when it has one
        /// ([`crate::config::Moe::shared`]).
        shared: Option<(Ffn<L>, Option<L>)>,
        spec: crate::config::Moe,
    },
    /// None: the layer is a mixer alone (Nemotron-H's Mamba and attention blocks).
    None,
}

impl<L> Mlp<L> {
    /// Every linear layer of the MLP (router first).
    pub fn linears(&self) -> Vec<&L> {
        match self {
            Mlp::Dense(f) => f.linears().collect(),
            Mlp::Experts {
                router,
                experts,
                shared,
                ..
            } => std::iter::once(router)
                .chain(experts.iter().flat_map(Ffn::linears))
                .chain(shared.iter().flat_map(|(f, g)| f.linears().chain(g)))
                .collect(),
            Mlp::None => Vec::new(),
        }
    }
}

/// How a backend reads a tensor into its own memory (with the shape checks of
/// [`crate::weights::Weights::expect`], errors naming the tensor).
pub trait TensorLoader {
    type Vec;
    type Linear;
    /// A `[len]` vector (norm weights, biases) as f32.
    fn vec(&mut self, name: &str, len: usize) -> Result<Self::Vec, EngineError>;
    /// Rows `start..start + rows` of `{name}.weight` (of exactly `shape`, read as a matrix of
    /// its last dimension's columns) as a linear layer: one expert of a tensor holding them all,
    /// or the gate or up half of a fused projection. A backend without such layers refuses.
    fn linear_rows(
        &mut self,
        name: &str,
        shape: &[usize],
        start: usize,
        rows: usize,
    ) -> Result<Self::Linear, EngineError> {
        let _ = (shape, start, rows);
        Err(EngineError::unsupported(format!(
            "{name}: this backend of the native engine does not read fused expert tensors"
        )))
    }
    /// A tensor of `shape` read whole as f32 (a convolution's filters); a backend without
    /// such layers refuses.
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Self::Vec, EngineError> {
        let _ = shape;
        Err(EngineError::unsupported(format!(
            "{name}: this backend of the native engine does not run state-space layers"
        )))
    }
    /// `{name}.weight` of shape `[rows, cols]`, no bias, computed in f32 whatever its dtype
    /// and the backend's kernels (a router the model runs in f32: Nemotron-H's). A backend
    /// without that distinction reads it as [`TensorLoader::linear`] does.
    fn linear_f32(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Self::Linear, EngineError> {
        self.linear(name, rows, cols, false)
    }
    /// `{name}.weight` of shape `[rows, cols]`, and `{name}.bias` when `bias`.
    fn linear(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<Self::Linear, EngineError>;
}

/// The decoder stack of a checkpoint, by its Hugging Face tensor names: the layers, the final
/// norm, and the output projection (`None` when it is the embedding table, tied). One place
/// for every backend, so an architecture's tensors are named once.
pub struct Stack<V, L> {
    pub layers: Vec<Layer<V, L>>,
    pub final_norm: V,
    pub lm_head: Option<L>,
}

pub fn load_stack<T: TensorLoader>(
    cfg: &ModelConfig,
    weights: &Weights,
    t: &mut T,
) -> Result<Stack<T::Vec, T::Linear>, EngineError> {
    let h = cfg.hidden;
    let (layers, final_norm) = if cfg.architecture == Architecture::NemotronH {
        (
            crate::nemotron_h::load_layers(cfg, weights, t)?,
            "backbone.norm_f.weight",
        )
    } else if cfg.architecture == Architecture::Bamba {
        (load_layers(cfg, t)?, "model.final_layernorm.weight")
    } else {
        (load_layers(cfg, t)?, "model.norm.weight")
    };
    let final_norm = t.vec(final_norm, h)?;
    let lm_head = if !cfg.tie_embeddings || weights.contains("lm_head.weight") {
        Some(t.linear("lm_head", cfg.vocab, h, false)?)
    } else {
        None
    };
    Ok(Stack {
        layers,
        final_norm,
        lm_head,
    })
}

/// A loader's decoder layers.
pub type Layers<T> = Vec<Layer<<T as TensorLoader>::Vec, <T as TensorLoader>::Linear>>;

/// The decoder layers, by transformers' `model.layers.{i}` names.
fn load_layers<T: TensorLoader>(cfg: &ModelConfig, t: &mut T) -> Result<Layers<T>, EngineError> {
    let (h, hd, nh, nkv, ff) = cfg.dims();
    let gemma = cfg.sandwich_norms;
    let bamba = cfg.architecture == Architecture::Bamba;
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for i in 0..cfg.n_layers {
        let p = format!("model.layers.{i}");
        let in_norm = t.vec(&format!("{p}.input_layernorm.weight"), h)?;
        let mixer = match &cfg.mamba {
            Some(m) if cfg.layers[i].mamba => {
                Mixer::Mamba(load_mamba(m, h, &format!("{p}.mamba"), t)?)
            }
            _ => {
                let (q_norm, k_norm) = if cfg.qk_norm {
                    (
                        Some(t.vec(&format!("{p}.self_attn.q_norm.weight"), hd)?),
                        Some(t.vec(&format!("{p}.self_attn.k_norm.weight"), hd)?),
                    )
                } else {
                    (None, None)
                };
                Mixer::Attention(Attention {
                    q: t.linear(&format!("{p}.self_attn.q_proj"), nh * hd, h, cfg.qkv_bias)?,
                    k: t.linear(&format!("{p}.self_attn.k_proj"), nkv * hd, h, cfg.qkv_bias)?,
                    v: t.linear(&format!("{p}.self_attn.v_proj"), nkv * hd, h, cfg.qkv_bias)?,
                    o: t.linear(&format!("{p}.self_attn.o_proj"), h, nh * hd, cfg.o_bias)?,
                    q_norm,
                    k_norm,
                    sinks: match cfg.attn_sinks {
                        true => Some(t.vec(&format!("{p}.self_attn.sinks"), nh)?),
                        false => None,
                    },
                })
            }
        };
        let post_attn_norm = if gemma {
            Some(t.vec(&format!("{p}.post_attention_layernorm.weight"), h)?)
        } else {
            None
        };
        // Gemma's sandwich norms: the pre-FFN norm has its own name; elsewhere the
        // "post-attention" norm is the one before the FFN.
        let ffn_norm = if gemma {
            t.vec(&format!("{p}.pre_feedforward_layernorm.weight"), h)?
        } else if bamba {
            t.vec(&format!("{p}.pre_ff_layernorm.weight"), h)?
        } else {
            t.vec(&format!("{p}.post_attention_layernorm.weight"), h)?
        };
        // Bamba names its MLP `feed_forward`.
        let mlp_name = if bamba { "feed_forward" } else { "mlp" };
        let post_ffn_norm = if gemma {
            Some(t.vec(&format!("{p}.post_feedforward_layernorm.weight"), h)?)
        } else {
            None
        };
        let granite = cfg.architecture == Architecture::GraniteMoeHybrid;
        let mlp = match (&cfg.moe, cfg.layers[i].moe) {
            (Some(moe), true) => {
                // gpt-oss's router and experts carry biases.
                let bias = moe.naming == MoeNaming::GptOss;
                let router = t.linear(&moe.naming.router(i), moe.experts, h, bias)?;
                let ff = moe.intermediate;
                let experts = (0..moe.experts)
                    .map(|e| {
                        let [g, u, d] = moe.naming.expert(i, e);
                        if moe.naming == MoeNaming::Granite {
                            // Expert e's gate and up rows, then its down rows.
                            let (n, two) = (moe.experts, 2 * ff);
                            return Ok(Ffn {
                                gate: Some(t.linear_rows(&g, &[n, two, h], e * two, ff)?),
                                up: t.linear_rows(&u, &[n, two, h], e * two + ff, ff)?,
                                down: t.linear_rows(&d, &[n, h, ff], e * h, h)?,
                            });
                        }
                        Ok(Ffn {
                            gate: Some(t.linear(&g, ff, h, bias)?),
                            up: t.linear(&u, ff, h, bias)?,
                            down: t.linear(&d, h, ff, bias)?,
                        })
                    })
                    .collect::<Result<_, EngineError>>()?;
                let shared = match moe.shared {
                    Some(ff) if granite => Some((granite_shared(&p, ff, h, t)?, None)),
                    Some(ff) => {
                        let ([g, u, d], gate) = moe.naming.shared(i);
                        Some((
                            Ffn {
                                gate: Some(t.linear(&g, ff, h, false)?),
                                up: t.linear(&u, ff, h, false)?,
                                down: t.linear(&d, h, ff, false)?,
                            },
                            Some(t.linear(&gate, 1, h, false)?),
                        ))
                    }
                    None => None,
                };
                Mlp::Experts {
                    router,
                    choice_bias: None,
                    experts,
                    shared,
                    spec: moe.clone(),
                }
            }
            _ if granite => Mlp::Dense(granite_shared(&p, ff, h, t)?),
            _ => Mlp::Dense(Ffn {
                gate: Some(t.linear(&format!("{p}.{mlp_name}.gate_proj"), ff, h, cfg.mlp_bias)?),
                up: t.linear(&format!("{p}.{mlp_name}.up_proj"), ff, h, cfg.mlp_bias)?,
                down: t.linear(&format!("{p}.{mlp_name}.down_proj"), h, ff, cfg.mlp_bias)?,
            }),
        };
        layers.push(Layer {
            in_norm,
            mixer,
            post_attn_norm,
            ffn_norm,
            post_ffn_norm,
            mlp,
        });
    }
    Ok(layers)
}

/// Granite's shared MLP under `{p}.shared_mlp.`: `input_linear` `[2 × ff][hidden]` (gate rows,
/// then up rows) and `output_linear` `[hidden][ff]`.
fn granite_shared<T: TensorLoader>(
    p: &str,
    ff: usize,
    hidden: usize,
    t: &mut T,
) -> Result<Ffn<T::Linear>, EngineError> {
    let input = format!("{p}.shared_mlp.input_linear");
    Ok(Ffn {
        gate: Some(t.linear_rows(&input, &[2 * ff, hidden], 0, ff)?),
        up: t.linear_rows(&input, &[2 * ff, hidden], ff, ff)?,
        down: t.linear(&format!("{p}.shared_mlp.output_linear"), hidden, ff, false)?,
    })
}

/// A Mamba-2 mixer's tensors under `{p}.` (Bamba's and Granite 4.0-H's `….mamba`,
/// Nemotron-H's `….mixer`).
pub(crate) fn load_mamba<T: TensorLoader>(
    m: &Mamba2,
    hidden: usize,
    p: &str,
    t: &mut T,
) -> Result<Mamba<T::Vec, T::Linear>, EngineError> {
    let (cd, heads, inner) = (m.conv_dim(), m.heads, m.inner());
    Ok(Mamba {
        in_proj: t.linear(
            &format!("{p}.in_proj"),
            m.in_proj_rows(),
            hidden,
            m.proj_bias,
        )?,
        conv: t.tensor(&format!("{p}.conv1d.weight"), &[cd, 1, m.conv_kernel])?,
        conv_bias: if m.conv_bias {
            Some(t.vec(&format!("{p}.conv1d.bias"), cd)?)
        } else {
            None
        },
        dt_bias: t.vec(&format!("{p}.dt_bias"), heads)?,
        a_log: t.vec(&format!("{p}.A_log"), heads)?,
        d: t.vec(&format!("{p}.D"), heads)?,
        norm: t.vec(&format!("{p}.norm.weight"), inner)?,
        out_proj: t.linear(&format!("{p}.out_proj"), hidden, inner, m.proj_bias)?,
    })
}
