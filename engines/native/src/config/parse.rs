//! Native engine, load step 1 (the model's first file read, before the weights): `config.json`
//! (and `generation_config.json`'s end tokens) into a checked [`ModelConfig`], with
//! transformers' per-family defaults where the file leaves a key out.

use gantry_engine_abi::EngineError;
use serde_json::Value;

use super::fields::{Fields, corrupt, unsupported};
use super::mamba::{mamba, rotary_dim};
use super::quant::quantization;
use super::rope::rope_from;
use super::{
    Activation, Architecture, LayerKind, ModelConfig, Moe, MoeNaming, Rope, RopeScaling, Routing,
};

/// Parse `config.json` bytes (and the `eos_token_id` of `generation_config.json`, when given).
pub fn parse(bytes: &[u8], generation: Option<&[u8]>) -> Result<ModelConfig, EngineError> {
    let root: Value = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        // Python's json writes infinite floats as bare `Infinity` (Nemotron-H's
        // `time_step_limit`), which JSON does not have.
        Err(e) => serde_json::from_slice(&quote_non_finite(bytes))
            .map_err(|_| corrupt(format!("config.json is not valid JSON: {e}")))?,
    };
    let Value::Object(obj) = &root else {
        return Err(corrupt("config.json must be a JSON object"));
    };
    let top = Fields { obj, prefix: "" };
    let class = match top.get("architectures") {
        Some(Value::Array(a)) => a
            .first()
            .and_then(Value::as_str)
            .ok_or_else(|| corrupt("config.json `architectures` must name a model class"))?,
        _ => return Err(corrupt("config.json has no `architectures` list")),
    }
    .to_string();
    let family = Architecture::from_class(&class).ok_or_else(|| {
        unsupported(format!(
            "config.json `architectures` names {class}; the native engine runs {}",
            Architecture::CLASSES
                .iter()
                .map(|(c, _)| *c)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    // Multimodal configs nest the language model; this engine runs text models only.
    let f = &top;
    let quant = quantization(f.get("quantization_config"), family)?;
    let (bos_token, eos_tokens) = end_tokens(&top, generation)?;
    match family {
        Architecture::NemotronH => {
            return super::nemotron_h::parse(f, class, quant.fp8, bos_token, eos_tokens);
        }
        Architecture::GptOss => {
            return super::gpt_oss::parse(f, class, quant, bos_token, eos_tokens);
        }
        _ => {}
    }
    let hidden = f.req_usize("hidden_size")?;
    let n_layers = f.req_usize("num_hidden_layers")?;
    let n_heads = f.req_usize("num_attention_heads")?;
    let n_kv_heads = f.usize("num_key_value_heads")?.unwrap_or(n_heads);
    let head_dim = match f.usize("head_dim")? {
        Some(d) => d,
        None => {
            if hidden % n_heads != 0 {
                return Err(corrupt(format!(
                    "config.json `hidden_size` ({hidden}) is not a multiple of `num_attention_heads` ({n_heads}) and there is no `head_dim`"
                )));
            }
            hidden / n_heads
        }
    };
    if n_heads % n_kv_heads != 0 {
        return Err(corrupt(format!(
            "config.json `num_attention_heads` ({n_heads}) is not a multiple of `num_key_value_heads` ({n_kv_heads})"
        )));
    }
    if head_dim % 2 != 0 {
        return Err(corrupt(format!(
            "config.json head dimension {head_dim} must be even (RoPE rotates pairs)"
        )));
    }
    let intermediate = f.req_usize("intermediate_size")?;
    let vocab = f.req_usize("vocab_size")?;
    let rms_eps = f.f64("rms_norm_eps")?.unwrap_or(
        if matches!(
            family,
            Architecture::Gemma3 | Architecture::GraniteMoeHybrid
        ) {
            1e-6
        } else {
            1e-5
        },
    ) as f32;
    let max_position = f.usize("max_position_embeddings")?.unwrap_or(4096) as u32;

    // transformers' defaults per family where config.json leaves the key out.
    let tie_default = matches!(family, Architecture::Gemma3);
    let tie_embeddings = f.bool("tie_word_embeddings")?.unwrap_or(tie_default);
    let attention_bias = f.bool("attention_bias")?;
    let (qkv_bias, o_bias) = match family {
        // Qwen2's q/k/v always carry a bias, o never does.
        Architecture::Qwen2 => (true, false),
        Architecture::Qwen2Moe => (f.bool("qkv_bias")?.unwrap_or(true), false),
        Architecture::Llama
        | Architecture::Qwen3
        | Architecture::Qwen3Moe
        | Architecture::Gemma3
        | Architecture::GraniteMoeHybrid
        | Architecture::NemotronH
        | Architecture::GptOss => {
            let b = attention_bias.unwrap_or(false);
            (b, b)
        }
        // BambaConfig sets `attention_bias` false whatever the file says.
        Architecture::Bamba => (false, false),
        Architecture::Mistral | Architecture::Mixtral => {
            if attention_bias == Some(true) {
                return Err(unsupported(format!(
                    "config.json `attention_bias` = true is not an option of {class}"
                )));
            }
            (false, false)
        }
    };
    let mlp_bias = f.bool("mlp_bias")?.unwrap_or(false);

    let act_key = if f.get("hidden_activation").is_some() {
        "hidden_activation"
    } else {
        "hidden_act"
    };
    let activation = match f.str(act_key)? {
        Some("silu") | Some("swish") => Activation::Silu,
        Some("gelu_pytorch_tanh") | Some("gelu_tanh") => Activation::GeluTanh,
        None if family == Architecture::Gemma3 => Activation::GeluTanh,
        None => Activation::Silu,
        Some(other) => {
            return Err(unsupported(format!(
                "config.json `{act_key}` `{other}` is not implemented by the native engine (silu, gelu_pytorch_tanh)"
            )));
        }
    };

    // Rotary embeddings: transformers 5 writes `rope_parameters`, older files `rope_theta` and
    // `rope_scaling`. Gemma 3's sliding layers have their own base and no scaling.
    let default_theta = match family {
        Architecture::Gemma3 | Architecture::Qwen3 => 1_000_000.0,
        Architecture::Mistral | Architecture::Mixtral | Architecture::Qwen2 => 1_000_000.0,
        Architecture::Llama
        | Architecture::Qwen3Moe
        | Architecture::Qwen2Moe
        | Architecture::Bamba
        | Architecture::GraniteMoeHybrid
        | Architecture::NemotronH
        | Architecture::GptOss => 10_000.0,
    };
    let mut ropes = Vec::new();
    let params = f.get("rope_parameters");
    let global = match params {
        Some(Value::Object(p)) if p.contains_key("full_attention") => {
            let full = p.get("full_attention");
            let inner = match full {
                Some(Value::Object(o)) => Fields {
                    obj: o,
                    prefix: "rope_parameters.full_attention.",
                },
                _ => {
                    return Err(corrupt(
                        "config.json `rope_parameters.full_attention` must be an object",
                    ));
                }
            };
            let theta = inner.f64("rope_theta")?.unwrap_or(default_theta);
            rope_from(theta, full, "rope_parameters.full_attention.", max_position)?
        }
        Some(Value::Object(p)) => {
            let inner = Fields {
                obj: p,
                prefix: "rope_parameters.",
            };
            let theta = inner.f64("rope_theta")?.unwrap_or(default_theta);
            rope_from(theta, params, "rope_parameters.", max_position)?
        }
        Some(v) => {
            return Err(corrupt(format!(
                "config.json `rope_parameters` must be an object, got {v}"
            )));
        }
        None => {
            let theta = f.f64("rope_theta")?.unwrap_or(default_theta);
            rope_from(theta, f.get("rope_scaling"), "rope_scaling.", max_position)?
        }
    };
    ropes.push(global);

    let mut layers = vec![LayerKind::ATTENTION; n_layers];
    let window = f.usize("sliding_window")?;
    match family {
        Architecture::Gemma3 => {
            let local_theta = match params {
                Some(Value::Object(p)) => match p.get("sliding_attention") {
                    Some(Value::Object(o)) => Fields {
                        obj: o,
                        prefix: "rope_parameters.sliding_attention.",
                    }
                    .f64("rope_theta")?,
                    _ => None,
                },
                _ => None,
            };
            let local_theta = match local_theta {
                Some(t) => t,
                None => f.f64("rope_local_base_freq")?.unwrap_or(10_000.0),
            };
            ropes.push(Rope {
                theta: local_theta,
                scaling: RopeScaling::None,
            });
            let window = window
                .ok_or_else(|| corrupt("config.json `sliding_window` is missing (Gemma 3)"))?;
            let types = match sliding_layers(f, n_layers)? {
                Some(types) => types,
                None => {
                    let pattern = f
                        .usize("sliding_window_pattern")?
                        .or(f.usize("_sliding_window_pattern")?)
                        .unwrap_or(6);
                    (0..n_layers).map(|i| (i + 1) % pattern != 0).collect()
                }
            };
            for (l, sliding) in layers.iter_mut().zip(types) {
                if sliding {
                    *l = LayerKind {
                        window: Some(window),
                        rope: 1,
                        ..LayerKind::ATTENTION
                    };
                }
            }
        }
        Architecture::Mistral | Architecture::Mixtral => {
            if let Some(w) = window {
                layers.iter_mut().for_each(|l| l.window = Some(w));
            }
        }
        Architecture::Qwen2
        | Architecture::Qwen3
        | Architecture::Qwen3Moe
        | Architecture::Qwen2Moe => {
            if f.bool("use_sliding_window")?.unwrap_or(false) {
                let w = window.ok_or_else(|| {
                    corrupt("config.json `use_sliding_window` is true without `sliding_window`")
                })?;
                // transformers: layers from `max_window_layers` on use the window.
                let from = f.usize("max_window_layers")?.unwrap_or(n_layers);
                for l in layers.iter_mut().skip(from) {
                    l.window = Some(w);
                }
            }
        }
        Architecture::Llama
        | Architecture::Bamba
        | Architecture::GraniteMoeHybrid
        | Architecture::NemotronH
        | Architecture::GptOss => {}
    }

    let moe = moe(f, family, &mut layers)?;
    let mamba = mamba(f, family, hidden, &mut layers)?;
    let rotary_dim = rotary_dim(f, family, head_dim)?;

    let (embed_scale, attn_scale) = match family {
        Architecture::Gemma3 => {
            let scalar = f.f64("query_pre_attn_scalar")?.unwrap_or(head_dim as f64);
            ((hidden as f32).sqrt(), (1.0 / scalar.sqrt()) as f32)
        }
        // Granite's µP multipliers (GraniteMoeHybridConfig defaults: 1).
        Architecture::GraniteMoeHybrid => (
            f.f64("embedding_multiplier")?.unwrap_or(1.0) as f32,
            f.f64("attention_multiplier")?.unwrap_or(1.0) as f32,
        ),
        _ => (1.0, 1.0 / (head_dim as f32).sqrt()),
    };
    let (residual_scale, logit_divisor) = match family {
        Architecture::GraniteMoeHybrid => {
            let divisor = f.f64("logits_scaling")?.unwrap_or(1.0);
            if divisor == 0.0 {
                return Err(corrupt("config.json `logits_scaling` must not be 0"));
            }
            (
                f.f64("residual_multiplier")?.unwrap_or(1.0) as f32,
                divisor as f32,
            )
        }
        _ => (1.0, 1.0),
    };
    // Granite 4.0-H's dense MLP is its shared MLP.
    let intermediate = match (family, &moe) {
        (Architecture::GraniteMoeHybrid, None) => {
            f.usize("shared_intermediate_size")?.unwrap_or(1024)
        }
        _ => intermediate,
    };
    let softcap = |key: &str| -> Result<Option<f32>, EngineError> {
        Ok(f.f64(key)?.filter(|c| *c > 0.0).map(|c| c as f32))
    };
    let (attn_softcap, final_softcap) = (
        softcap("attn_logit_softcapping")?,
        softcap("final_logit_softcapping")?,
    );
    if family != Architecture::Gemma3 && (attn_softcap.is_some() || final_softcap.is_some()) {
        return Err(unsupported(format!(
            "config.json soft-capping is a Gemma option, not one of {class}"
        )));
    }

    Ok(ModelConfig {
        architecture: family,
        class,
        hidden,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        intermediate,
        vocab,
        rms_eps,
        max_position,
        tie_embeddings,
        qkv_bias,
        o_bias,
        mlp_bias,
        qk_norm: matches!(
            family,
            Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
        ),
        norm_plus_one: family == Architecture::Gemma3,
        sandwich_norms: family == Architecture::Gemma3,
        activation,
        embed_scale,
        residual_scale,
        logit_divisor,
        attn_scale,
        attn_softcap,
        final_softcap,
        ropes,
        rotary_dim,
        layers,
        moe,
        mamba,
        fp8: quant.fp8,
        mxfp4: false,
        attn_sinks: false,
        bos_token,
        eos_tokens,
    })
}

/// The first `bos_token_id` and the end tokens: `generation_config.json`'s `eos_token_id`
/// where it has one (what transformers generates with), else config.json's.
pub(super) fn end_tokens(
    top: &Fields<'_>,
    generation: Option<&[u8]>,
) -> Result<(Option<i32>, Vec<i32>), EngineError> {
    let mut eos_tokens = top.token_ids("eos_token_id")?;
    if let Some(g) = generation {
        // generation_config.json overrides config.json: it is what transformers generates with.
        if let Ok(Value::Object(gobj)) = serde_json::from_slice::<Value>(g) {
            let gf = Fields {
                obj: &gobj,
                prefix: "",
            };
            let ids = gf
                .token_ids("eos_token_id")
                .map_err(|e| corrupt(e.message.replace("config.json", "generation_config.json")))?;
            if !ids.is_empty() {
                eos_tokens = ids;
            }
        }
    }
    let bos_token = top.token_ids("bos_token_id")?.first().copied();
    Ok((bos_token, eos_tokens))
}

/// `config.json` with Python's non-finite literals (`Infinity`, `-Infinity`, `NaN`) outside
/// strings turned into the strings `"Infinity"`, `"-Infinity"`, `"NaN"`, so serde_json reads
/// it (it has no option for them) and the field that holds one decides what it means.
fn quote_non_finite(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 16);
    let (mut in_string, mut escaped, mut i) = (false, false, 0);
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            out.push(b);
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        if b == b'"' {
            in_string = true;
        }
        let word = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|w| bytes[i..].starts_with(w.as_bytes()));
        if let Some(w) = word {
            out.push(b'"');
            out.extend_from_slice(w.as_bytes());
            out.push(b'"');
            i += w.len();
        } else {
            out.push(b);
            i += 1;
        }
    }
    out
}

