//! Native engine, load step 2 for Nemotron-H (called by [`crate::backend::load_stack`]): the
//! checkpoint's tensors, by the names the Hub's Nemotron-H files use (`backbone.`), into the
//! backend's layers.
//!
//! Each layer `backbone.layers.{i}` is a norm (`norm.weight`) and one mixer under `mixer.`: the
//! Mamba-2 tensors, `q/k/v/o_proj`, an MLP's `up_proj`/`down_proj`, or a mixture of experts
//! (`gate.weight` and `gate.e_score_correction_bias`, `experts.{e}.{up,down}_proj`,
//! `shared_experts.{up,down}_proj`). A block with a mixer becomes a layer without an MLP, a
//! block with an MLP one without a mixer; the block's norm is the one in front of whichever it
//! has. ([`crate::backend::load_stack`] reads the final norm, `backbone.norm_f`, and the
//! output layer.)

use gantry_engine_abi::EngineError;

use crate::backend::{Attention, Ffn, Layer, Layers, Mixer, Mlp, TensorLoader, load_mamba};
use crate::config::ModelConfig;
use crate::weights::Weights;

pub fn load_layers<T: TensorLoader>(
    cfg: &ModelConfig,
    weights: &Weights,
    t: &mut T,
) -> Result<Layers<T>, EngineError> {
    let (h, hd, nh, nkv, ff) = cfg.dims();
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for (i, kind) in cfg.layers.iter().enumerate() {
        let p = format!("backbone.layers.{i}");
        let x = format!("{p}.mixer");
        let mixer = match &cfg.mamba {
            Some(m) if kind.mamba => Mixer::Mamba(load_mamba(m, h, &x, t)?),
            _ if kind.mixer => Mixer::Attention(Attention {
                q: t.linear(&format!("{x}.q_proj"), nh * hd, h, cfg.qkv_bias)?,
                k: t.linear(&format!("{x}.k_proj"), nkv * hd, h, cfg.qkv_bias)?,
                v: t.linear(&format!("{x}.v_proj"), nkv * hd, h, cfg.qkv_bias)?,
                o: t.linear(&format!("{x}.o_proj"), h, nh * hd, cfg.o_bias)?,
                q_norm: None,
                k_norm: None,
                sinks: None,
            }),
            _ => Mixer::None,
        };
        let mlp = match &cfg.moe {
            Some(moe) if kind.moe => {
                let e = moe.experts;
                let bias_name = format!("{x}.gate.e_score_correction_bias");
                let bias = weights.expect(&bias_name, &[e])?;
                let experts = (0..e)
                    .map(|j| {
                        let [_, u, d] = moe.naming.expert(i, j);
                        Ok(Ffn {
                            gate: None,
                            up: t.linear(&u, moe.intermediate, h, cfg.mlp_bias)?,
                            down: t.linear(&d, h, moe.intermediate, cfg.mlp_bias)?,
                        })
                    })
                    .collect::<Result<_, EngineError>>()?;
                let shared = match moe.shared {
                    Some(sff) => {
                        let ([_, u, d], _) = moe.naming.shared(i);
                        Some((
                            Ffn {
                                gate: None,
                                up: t.linear(&u, sff, h, cfg.mlp_bias)?,
                                down: t.linear(&d, h, sff, cfg.mlp_bias)?,
                            },
                            None,
                        ))
                    }
                    None => None,
                };
                Mlp::Experts {
                    // In f32, as the model keeps it (`_keep_in_fp32_modules_strict`).
                    router: t.linear_f32(&moe.naming.router(i), e, h)?,
                    choice_bias: Some(weights.to_f32(bias)),
                    experts,
                    shared,
                    spec: moe.clone(),
                }
            }
            _ if kind.mlp => Mlp::Dense(Ffn {
                gate: None,
                up: t.linear(&format!("{x}.up_proj"), ff, h, cfg.mlp_bias)?,
                down: t.linear(&format!("{x}.down_proj"), h, ff, cfg.mlp_bias)?,
            }),
            _ => Mlp::None,
        };
        // The block's one norm, in front of its mixer or its MLP (the other slot is unused).
        let norm = format!("{p}.norm.weight");
        let (in_norm, ffn_norm) = (t.vec(&norm, h)?, t.vec(&norm, h)?);
        layers.push(Layer {
            in_norm,
            mixer,
            post_attn_norm: None,
            ffn_norm,
            post_ffn_norm: None,
            mlp,
        });
    }
    Ok(layers)
}
