//! Native engine, load step 1: `config.json` into the hyper-parameters the forward pass runs.
//!
//! The architecture is the `architectures` class (`LlamaForCausalLM`, ...), the same key the node
//! and the operator match against the manifest. Every option this engine does not implement is a
//! clear `UNSUPPORTED` naming the field (an unknown `rope_scaling` type, a sliding window on a
//! family that has none here, ...): a model never runs with a detail silently ignored.
//!
//! The types live here; `config.json` is read field by field through `config/fields.rs`, the
//! rotary embedding options into a [`Rope`] in `config/rope.rs`, and [`parse()`]
//! (`config/parse.rs`) puts them together per family.

mod fields;
mod gpt_oss;
mod mamba;
mod nemotron_h;
mod parse;
mod quant;
mod rope;
#[cfg(test)]
mod tests;

pub use parse::parse;
pub use quant::Quant;
pub use rope::{Rope, RopeScaling};

/// The architectures this engine runs, one per `architectures` class it lists in its manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Qwen3 attention with mixture-of-experts MLPs.
    Qwen3Moe,
    /// Mistral attention with mixture-of-experts MLPs.
    Mixtral,
    /// Qwen2 attention with mixture-of-experts MLPs and a gated shared expert.
    Qwen2Moe,
    /// Mamba-2 layers and attention layers (partial RoPE), each followed by a SiLU-gated MLP.
    Bamba,
    /// Granite 4.0-H: Mamba-2 and attention layers (RoPE or none), a shared MLP in every
    /// layer with or without a mixture of experts beside it, µP multipliers.
    GraniteMoeHybrid,
    /// Nemotron-H: one mixer per layer (a Mamba-2 scan, attention without position encoding,
    /// a relu² MLP, or a mixture of relu² experts with sigmoid routing) as its layer pattern
    /// says.
    NemotronH,
    /// gpt-oss: attention with q/k/v/o biases and a learned sink per head, sliding and full
    /// layers alternating, YaRN; a mixture of experts with a biased router and clamped SwiGLU
    /// experts with biases, stored fused (and in MXFP4 as released).
    GptOss,
}

impl Architecture {
    /// The `architectures` classes, in the manifest's order.
    pub const CLASSES: [(&'static str, Architecture); 12] = [
        ("LlamaForCausalLM", Architecture::Llama),
        ("MistralForCausalLM", Architecture::Mistral),
        ("Qwen2ForCausalLM", Architecture::Qwen2),
        ("Qwen3ForCausalLM", Architecture::Qwen3),
        ("Gemma3ForCausalLM", Architecture::Gemma3),
        ("Qwen3MoeForCausalLM", Architecture::Qwen3Moe),
        ("MixtralForCausalLM", Architecture::Mixtral),
        ("Qwen2MoeForCausalLM", Architecture::Qwen2Moe),
        ("BambaForCausalLM", Architecture::Bamba),
        (
            "GraniteMoeHybridForCausalLM",
            Architecture::GraniteMoeHybrid,
        ),
        ("NemotronHForCausalLM", Architecture::NemotronH),
        ("GptOssForCausalLM", Architecture::GptOss),
    ];

    pub fn from_class(class: &str) -> Option<Architecture> {
        Self::CLASSES
            .iter()
            .find(|(c, _)| *c == class)
            .map(|(_, f)| *f)
    }
}
/// How a layer attends.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerKind {
    /// Attend to the last `window` positions only (the query's own included); `None` = all.
    pub window: Option<usize>,
    /// Index into [`ModelConfig::ropes`].
    pub rope: usize,
    /// The MLP is [`ModelConfig::moe`]'s mixture of experts (else the dense MLP).
    pub moe: bool,
    /// The layer mixes tokens with [`ModelConfig::mamba`]'s state-space scan instead of
    /// attention (no K/V; a recurrent state per sequence).
    pub mamba: bool,
    /// The layer mixes tokens (attention or a scan); Nemotron-H's MLP and MoE layers do not.
    pub mixer: bool,
    /// The layer has an MLP (dense or experts); Nemotron-H's mixer layers do not.
    pub mlp: bool,
}

impl LayerKind {
    /// An attention layer with an MLP, all positions, the first rotary setting.
    pub const ATTENTION: LayerKind = LayerKind {
        window: None,
        rope: 0,
        moe: false,
        mamba: false,
        mixer: true,
        mlp: true,
    };

    /// Whether the layer keeps K/V in the paged cache.
    pub fn attends(&self) -> bool {
        self.mixer && !self.mamba
    }
}

