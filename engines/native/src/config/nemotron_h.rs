//! Native engine, load step 1 for Nemotron-H (called by [`super::parse()`] once the class is
//! known): `NemotronHConfig`'s fields, with transformers' defaults, into a [`ModelConfig`].
//!
//! A Nemotron-H layer is one block, a norm and one mixer: `M` a Mamba-2 scan, `*` attention
//! (no position encoding), `-` a relu² MLP, `E` a mixture of relu² experts with DeepSeek-V3's
//! sigmoid routing and a shared expert. The pattern comes as `layers_block_type` (transformers
//! 5: `linear_attention`, `full_attention`, `mlp`, `moe`) or as the Hub's
//! `hybrid_override_pattern` string; its length is the layer count. Options this engine does
//! not run (latent expert projections, activations other than the released ones) are refused
//! by name; the multi-token-prediction layers (`num_nextn_predict_layers`) are not read, as in
//! transformers.

use gantry_engine_abi::EngineError;
use serde_json::Value;

use super::fields::{Fields, corrupt, unsupported};
use super::{
    Activation, Architecture, LayerKind, Mamba2, ModelConfig, Moe, MoeNaming, Rope, RopeScaling,
    Routing,
};
use crate::weights::Fp8;

/// One layer's block type.
fn block(kind: &str, at: &str) -> Result<LayerKind, EngineError> {
    let base = LayerKind {
        mixer: false,
        mlp: false,
        ..LayerKind::ATTENTION
    };
    Ok(match kind {
        "linear_attention" | "mamba" | "M" => LayerKind {
            mixer: true,
            mamba: true,
            ..base
        },
        "full_attention" | "attention" | "*" => LayerKind {
            mixer: true,
            ..base
        },
        "mlp" | "-" => LayerKind { mlp: true, ..base },
        "moe" | "E" => LayerKind {
            mlp: true,
            moe: true,
            ..base
        },
        other => {
            return Err(unsupported(format!(
                "config.json {at} `{other}` is not a Nemotron-H block (linear_attention, full_attention, mlp, moe)"
            )));
        }
    })
}

/// The layer pattern, from `layers_block_type` or `hybrid_override_pattern`.
fn layers(f: &Fields<'_>) -> Result<Vec<LayerKind>, EngineError> {
    let layers: Vec<LayerKind> = match (
        f.get("layers_block_type"),
        f.get("hybrid_override_pattern"),
    ) {
        (Some(Value::Array(items)), _) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let at = format!("`layers_block_type[{i}]`");
                block(v.as_str().unwrap_or("(not a string)"), &at)
            })
            .collect::<Result<_, _>>()?,
        (Some(v), _) => {
            return Err(corrupt(format!(
                "config.json `layers_block_type` must be a list, got {v}"
            )));
        }
        (None, Some(Value::String(p))) => p
            .chars()
            .enumerate()
            .map(|(i, c)| block(&c.to_string(), &format!("`hybrid_override_pattern[{i}]`")))
            .collect::<Result<_, _>>()?,
        (None, Some(v)) => {
            return Err(corrupt(format!(
                "config.json `hybrid_override_pattern` must be a string, got {v}"
            )));
        }
        (None, None) => {
            return Err(corrupt(
                "config.json has neither `layers_block_type` nor `hybrid_override_pattern` (Nemotron-H's layer pattern)",
            ));
        }
    };
    if layers.is_empty() {
        return Err(corrupt("config.json Nemotron-H layer pattern is empty"));
    }
    if let Some(n) = f.usize("num_hidden_layers")?
        && n != layers.len()
    {
        return Err(corrupt(format!(
            "config.json `num_hidden_layers` ({n}) differs from the layer pattern's length ({})",
            layers.len()
        )));
    }
    Ok(layers)
}

/// The first of `keys` the config has (transformers 5 renamed some of Nemotron-H's keys; the
/// Hub's files use the old names).
fn first_usize(f: &Fields<'_>, keys: &[&str], default: usize) -> Result<usize, EngineError> {
    for k in keys {
        if let Some(v) = f.usize(k)? {
            return Ok(v);
        }
    }
    Ok(default)
}

/// `time_step_limit` (or `mamba_dt_limit`): two numbers, `Infinity` written as Python writes
/// it (bare, which the parser turned into a string) or as transformers 5 does
/// (`{"__float__": "Infinity"}`).
fn dt_limit(f: &Fields<'_>) -> Result<(f32, f32), EngineError> {
    let key = if f.get("time_step_limit").is_some() {
        "time_step_limit"
    } else {
        "mamba_dt_limit"
    };
    let number = |v: &Value| -> Option<f32> {
        let text = match v {
            Value::Number(n) => return n.as_f64().map(|x| x as f32),
            Value::String(s) => s.as_str(),
            Value::Object(o) => o.get("__float__")?.as_str()?,
            _ => return None,
        };
        match text {
            "Infinity" | "inf" => Some(f32::INFINITY),
            _ => None,
        }
    };
    match f.get(key) {
        None => Ok((0.0, f32::INFINITY)),
        Some(Value::Array(a)) if a.len() == 2 => match (number(&a[0]), number(&a[1])) {
            (Some(lo), Some(hi)) if lo >= 0.0 && hi > lo => Ok((lo, hi)),
            _ => Err(corrupt(format!(
                "config.json `{key}` must be two numbers, 0 ≤ low < high, got {}",
                Value::Array(a.clone())
            ))),
        },
        Some(v) => Err(corrupt(format!(
            "config.json `{key}` must be a list of two numbers, got {v}"
        ))),
    }
}

