//! Native engine, load step 1 (state-space families, read by [`super::parse()`]): which layers
//! of a hybrid model are Mamba-2 mixers and their shapes ([`Mamba2`]), and how much of each
//! attention head RoPE rotates (`partial_rotary_factor`), with transformers' per-family
//! defaults.

use gantry_engine_abi::EngineError;
use serde_json::Value;

use super::fields::{Fields, corrupt};
use super::{Architecture, LayerKind, Mamba2};

/// The Mamba-2 mixer of a hybrid family, and which layers run it (the others attend); `None`
/// for attention-only families.
pub(super) fn mamba(
    f: &Fields<'_>,
    family: Architecture,
    hidden: usize,
    layers: &mut [LayerKind],
) -> Result<Option<Mamba2>, EngineError> {
    if !matches!(family, Architecture::Bamba | Architecture::GraniteMoeHybrid) {
        return Ok(None);
    }
    let n_layers = layers.len();
    // BambaConfig's defaults.
    let heads = f.usize("mamba_n_heads")?.unwrap_or(128);
    let expand = f.usize("mamba_expand")?.unwrap_or(2);
    let inner = expand * hidden;
    let head_dim = match f.get("mamba_d_head") {
        None | Some(Value::Null) => inner / heads.max(1),
        Some(Value::String(s)) if s == "auto" => inner / heads.max(1),
        Some(_) => f.req_usize("mamba_d_head")?,
    };
    let m = Mamba2 {
        heads,
        head_dim,
        state: f.usize("mamba_d_state")?.unwrap_or(256),
        groups: f.usize("mamba_n_groups")?.unwrap_or(1),
        conv_kernel: f.usize("mamba_d_conv")?.unwrap_or(4),
        conv_bias: f.bool("mamba_conv_bias")?.unwrap_or(true),
        proj_bias: f.bool("mamba_proj_bias")?.unwrap_or(false),
        norm_groups: 1,
        dt_limit: (0.0, f32::INFINITY),
    };
    if m.heads == 0 || m.head_dim == 0 || m.state == 0 || m.groups == 0 || m.conv_kernel < 2 {
        return Err(corrupt(
            "config.json `mamba_n_heads`, `mamba_d_head`, `mamba_d_state`, `mamba_n_groups` must be positive and `mamba_d_conv` at least 2",
        ));
    }
    if m.inner() != inner {
        return Err(corrupt(format!(
            "config.json `mamba_n_heads` × `mamba_d_head` ({} × {}) must be `mamba_expand` × `hidden_size` ({inner})",
            m.heads, m.head_dim
        )));
    }
    if !m.heads.is_multiple_of(m.groups) {
        return Err(corrupt(format!(
            "config.json `mamba_n_heads` ({}) is not a multiple of `mamba_n_groups` ({})",
            m.heads, m.groups
        )));
    }
    if family == Architecture::GraniteMoeHybrid {
        // `layer_types`: "mamba" or "attention" per layer (all Mamba when absent).
        match f.get("layer_types") {
            None | Some(Value::Null) => layers.iter_mut().for_each(|l| l.mamba = true),
            Some(Value::Array(items)) if items.len() == n_layers => {
                for (i, (l, v)) in layers.iter_mut().zip(items).enumerate() {
                    l.mamba = match v.as_str() {
                        Some("mamba") => true,
                        Some("attention") => false,
                        _ => {
                            return Err(corrupt(format!(
                                "config.json `layer_types[{i}]` {v} is not mamba or attention"
                            )));
                        }
                    };
                }
            }
            Some(v) => {
                return Err(corrupt(format!(
                    "config.json `layer_types` must list {n_layers} layer types, got {v}"
                )));
            }
        }
        return Ok(Some(m));
    }
    let attention: Vec<usize> = match f.get("attn_layer_indices") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|i| i as usize)
                    .filter(|&i| i < n_layers)
                    .ok_or_else(|| {
                        corrupt(format!(
                            "config.json `attn_layer_indices` must list layer indices below {n_layers}, got {v}"
                        ))
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(corrupt(format!(
                "config.json `attn_layer_indices` must be a list, got {v}"
            )));
        }
    };
    for (i, l) in layers.iter_mut().enumerate() {
        l.mamba = !attention.contains(&i);
    }
    Ok(Some(m))
}

/// How many dimensions of each head RoPE rotates: `partial_rotary_factor` × `head_dim` (Bamba
/// defaults to half), none for Granite 4.0-H unless `position_embedding_type` is `rope`, the
/// whole head elsewhere.
pub(super) fn rotary_dim(
    f: &Fields<'_>,
    family: Architecture,
    head_dim: usize,
) -> Result<usize, EngineError> {
    if family == Architecture::GraniteMoeHybrid {
        return match f.str("position_embedding_type")? {
            Some("rope") => Ok(head_dim),
            None | Some("nope") => Ok(0),
            Some(other) => Err(super::fields::unsupported(format!(
                "config.json `position_embedding_type` `{other}`: GraniteMoeHybridForCausalLM takes rope or nope"
            ))),
        };
    }
    let default = if family == Architecture::Bamba {
        0.5
    } else {
        1.0
    };
    let factor = match family {
        Architecture::Bamba => f.f64("partial_rotary_factor")?.unwrap_or(default),
        _ => default,
    };
    // transformers: int(head_dim * factor).
    let dim = (head_dim as f64 * factor) as usize;
    if dim == 0 || dim > head_dim || !dim.is_multiple_of(2) {
        return Err(corrupt(format!(
            "config.json `partial_rotary_factor` {factor} gives {dim} rotary dimensions of {head_dim}: it must give an even number, at least 2"
        )));
    }
    Ok(dim)
}