/// Mamba-2 mixers (Bamba): `in_proj` splits into a gate `z` (`heads × head_dim`), the
/// convolved `xBC` (x, then `groups` B and C vectors of `state` each) and a time step per head;
/// a causal depthwise convolution of `conv_kernel` taps over xBC, SiLU; the selective scan
/// `h ← exp(dt·A)·h + dt·x⊗B`, `y = h·C + D·x` per head (B and C shared by the heads of a
/// group); `y·SiLU(z)` RMS-normalised over `norm_groups` groups; `out_proj`.
#[derive(Clone, Debug, PartialEq)]
pub struct Mamba2 {
    pub heads: usize,
    pub head_dim: usize,
    pub state: usize,
    pub groups: usize,
    pub conv_kernel: usize,
    pub conv_bias: bool,
    pub proj_bias: bool,
    /// Groups the gated RMSNorm normalises over separately (Bamba: 1, the whole width).
    pub norm_groups: usize,
    /// The time step is clamped to this range after softplus (`time_step_limit`; unbounded,
    /// `(0, inf)`, unless the config says otherwise).
    pub dt_limit: (f32, f32),
}

impl Mamba2 {
    /// Width of x (and of the gate): `heads × head_dim`.
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Width of the convolved xBC.
    pub fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.groups * self.state
    }
    /// Rows of `in_proj`: gate, xBC, one time step per head.
    pub fn in_proj_rows(&self) -> usize {
        self.inner() + self.conv_dim() + self.heads
    }
    /// f32 values one sequence's state holds in one layer: the convolution's last
    /// `conv_kernel - 1` inputs and the scan's `heads × head_dim × state`.
    pub fn state_floats(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim() + self.heads * self.head_dim * self.state
    }
}

/// Mixture-of-experts MLPs: a linear router scores every expert per token; the `top_k` best
/// run (SiLU-gated MLPs of `intermediate` rows) and their outputs are summed, weighted by the
/// softmax of the router's scores (renormalised over the chosen experts when `normalize`).
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub normalize: bool,
    pub naming: MoeNaming,
    /// A shared expert every token runs (of this many rows), its output added: scaled by
    /// `sigmoid(shared_expert_gate · x)` (Qwen2-MoE) or as is (Granite, `shared_gate` false).
    pub shared: Option<usize>,
    pub shared_gate: bool,
    /// How the router's scores become the chosen experts' weights.
    pub routing: Routing,
}

/// A mixture of experts' routing.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// The softmax of the router's scores; the top-k kept (and renormalised when
    /// [`Moe::normalize`]).
    Softmax,
    /// DeepSeek-V3's (Nemotron-H): sigmoid scores; the experts chosen by score plus a learned
    /// per-expert bias (`e_score_correction_bias`, read per layer), among the `topk_groups`
    /// best of `groups` equal groups (a group's score: its two best); weighted by their
    /// sigmoid scores (renormalised when [`Moe::normalize`]) times `scale`
    /// (`routed_scaling_factor`).
    Sigmoid {
        groups: usize,
        topk_groups: usize,
        scale: f32,
    },
}

