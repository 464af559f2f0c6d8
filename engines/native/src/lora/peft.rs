//! Native engine, LoRA adapters, load: a PEFT directory (`adapter_config.json` and
//! `adapter_model.safetensors`) read into f32 pairs and checked against the base model's
//! shapes, before anything reaches the backend (`adapter_load`, ABI 1.6).
//!
//! Refusals, each naming what it refuses: an unreadable or damaged file is `ModelCorrupt`; an
//! adapter that does not fit the model (a tensor whose shape disagrees with the base's, a
//! module the model lacks, a layer past its last, a rank of 0) is `LoadFailed` with the tensor
//! and both shapes; a PEFT option this engine does not implement (`fan_in_fan_out`, biases,
//! DoRA, per-module rank or alpha patterns, `modules_to_save`) is `Unsupported`. Nothing read
//! here outlives a refusal.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gantry_engine_abi::{AdapterDescriptor, EngineError, Status};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::{LoraPair, LoraWeights, Target};
use crate::config::ModelConfig;
use crate::weights::{DType, to_f32};

/// The options of `adapter_config.json` the load uses.
struct PeftConfig {
    rank: usize,
    alpha: f32,
    rslora: bool,
    /// `target_modules` when it is a list (a string is a regular expression: the tensors
    /// alone say what is targeted then).
    targets: Option<Vec<String>>,
}

fn corrupt(desc: &AdapterDescriptor, msg: impl std::fmt::Display) -> EngineError {
    EngineError::new(
        Status::ModelCorrupt,
        format!("adapter {}: {msg}", desc.name),
    )
}

fn failed(desc: &AdapterDescriptor, msg: impl std::fmt::Display) -> EngineError {
    EngineError::new(Status::LoadFailed, format!("adapter {}: {msg}", desc.name))
}

fn unsupported(desc: &AdapterDescriptor, msg: impl std::fmt::Display) -> EngineError {
    EngineError::unsupported(format!("adapter {}: {msg}", desc.name))
}

/// The PEFT directory of `desc.path` (a path to one of its files names its directory).
fn directory(path: &Path) -> PathBuf {
    if path.is_file() {
        path.parent().unwrap_or(Path::new(".")).to_path_buf()
    } else {
        path.to_path_buf()
    }
}

