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
mod parse;
mod rope;
#[cfg(test)]
mod tests;

pub use parse::parse;
pub use rope::{Rope, RopeScaling};

/// The architectures this engine runs, one per `architectures` class it lists in its manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Architecture {
    /// The `architectures` classes, in the manifest's order.
    pub const CLASSES: [(&'static str, Architecture); 5] = [
        ("LlamaForCausalLM", Architecture::Llama),
        ("MistralForCausalLM", Architecture::Mistral),
        ("Qwen2ForCausalLM", Architecture::Qwen2),
        ("Qwen3ForCausalLM", Architecture::Qwen3),
        ("Gemma3ForCausalLM", Architecture::Gemma3),
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU(gate) * up.
    Silu,
    /// GELU with the tanh approximation (gate) * up.
    GeluTanh,
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
    /// Multiplies the token embeddings (Gemma: sqrt(hidden)).
    pub embed_scale: f32,
    /// Multiplies q·k.
    pub attn_scale: f32,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    pub ropes: Vec<Rope>,
    pub layers: Vec<LayerKind>,
    pub bos_token: Option<i32>,
    pub eos_tokens: Vec<i32>,
}