/// How a checkpoint names a mixture-of-experts layer's tensors under `model.layers.{i}.`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeNaming {
    /// `mlp.gate` (router), `mlp.experts.{e}.{gate,up,down}_proj` (Qwen2/3-MoE).
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.{w1,w3,w2}` (Mixtral).
    Mixtral,
    /// `block_sparse_moe.router.layer` (router), every expert in one tensor each:
    /// `block_sparse_moe.input_linear` `[experts][2 × ff][hidden]` (gate rows, then up rows)
    /// and `output_linear` `[experts][hidden][ff]`; the shared MLP `shared_mlp.input_linear`
    /// and `output_linear` likewise (Granite).
    Granite,
    /// `backbone.layers.{i}.mixer.gate` (router, with `e_score_correction_bias`),
    /// `mixer.experts.{e}.{up,down}_proj` (no gate: relu² experts) and
    /// `mixer.shared_experts.{up,down}_proj` (Nemotron-H).
    NemotronH,
    /// `mlp.router` (with a bias), `mlp.experts.{e}.{gate,up,down}_proj` with biases: the
    /// per-expert tensors `crate::gpt_oss` makes at load from the checkpoint's fused ones.
    GptOss,
}

impl MoeNaming {
    /// The router's name (without `.weight`) in layer `layer`.
    pub fn router(self, layer: usize) -> String {
        match self {
            MoeNaming::Qwen => format!("model.layers.{layer}.mlp.gate"),
            MoeNaming::Mixtral => format!("model.layers.{layer}.block_sparse_moe.gate"),
            MoeNaming::Granite => format!("model.layers.{layer}.block_sparse_moe.router.layer"),
            MoeNaming::NemotronH => format!("backbone.layers.{layer}.mixer.gate"),
            MoeNaming::GptOss => format!("model.layers.{layer}.mlp.router"),
        }
    }

    /// The shared expert's gate, up and down projections and its gate (without `.weight`).
    pub fn shared(self, layer: usize) -> ([String; 3], String) {
        if self == MoeNaming::NemotronH {
            let p = format!("backbone.layers.{layer}.mixer.shared_experts");
            return (
                [
                    String::new(),
                    format!("{p}.up_proj"),
                    format!("{p}.down_proj"),
                ],
                String::new(),
            );
        }
        let p = format!("model.layers.{layer}.mlp");
        (
            [
                format!("{p}.shared_expert.gate_proj"),
                format!("{p}.shared_expert.up_proj"),
                format!("{p}.shared_expert.down_proj"),
            ],
            format!("{p}.shared_expert_gate"),
        )
    }

    /// Expert `e`'s gate, up and down projections (without `.weight`) in layer `layer`.
    pub fn expert(self, layer: usize, e: usize) -> [String; 3] {
        match self {
            MoeNaming::Qwen | MoeNaming::GptOss => {
                let p = format!("model.layers.{layer}.mlp.experts.{e}");
                [
                    format!("{p}.gate_proj"),
                    format!("{p}.up_proj"),
                    format!("{p}.down_proj"),
                ]
            }
            MoeNaming::Mixtral => {
                let p = format!("model.layers.{layer}.block_sparse_moe.experts.{e}");
                [format!("{p}.w1"), format!("{p}.w3"), format!("{p}.w2")]
            }
            // One tensor for every expert: `load_stack` takes expert `e`'s rows.
            MoeNaming::Granite => {
                let p = format!("model.layers.{layer}.block_sparse_moe");
                [
                    format!("{p}.input_linear"),
                    format!("{p}.input_linear"),
                    format!("{p}.output_linear"),
                ]
            }
            // No gate projection: the first name is empty.
            MoeNaming::NemotronH => {
                let p = format!("backbone.layers.{layer}.mixer.experts.{e}");
                [
                    String::new(),
                    format!("{p}.up_proj"),
                    format!("{p}.down_proj"),
                ]
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// SiLU(gate) * up.
    Silu,
    /// GELU with the tanh approximation (gate) * up.
    GeluTanh,
    /// relu(up)², no gate (Nemotron-H's MLPs and experts).
    Relu2,
    /// gpt-oss's: `g · sigmoid(1.702 g) · (u + 1)` with the gate `g` clamped above at
    /// `limit` and the up value `u` to `±limit` (`swiglu_limit`).
    ClampedSwiglu { limit: f32 },
}

impl Activation {
    /// Whether the MLP has a gate projection.
    pub fn gated(self) -> bool {
        self != Activation::Relu2
    }
}

/// Everything the forward pass needs, checked.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: Architecture,
    /// The `architectures` class, as reported in `model_info`.
    pub class: String,
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub max_position: u32,
    pub tie_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2; Llama's `attention_bias` also biases o).
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm multiplies by (1 + w) (Gemma).
    pub norm_plus_one: bool,
    /// Gemma 3's extra norms around attention and MLP outputs.
    pub sandwich_norms: bool,
    pub activation: Activation,
    /// Multiplies the token embeddings (Gemma: sqrt(hidden); Granite: `embedding_multiplier`).
    pub embed_scale: f32,
    /// Multiplies each layer's attention (or mixer) and MLP output before it joins the residual
    /// stream (Granite's `residual_multiplier`; 1 elsewhere).
    pub residual_scale: f32,
    /// Divides the logits (Granite's `logits_scaling`; 1 elsewhere).
    pub logit_divisor: f32,
    /// Multiplies q·k.
    pub attn_scale: f32,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    pub ropes: Vec<Rope>,
    /// Dimensions of each head RoPE rotates, from the first (`partial_rotary_factor`; the whole
    /// head elsewhere; 0 = no position encoding, Granite 4.0-H's `nope`).
    pub rotary_dim: usize,
    pub layers: Vec<LayerKind>,
    /// The state-space mixer of the layers whose [`LayerKind::mamba`] is set.
    pub mamba: Option<Mamba2>,
    /// The mixture of experts of the layers whose [`LayerKind::moe`] is set.
    pub moe: Option<Moe>,
    /// FP8 weights (`quantization_config` `quant_method: fp8`), dequantized at load.
    pub fp8: Option<crate::weights::Fp8>,
    /// MXFP4 experts (`quant_method: mxfp4`, gpt-oss), dequantized to bf16 at load.
    pub mxfp4: bool,
    /// A learned logit per head joins each attention softmax's denominator (gpt-oss's sinks,
    /// `self_attn.sinks`).
    pub attn_sinks: bool,
    pub bos_token: Option<i32>,
    pub eos_tokens: Vec<i32>,
}

impl ModelConfig {
    /// `(hidden, head_dim, n_heads, n_kv_heads, intermediate)`, the shapes every layer reads.
    pub fn dims(&self) -> (usize, usize, usize, usize, usize) {
        (
            self.hidden,
            self.head_dim,
            self.n_heads,
            self.n_kv_heads,
            self.intermediate,
        )
    }
    /// Layers with K/V (attention layers).
    pub fn attention_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.attends()).count()
    }
    /// The token embedding table's tensor name.
    pub fn embed_name(&self) -> &'static str {
        if self.architecture == Architecture::NemotronH {
            "backbone.embeddings.weight"
        } else {
            "model.embed_tokens.weight"
        }
    }
    /// f32 values of recurrent state one sequence holds, all layers together (0 without
    /// state-space layers).
    pub fn state_floats_per_sequence(&self) -> usize {
        self.mamba.as_ref().map_or(0, |m| {
            m.state_floats() * self.layers.iter().filter(|l| l.mamba).count()
        })
    }
}