fn parse_config(desc: &AdapterDescriptor, dir: &Path) -> Result<PeftConfig, EngineError> {
    let path = dir.join("adapter_config.json");
    let bytes = std::fs::read(&path)
        .map_err(|e| corrupt(desc, format!("cannot read {}: {e}", path.display())))?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| corrupt(desc, format!("{} is not JSON: {e}", path.display())))?;
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    if let Some(t) = field("peft_type").and_then(Value::as_str)
        && t != "LORA"
    {
        return Err(unsupported(
            desc,
            format!("peft_type is {t}; the native engine applies LORA adapters"),
        ));
    }
    let rank = field("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| corrupt(desc, "adapter_config.json has no integer `r`"))?;
    if rank == 0 {
        return Err(failed(desc, "adapter_config.json has a rank `r` of 0"));
    }
    // PEFT's default alpha when the field is absent.
    let alpha = match field("lora_alpha") {
        None => 8.0,
        Some(a) => a
            .as_f64()
            .ok_or_else(|| corrupt(desc, "adapter_config.json `lora_alpha` is not a number"))?
            as f32,
    };
    let flag = |k: &str| field(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("fan_in_fan_out") {
        return Err(unsupported(
            desc,
            "fan_in_fan_out is true (Conv1D-style [in, out] weights); the native engine applies adapters of nn.Linear weights",
        ));
    }
    if flag("use_dora") {
        return Err(unsupported(
            desc,
            "use_dora is true; DoRA is not implemented",
        ));
    }
    if let Some(b) = field("bias").and_then(Value::as_str)
        && b != "none"
    {
        return Err(unsupported(
            desc,
            format!(
                "bias is \"{b}\"; the native engine applies adapters without biases (\"none\")"
            ),
        ));
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if field(k)
            .and_then(Value::as_object)
            .is_some_and(|o| !o.is_empty())
        {
            return Err(unsupported(
                desc,
                format!("{k} is set; per-module ranks and alphas are not implemented"),
            ));
        }
    }
    if field("modules_to_save")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty())
    {
        return Err(unsupported(
            desc,
            "modules_to_save is set; the native engine applies low-rank updates only",
        ));
    }
    let targets = match field("target_modules") {
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|t| {
                    t.as_str().map(str::to_string).ok_or_else(|| {
                        corrupt(
                            desc,
                            "adapter_config.json `target_modules` holds a non-string",
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        _ => None,
    };
    Ok(PeftConfig {
        rank: rank as usize,
        alpha,
        rslora: flag("use_rslora"),
        targets,
    })
}

/// `base_model.model.model.layers.{i}.{parent}.{module}.lora_{A,B}.weight` into
/// `(i, parent.module, is_a)`; `None` for any other name.
fn parse_name(name: &str) -> Option<(usize, &str, bool)> {
    let rest = name
        .strip_prefix("base_model.model.")?
        .strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let (module, is_a) = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
        (m, true)
    } else {
        (rest.strip_suffix(".lora_B.weight")?, false)
    };
    Some((layer, module, is_a))
}

fn projections() -> String {
    Target::ALL.map(Target::name).join(", ")
}

/// Read and check the adapter of `desc` for a model of `cfg`.
pub fn read(desc: &AdapterDescriptor, cfg: &ModelConfig) -> Result<LoraWeights, EngineError> {
    if !desc.scale.is_finite() {
        return Err(failed(desc, format!("scale {} is not finite", desc.scale)));
    }
    let dir = directory(&desc.path);
    let pc = parse_config(desc, &dir)?;
    let path = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&path)
        .map_err(|e| corrupt(desc, format!("cannot read {}: {e}", path.display())))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        corrupt(
            desc,
            format!("{} is not a valid safetensors file: {e}", path.display()),
        )
    })?;
    let scale = desc.scale * pc.alpha
        / if pc.rslora {
            (pc.rank as f32).sqrt()
        } else {
            pc.rank as f32
        };
    let class = &cfg.class;
    // (layer, target) -> (A, B), in name order so a refusal names the first offender.
    let mut found: BTreeMap<(usize, usize), [Option<Vec<f32>>; 2]> = BTreeMap::new();
    let mut tensors: Vec<_> = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in tensors {
        let shape = view.shape().to_vec();
        let Some((layer, module, is_a)) = parse_name(&name) else {
            return Err(failed(
                desc,
                format!(
                    "tensor {name} {shape:?} is not the lora_A or lora_B weight of a decoder layer's projection (base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_<A|B>.weight)"
                ),
            ));
        };
        let target = module
            .split_once('.')
            .and_then(|(parent, m)| Target::from_name(m).filter(|t| t.parent() == parent))
            .ok_or_else(|| {
                failed(
                    desc,
                    format!(
                        "tensor {name} {shape:?} targets module {module}, which {class} does not have (its projections: {})",
                        projections()
                    ),
                )
            })?;
        if layer >= cfg.n_layers {
            return Err(failed(
                desc,
                format!(
                    "tensor {name} {shape:?} is for layer {layer}; {class} has {} layers",
                    cfg.n_layers
                ),
            ));
        }
        if cfg.layers[layer].moe && target.parent() == "mlp" {
            return Err(failed(
                desc,
                format!(
                    "tensor {name} {shape:?} targets the MLP of layer {layer}, a mixture of experts: the native engine applies adapters to attention projections and dense MLPs only"
                ),
            ));
        }
        let [d_out, d_in] = target.shape(cfg);
        let base = format!("model.layers.{layer}.{module}.weight");
        let expected = if is_a {
            [pc.rank, d_in]
        } else {
            [d_out, pc.rank]
        };
        if shape != expected {
            return Err(failed(
                desc,
                format!(
                    "tensor {name} is {shape:?}; the base's {base} is [{d_out}, {d_in}] and the rank is {}, so it must be {expected:?}",
                    pc.rank
                ),
            ));
        }
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::BF16 => DType::Bf16,
            Dtype::F16 => DType::F16,
            other => {
                return Err(unsupported(
                    desc,
                    format!("tensor {name} is {other:?}; adapters are read in f32, bf16 or f16"),
                ));
            }
        };
        found.entry((layer, target.index())).or_default()[usize::from(!is_a)] =
            Some(to_f32(view.data(), dtype));
    }
    if found.is_empty() {
        return Err(failed(
            desc,
            format!("{} holds no LoRA tensors", path.display()),
        ));
    }
    // Listed targets the model lacks, even when no tensor of them is present.
    for t in pc.targets.iter().flatten() {
        let module = t.rsplit('.').next().unwrap_or(t);
        if Target::from_name(module).is_none() {
            return Err(failed(
                desc,
                format!(
                    "target module {t} (adapter_config.json target_modules) is not a projection of {class} (its projections: {})",
                    projections()
                ),
            ));
        }
    }
    drop(st);
    drop(bytes);
    let mut layers: Vec<[Option<LoraPair>; 7]> =
        (0..cfg.n_layers).map(|_| Default::default()).collect();
    for ((layer, ti), [a, b]) in found {
        let target = Target::ALL[ti];
        let [d_out, d_in] = target.shape(cfg);
        let (a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (a, _) => {
                let (has, lacks) = if a.is_some() {
                    ("lora_A", "lora_B")
                } else {
                    ("lora_B", "lora_A")
                };
                return Err(failed(
                    desc,
                    format!(
                        "base_model.model.model.layers.{layer}.{}.{}.{has}.weight has no {lacks}.weight beside it",
                        target.parent(),
                        target.name()
                    ),
                ));
            }
        };
        layers[layer][ti] = Some(LoraPair {
            rank: pc.rank,
            d_in,
            d_out,
            a,
            b,
            scale,
        });
    }
    Ok(LoraWeights {
        name: desc.name.clone(),
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::parse_name;

    #[test]
    fn peft_names_are_parsed_into_layer_module_and_side() {
        assert_eq!(
            parse_name("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight"),
            Some((12, "self_attn.q_proj", true))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"),
            Some((0, "mlp.down_proj", false))
        );
        assert_eq!(parse_name("base_model.model.lm_head.lora_A.weight"), None);
        assert_eq!(
            parse_name("base_model.model.model.layers.x.mlp.up_proj.lora_A.weight"),
            None
        );
    }
}