pub(super) fn parse(
    f: &Fields<'_>,
    class: String,
    fp8: Option<Fp8>,
    bos_token: Option<i32>,
    eos_tokens: Vec<i32>,
) -> Result<ModelConfig, EngineError> {
    let layers = layers(f)?;
    let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
    let hidden = f.req_usize("hidden_size")?;
    let n_heads = f.usize("num_attention_heads")?.unwrap_or(32);
    let n_kv_heads = f.usize("num_key_value_heads")?.unwrap_or(n_heads);
    let head_dim = f.usize("head_dim")?.unwrap_or(128);
    if !n_heads.is_multiple_of(n_kv_heads) {
        return Err(corrupt(format!(
            "config.json `num_attention_heads` ({n_heads}) is not a multiple of `num_key_value_heads` ({n_kv_heads})"
        )));
    }
    for (key, want) in [("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")] {
        if let Some(got) = f.str(key)?
            && got != want
        {
            return Err(unsupported(format!(
                "config.json `{key}` `{got}`: the native engine runs Nemotron-H with {want}"
            )));
        }
    }
    if f.get("moe_latent_size").is_some() {
        return Err(unsupported(
            "config.json `moe_latent_size`: latent expert projections are not implemented by the native engine",
        ));
    }
    let groups = first_usize(f, &["n_groups", "mamba_n_groups"], 8)?;
    let m = Mamba2 {
        heads: f.usize("mamba_num_heads")?.unwrap_or(128),
        head_dim: f.usize("mamba_head_dim")?.unwrap_or(64),
        state: f.usize("ssm_state_size")?.unwrap_or(128),
        groups,
        conv_kernel: first_usize(f, &["conv_kernel", "mamba_d_conv"], 4)?,
        conv_bias: match f.bool("use_conv_bias")? {
            Some(b) => b,
            None => f.bool("mamba_conv_bias")?.unwrap_or(true),
        },
        proj_bias: f.bool("use_bias")?.unwrap_or(false),
        // The gated norm normalises each group of the scan's output apart.
        norm_groups: groups,
        dt_limit: dt_limit(f)?,
    };
    if m.conv_kernel < 2 || !m.heads.is_multiple_of(m.groups) || !m.inner().is_multiple_of(m.groups)
    {
        return Err(corrupt(format!(
            "config.json Mamba-2 shape: `conv_kernel` ({}) must be at least 2 and `mamba_num_heads` ({}) a multiple of `n_groups` ({})",
            m.conv_kernel, m.heads, m.groups
        )));
    }
    let has_moe = layers.iter().any(|l| l.moe);
    let moe = if has_moe {
        let experts = first_usize(f, &["n_routed_experts", "num_local_experts"], 8)?;
        let groups = f.usize("n_group")?.unwrap_or(1);
        let topk_groups = f.usize("topk_group")?.unwrap_or(1);
        if !experts.is_multiple_of(groups)
            || topk_groups > groups
            || (groups > 1 && experts / groups < 2)
        {
            return Err(corrupt(format!(
                "config.json `n_group` ({groups}) must divide `n_routed_experts` ({experts}) into groups of at least two, and `topk_group` ({topk_groups}) be at most `n_group`"
            )));
        }
        let moe = Moe {
            experts,
            top_k: f.usize("num_experts_per_tok")?.unwrap_or(2),
            intermediate: f.usize("moe_intermediate_size")?.unwrap_or(7688),
            normalize: f.bool("norm_topk_prob")?.unwrap_or(true),
            naming: MoeNaming::NemotronH,
            shared: Some(
                f.usize("moe_shared_expert_intermediate_size")?
                    .unwrap_or(7688),
            ),
            shared_gate: false,
            routing: Routing::Sigmoid {
                groups,
                topk_groups,
                scale: f.f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
            },
        };
        super::parse::check_top_k(&moe)?;
        Some(moe)
    } else {
        None
    };
    let mamba = layers.iter().any(|l| l.mamba).then_some(m);
    Ok(ModelConfig {
        architecture: Architecture::NemotronH,
        class,
        hidden,
        n_layers: layers.len(),
        n_heads,
        n_kv_heads,
        head_dim,
        intermediate: f.usize("intermediate_size")?.unwrap_or(21504),
        vocab: f.usize("vocab_size")?.unwrap_or(131072),
        rms_eps: f.f64("layer_norm_epsilon")?.unwrap_or(1e-5) as f32,
        max_position: f.usize("max_position_embeddings")?.unwrap_or(4096) as u32,
        tie_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
        qkv_bias: attention_bias,
        o_bias: attention_bias,
        mlp_bias: f.bool("mlp_bias")?.unwrap_or(false),
        qk_norm: false,
        norm_plus_one: false,
        sandwich_norms: false,
        activation: Activation::Relu2,
        embed_scale: 1.0,
        residual_scale: 1.0,
        logit_divisor: 1.0,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        // No position encoding: attention layers rotate nothing.
        ropes: vec![Rope {
            theta: 10_000.0,
            scaling: RopeScaling::None,
        }],
        rotary_dim: 0,
        layers,
        mamba,
        moe,
        fp8,
        mxfp4: false,
        attn_sinks: false,
        bos_token,
        eos_tokens,
    })
}
