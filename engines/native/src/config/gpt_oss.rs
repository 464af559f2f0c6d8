//! Native engine, load step 1 for gpt-oss (called by [`super::parse()`] once the class is
//! known): `GptOssConfig`'s fields, with transformers' defaults, into a [`ModelConfig`].
//!
//! Every gpt-oss layer is attention then a mixture of experts. Attention has biases on q, k, v
//! and o, a learned sink logit per head, and YaRN positions (`truncate: false` as released);
//! layers alternate between a sliding window and full attention (`layer_types`, sliding first
//! by default). The router has a bias and keeps the softmax of its top-k scores; each expert
//! is a clamped SwiGLU with biases (`swiglu_limit`, 7 as released). The checkpoint stores the
//! experts fused (and as MXFP4 blocks in the released files): `crate::gpt_oss` splits them
//! at load.

use gantry_engine_abi::EngineError;

use super::fields::{Fields, corrupt};
use super::parse::{check_top_k, sliding_layers};
use super::rope::rope_from;
use super::{Activation, Architecture, LayerKind, ModelConfig, Moe, MoeNaming, Quant, Routing};

pub(super) fn parse(
    f: &Fields<'_>,
    class: String,
    quant: Quant,
    bos_token: Option<i32>,
    eos_tokens: Vec<i32>,
) -> Result<ModelConfig, EngineError> {
    let n_layers = f.usize("num_hidden_layers")?.unwrap_or(36);
    let hidden = f.usize("hidden_size")?.unwrap_or(2880);
    let n_heads = f.usize("num_attention_heads")?.unwrap_or(64);
    let n_kv_heads = f.usize("num_key_value_heads")?.unwrap_or(8);
    let head_dim = f.usize("head_dim")?.unwrap_or(64);
    if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 || head_dim % 2 != 0 {
        return Err(corrupt(format!(
            "config.json `num_attention_heads` ({n_heads}) must be a multiple of `num_key_value_heads` ({n_kv_heads}) and `head_dim` ({head_dim}) even"
        )));
    }
    let max_position = f.usize("max_position_embeddings")?.unwrap_or(131_072) as u32;
    let theta = f.f64("rope_theta")?.unwrap_or(150_000.0);
    // GptOssConfig's default when the key is absent (null means none).
    let released = serde_json::json!({
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": false, "original_max_position_embeddings": 4096
    });
    let scaling = f.get("rope_scaling").unwrap_or(&released);
    let rope = rope_from(theta, Some(scaling), "rope_scaling.", max_position)?;
    let window = f.usize("sliding_window")?.unwrap_or(128);
    let sliding = sliding_layers(f, n_layers)?
        .unwrap_or_else(|| (0..n_layers).map(|i| (i + 1) % 2 != 0).collect());
    let layers = sliding
        .into_iter()
        .map(|s| LayerKind {
            window: s.then_some(window),
            moe: true,
            ..LayerKind::ATTENTION
        })
        .collect();
    let intermediate = f.usize("intermediate_size")?.unwrap_or(2880);
    let moe = Moe {
        experts: f.usize("num_local_experts")?.unwrap_or(128),
        top_k: match f.usize("num_experts_per_tok")? {
            Some(k) => k,
            None => f.usize("experts_per_token")?.unwrap_or(4),
        },
        intermediate,
        // The softmax over the chosen experts' scores alone: the renormalised top-k.
        normalize: true,
        naming: MoeNaming::GptOss,
        shared: None,
        shared_gate: false,
        routing: Routing::Softmax,
    };
    check_top_k(&moe)?;
    let limit = f.f64("swiglu_limit")?.unwrap_or(7.0);
    if !(limit > 0.0 && limit.is_finite()) {
        return Err(corrupt(format!(
            "config.json `swiglu_limit` must be a positive number, got {limit}"
        )));
    }
    Ok(ModelConfig {
        architecture: Architecture::GptOss,
        class,
        hidden,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        intermediate,
        vocab: f.usize("vocab_size")?.unwrap_or(201_088),
        rms_eps: f.f64("rms_norm_eps")?.unwrap_or(1e-5) as f32,
        max_position,
        tie_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
        // GptOssConfig sets `attention_bias` whatever the file says.
        qkv_bias: true,
        o_bias: true,
        mlp_bias: false,
        qk_norm: false,
        norm_plus_one: false,
        sandwich_norms: false,
        activation: Activation::ClampedSwiglu {
            limit: limit as f32,
        },
        embed_scale: 1.0,
        residual_scale: 1.0,
        logit_divisor: 1.0,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        ropes: vec![rope],
        rotary_dim: head_dim,
        layers,
        mamba: None,
        moe: Some(moe),
        fp8: quant.fp8,
        mxfp4: quant.mxfp4,
        attn_sinks: true,
        bos_token,
        eos_tokens,
    })
}