/// The mixture of experts of a MoE family, and which layers run it (the others keep the dense
/// MLP of `intermediate_size`); `None` for dense families.
fn moe(
    f: &Fields<'_>,
    family: Architecture,
    layers: &mut [LayerKind],
) -> Result<Option<Moe>, EngineError> {
    let n_layers = layers.len();
    let (moe, sparse): (Moe, Vec<bool>) = match family {
        Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
            // transformers' Qwen3MoeConfig / Qwen2MoeConfig defaults.
            let qwen2 = family == Architecture::Qwen2Moe;
            let experts = f
                .usize("num_experts")?
                .unwrap_or(if qwen2 { 60 } else { 128 });
            let step = f.usize("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(corrupt(
                    "config.json `decoder_sparse_step` must be at least 1",
                ));
            }
            let dense: Vec<usize> = match f.get("mlp_only_layers") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| {
                        v.as_u64().map(|i| i as usize).ok_or_else(|| {
                            corrupt(format!(
                                "config.json `mlp_only_layers` must list layer indices, got {v}"
                            ))
                        })
                    })
                    .collect::<Result<_, _>>()?,
                Some(v) => {
                    return Err(corrupt(format!(
                        "config.json `mlp_only_layers` must be a list, got {v}"
                    )));
                }
            };
            let moe = Moe {
                experts,
                top_k: f
                    .usize("num_experts_per_tok")?
                    .unwrap_or(if qwen2 { 4 } else { 8 }),
                intermediate: f.usize("moe_intermediate_size")?.unwrap_or(if qwen2 {
                    1408
                } else {
                    768
                }),
                normalize: f.bool("norm_topk_prob")?.unwrap_or(false),
                naming: MoeNaming::Qwen,
                shared: if qwen2 {
                    Some(f.usize("shared_expert_intermediate_size")?.unwrap_or(5632))
                } else {
                    None
                },
                shared_gate: qwen2,
                routing: Routing::Softmax,
            };
            let sparse = (0..n_layers)
                .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                .collect();
            (moe, sparse)
        }
        Architecture::Mixtral => {
            let moe = Moe {
                experts: f.usize("num_local_experts")?.unwrap_or(8),
                top_k: f.usize("num_experts_per_tok")?.unwrap_or(2),
                intermediate: f.req_usize("intermediate_size")?,
                normalize: true,
                naming: MoeNaming::Mixtral,
                shared: None,
                shared_gate: false,
                routing: Routing::Softmax,
            };
            (moe, vec![true; n_layers])
        }
        Architecture::GraniteMoeHybrid => {
            // No experts (Granite 4.0-H Micro): every layer runs the shared MLP alone.
            if f.get("num_local_experts").and_then(Value::as_u64) == Some(0) {
                return Ok(None);
            }
            let experts = f.usize("num_local_experts")?.unwrap_or(8);
            // Softmax over the top-k router logits: the full softmax renormalised over them.
            let moe = Moe {
                experts,
                top_k: f.usize("num_experts_per_tok")?.unwrap_or(2),
                intermediate: f.req_usize("intermediate_size")?,
                normalize: true,
                naming: MoeNaming::Granite,
                shared: Some(f.usize("shared_intermediate_size")?.unwrap_or(1024)),
                shared_gate: false,
                routing: Routing::Softmax,
            };
            (moe, vec![true; n_layers])
        }
        _ => return Ok(None),
    };
    check_top_k(&moe)?;
    for (l, s) in layers.iter_mut().zip(sparse) {
        l.moe = s;
    }
    Ok(Some(moe))
}

