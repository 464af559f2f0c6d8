//! Native engine, load step 1: `config.json` into the hyper-parameters the forward pass runs.
//!
//! The architecture is the `architectures` class (`LlamaForCausalLM`, ...), the same key the node
//! and the operator match against the manifest. Every option this engine does not implement is a
//! clear `UNSUPPORTED` naming the field (an unknown `rope_scaling` type, a sliding window on a
//! family that has none here, ...): a model never runs with a detail silently ignored.

use gantry_engine_abi::{EngineError, Status};
use serde_json::{Map, Value};

/// The families this engine runs, one per `architectures` class it lists in its manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Family {
    /// The `architectures` classes, in the manifest's order.
    pub const CLASSES: [(&'static str, Family); 5] = [
        ("LlamaForCausalLM", Family::Llama),
        ("MistralForCausalLM", Family::Mistral),
        ("Qwen2ForCausalLM", Family::Qwen2),
        ("Qwen3ForCausalLM", Family::Qwen3),
        ("Gemma3ForCausalLM", Family::Gemma3),
    ];

    pub fn from_class(class: &str) -> Option<Family> {
        Self::CLASSES
            .iter()
            .find(|(c, _)| *c == class)
            .map(|(_, f)| *f)
    }
}

/// Position encoding frequencies for one kind of layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// `rope_scaling` (or transformers 5's `rope_parameters`), by `rope_type`.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1's piecewise frequency scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: frequencies interpolated between `beta_fast` and `beta_slow` rotations, and
    /// cos/sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
    },
}

