//! Native engine, load step 1 (rotary position embeddings, read by [`super::parse()`] and used by
//! every attention layer of the forward pass): `rope_theta` with `rope_scaling` (or transformers
//! 5's `rope_parameters`) into a [`Rope`], and its per-pair inverse frequencies as
//! transformers' `ROPE_INIT_FUNCTIONS` compute them. A `rope_type` this engine does not
//! implement is `UNSUPPORTED`, by name.

use gantry_engine_abi::EngineError;
use serde_json::Value;

use super::fields::{Fields, corrupt, unsupported};

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
        /// The ramp's ends rounded out to whole dimensions (`truncate`, true unless the config
        /// says false: gpt-oss).
        truncate: bool,
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
                truncate,
            } => {
                let dim = head_dim as f64;
                // The dimension whose wavelength fits `rot` rotations in the original context.
                let corr = |rot: f64| {
                    dim * (old / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * self.theta.ln())
                };
                let (low, high) = match truncate {
                    true => (corr(*beta_fast).floor(), corr(*beta_slow).ceil()),
                    false => (corr(*beta_fast), corr(*beta_slow)),
                };
                let (low, high) = (low.max(0.0), high.min(dim - 1.0));
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
                truncate: f.bool("truncate")?.unwrap_or(true),
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
pub(super) fn rope_from(
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