/// `layer_types` (`sliding_attention` or `full_attention`, one per layer) as whether each
/// layer slides; `None` when the config has no list.
pub(super) fn sliding_layers(
    f: &Fields<'_>,
    n_layers: usize,
) -> Result<Option<Vec<bool>>, EngineError> {
    match f.get("layer_types") {
        None => Ok(None),
        Some(Value::Array(items)) => {
            if items.len() != n_layers {
                return Err(corrupt(format!(
                    "config.json `layer_types` lists {} layers, `num_hidden_layers` is {n_layers}",
                    items.len()
                )));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(unsupported(format!(
                        "config.json `layer_types[{i}]` {v} is not sliding_attention or full_attention"
                    ))),
                })
                .collect::<Result<_, _>>()
                .map(Some)
        }
        Some(v) => Err(corrupt(format!(
            "config.json `layer_types` must be a list, got {v}"
        ))),
    }
}

/// `num_experts_per_tok` within 1..=experts, for every mixture-of-experts family.
pub(super) fn check_top_k(moe: &Moe) -> Result<(), EngineError> {
    if moe.top_k == 0 || moe.top_k > moe.experts {
        return Err(corrupt(format!(
            "config.json `num_experts_per_tok` ({}) must be between 1 and the number of experts ({})",
            moe.top_k, moe.experts
        )));
    }
    Ok(())
}