impl Rope {
    /// The inverse frequency of each rotated pair (`head_dim / 2` of them) and the factor that
    /// multiplies cos and sin, as transformers' `ROPE_INIT_FUNCTIONS` compute them.
    pub fn inv_freq(&self, head_dim: usize) -> (Vec<f32>, f32) {
        let half = head_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| 1.0 / self.theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        match &self.scaling {
            RopeScaling::None => (base.iter().map(|&f| f as f32).collect(), 1.0),
            RopeScaling::Linear { factor } => {
                (base.iter().map(|&f| (f / factor) as f32).collect(), 1.0)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                let f = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .map(|f| f as f32)
                    .collect();
                (f, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
                attention_factor,
            } => {
                let dim = head_dim as f64;
                // The dimension whose wavelength fits `rot` rotations in the original context.
                let corr = |rot: f64| {
                    dim * (old / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * self.theta.ln())
                };
                let low = corr(*beta_fast).floor().max(0.0);
                let high = corr(*beta_slow).ceil().min(dim - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let f = base
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .map(|f| f as f32)
                    .collect();
                (f, *attention_factor as f32)
            }
        }
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
    pub family: Family,
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

fn unsupported(msg: impl Into<String>) -> EngineError {
    EngineError::new(Status::Unsupported, msg.into())
}

fn corrupt(msg: impl Into<String>) -> EngineError {
    EngineError::new(Status::ModelCorrupt, msg.into())
}

/// Typed access to one JSON object, with errors naming `config.json` and the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn name(&self, key: &str) -> String {
        format!("config.json `{}{key}`", self.prefix)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<Option<usize>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|n| *n > 0 && *n <= (1 << 31))
                .map(|n| Some(n as usize))
                .ok_or_else(|| {
                    corrupt(format!(
                        "{} must be a positive integer, got {v}",
                        self.name(key)
                    ))
                }),
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize, EngineError> {
        self.usize(key)?
            .ok_or_else(|| corrupt(format!("{} is missing", self.name(key))))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .map(Some)
                .ok_or_else(|| corrupt(format!("{} must be a number, got {v}", self.name(key)))),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(corrupt(format!(
                "{} must be true or false, got {v}",
                self.name(key)
            ))),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(corrupt(format!(
                "{} must be a string, got {v}",
                self.name(key)
            ))),
        }
    }

    /// A token id or a list of them (`eos_token_id` is either).
    fn token_ids(&self, key: &str) -> Result<Vec<i32>, EngineError> {
        let one = |v: &Value| {
            v.as_i64()
                .and_then(|n| i32::try_from(n).ok())
                .filter(|n| *n >= 0)
                .ok_or_else(|| corrupt(format!("{} must hold token ids, got {v}", self.name(key))))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}

/// Parse a `rope_scaling`-style object (`rope_type` or the older `type`).
fn rope_scaling(f: &Fields<'_>, max_position: u32) -> Result<RopeScaling, EngineError> {
    let kind = match f.str("rope_type")? {
        Some(k) => k,
        None => f.str("type")?.unwrap_or("default"),
    };
    let factor = || {
        f.f64("factor")?
            .filter(|x| *x > 0.0)
            .ok_or_else(|| corrupt(format!("{} must be a positive number", f.name("factor"))))
    };
    let original = |default: f64| -> Result<f64, EngineError> {
        Ok(f.f64("original_max_position_embeddings")?
            .unwrap_or(default))
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: f.f64("low_freq_factor")?.unwrap_or(1.0),
            high_freq_factor: f.f64("high_freq_factor")?.unwrap_or(4.0),
            original_max_position_embeddings: original(8192.0)?,
        },
        "yarn" => {
            let factor = factor()?;
            let mscale = |s: f64| {
                if s <= 1.0 { 1.0 } else { 0.1 * s.ln() + 1.0 }
            };
            if f.get("mscale").is_some() || f.get("mscale_all_dim").is_some() {
                return Err(unsupported(format!(
                    "{} (DeepSeek's YaRN variant) is not implemented by the native engine",
                    f.name("mscale")
                )));
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original(f64::from(max_position) / factor)?,
                beta_fast: f.f64("beta_fast")?.unwrap_or(32.0),
                beta_slow: f.f64("beta_slow")?.unwrap_or(1.0),
                attention_factor: f.f64("attention_factor")?.unwrap_or_else(|| mscale(factor)),
            }
        }
        other => {
            return Err(unsupported(format!(
                "{} `{other}` is not implemented by the native engine (it runs default, linear, llama3 and yarn)",
                f.name("rope_type")
            )));
        }
    })
}

/// A `Rope` from a theta and an optional scaling object.
fn rope_from(
    theta: f64,
    scaling: Option<&Value>,
    prefix: &str,
    max_position: u32,
) -> Result<Rope, EngineError> {
    let scaling = match scaling {
        None | Some(Value::Null) => RopeScaling::None,
        Some(Value::Object(obj)) => rope_scaling(&Fields { obj, prefix }, max_position)?,
        Some(v) => {
            return Err(corrupt(format!(
                "config.json `{}` must be an object, got {v}",
                prefix.trim_end_matches('.')
            )));
        }
    };
    Ok(Rope { theta, scaling })
}

/// Parse `config.json` bytes (and the `eos_token_id` of `generation_config.json`, when given).
pub fn parse(bytes: &[u8], generation: Option<&[u8]>) -> Result<ModelConfig, EngineError> {
    let root: Value = serde_json::from_slice(bytes)
        .map_err(|e| corrupt(format!("config.json is not valid JSON: {e}")))?;
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
    let family = Family::from_class(&class).ok_or_else(|| {
        unsupported(format!(
            "config.json `architectures` names {class}; the native engine runs {}",
            Family::CLASSES
                .iter()
                .map(|(c, _)| *c)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    // Multimodal configs nest the language model; this engine runs text models only.
    let f = &top;
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
    let rms_eps = f
        .f64("rms_norm_eps")?
        .unwrap_or(if family == Family::Gemma3 { 1e-6 } else { 1e-5 }) as f32;
    let max_position = f.usize("max_position_embeddings")?.unwrap_or(4096) as u32;

    // transformers' defaults per family where config.json leaves the key out.
    let tie_default = matches!(family, Family::Gemma3);
    let tie_embeddings = f.bool("tie_word_embeddings")?.unwrap_or(tie_default);
    let attention_bias = f.bool("attention_bias")?;
    let (qkv_bias, o_bias) = match family {
        // Qwen2's q/k/v always carry a bias, o never does.
        Family::Qwen2 => (true, false),
        Family::Llama | Family::Qwen3 | Family::Gemma3 => {
            let b = attention_bias.unwrap_or(false);
            (b, b)
        }
        Family::Mistral => {
            if attention_bias == Some(true) {
                return Err(unsupported(
                    "config.json `attention_bias` = true is not a Mistral option",
                ));
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
        None if family == Family::Gemma3 => Activation::GeluTanh,
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
        Family::Gemma3 | Family::Qwen3 => 1_000_000.0,
        Family::Mistral | Family::Qwen2 => 1_000_000.0,
        Family::Llama => 10_000.0,
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

    let mut layers = vec![
        LayerKind {
            window: None,
            rope: 0
        };
        n_layers
    ];
    let window = f.usize("sliding_window")?;
    match family {
        Family::Gemma3 => {
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
            let types: Vec<bool> = match f.get("layer_types") {
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
                        .collect::<Result<_, _>>()?
                }
                Some(v) => {
                    return Err(corrupt(format!(
                        "config.json `layer_types` must be a list, got {v}"
                    )));
                }
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
                    };
                }
            }
        }
        Family::Mistral => {
            if let Some(w) = window {
                layers.iter_mut().for_each(|l| l.window = Some(w));
            }
        }
        Family::Qwen2 | Family::Qwen3 => {
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
        Family::Llama => {}
    }

    let (embed_scale, attn_scale) = match family {
        Family::Gemma3 => {
            let scalar = f.f64("query_pre_attn_scalar")?.unwrap_or(head_dim as f64);
            ((hidden as f32).sqrt(), (1.0 / scalar.sqrt()) as f32)
        }
        _ => (1.0, 1.0 / (head_dim as f32).sqrt()),
    };
    let softcap = |key: &str| -> Result<Option<f32>, EngineError> {
        Ok(f.f64(key)?.filter(|c| *c > 0.0).map(|c| c as f32))
    };
    let (attn_softcap, final_softcap) = (
        softcap("attn_logit_softcapping")?,
        softcap("final_logit_softcapping")?,
    );
    if family != Family::Gemma3 && (attn_softcap.is_some() || final_softcap.is_some()) {
        return Err(unsupported(format!(
            "config.json soft-capping is a Gemma option, not one of {class}"
        )));
    }

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

    Ok(ModelConfig {
        family,
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
        qk_norm: matches!(family, Family::Qwen3 | Family::Gemma3),
        norm_plus_one: family == Family::Gemma3,
        sandwich_norms: family == Family::Gemma3,
        activation,
        embed_scale,
        attn_scale,
        attn_softcap,
        final_softcap,
        ropes,
        layers,
        bos_token,
        eos_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Result<ModelConfig, EngineError> {
        let text = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "vocab_size": 100 {extra}}}"#
        );
        parse(text.as_bytes(), None)
    }

    #[test]
    fn a_llama_config_gets_transformers_defaults() {
        let c = cfg("").expect("config");
        assert_eq!(c.family, Family::Llama);
        assert_eq!(c.head_dim, 16);
        assert!(!c.tie_embeddings);
        assert_eq!(c.ropes[0].theta, 10_000.0);
        assert!((c.attn_scale - 0.25).abs() < 1e-7);
    }

    #[test]
    fn unknown_classes_and_rope_types_are_refused_by_name() {
        let e = parse(br#"{"architectures": ["MambaForCausalLM"]}"#, None).expect_err("mamba");
        assert_eq!(e.status, Status::Unsupported);
        assert!(e.message.contains("MambaForCausalLM"), "{}", e.message);
        let e = cfg(r#", "rope_scaling": {"rope_type": "longrope", "factor": 2}"#).expect_err("x");
        assert_eq!(e.status, Status::Unsupported);
        assert!(
            e.message.contains("rope_scaling.rope_type` `longrope`"),
            "{}",
            e.message
        );
        let e = cfg(r#", "hidden_act": "relu2""#).expect_err("act");
        assert!(e.message.contains("hidden_act"), "{}", e.message);
    }

    #[test]
    fn missing_and_mistyped_fields_are_named() {
        let e = parse(
            br#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}"#,
            None,
        )
        .expect_err("no layers");
        assert_eq!(e.status, Status::ModelCorrupt);
        assert!(e.message.contains("num_hidden_layers"), "{}", e.message);
        let e = cfg(r#", "rms_norm_eps": "small""#).expect_err("eps");
        assert!(e.message.contains("rms_norm_eps"), "{}", e.message);
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let c = cfg(
            r#", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        )
        .expect("config");
        let plain = Rope {
            theta: 500000.0,
            scaling: RopeScaling::None,
        };
        let (scaled, _) = c.ropes[0].inv_freq(16);
        let (base, _) = plain.inv_freq(16);
        assert_eq!(scaled[0], base[0]);
        assert!((scaled[7] - base[7] / 8.0).abs() < 1e-12);
    }

    #[test]
    fn gemma3_layers_alternate_windows_and_bases() {
        let text = br#"{"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "intermediate_size": 128, "vocab_size": 100, "sliding_window": 8,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32}"#;
        let c = parse(text, None).expect("gemma");
        assert_eq!(c.layers[0].window, Some(8));
        assert_eq!(c.layers[0].rope, 1);
        assert_eq!(c.layers[5].window, None);
        assert_eq!(c.layers[5].rope, 0);
        assert_eq!(c.ropes[1].theta, 10_000.0);
        assert!(c.tie_embeddings && c.norm_plus_one && c.qk_norm);
        assert_eq!(c.activation, Activation::GeluTanh);
    }
}
