//! Native engine, load step 1 (read by [`super::parse()`] before the weights are mapped):
//! `quantization_config` into what the loader dequantizes. FP8 (`quant_method: fp8`,
//! `float8_e4m3fn` weights with block or tensor scales) for every family, MXFP4
//! (`quant_method: mxfp4`, gpt-oss's experts) for gpt-oss; every other method (AWQ, GPTQ,
//! bitsandbytes, ...) is refused by name.

use gantry_engine_abi::EngineError;
use serde_json::Value;

use super::Architecture;
use super::fields::{corrupt, unsupported};
use crate::weights::Fp8;

/// The quantized weights a checkpoint holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quant {
    pub fp8: Option<Fp8>,
    /// gpt-oss's experts as MXFP4 blocks (`*_blocks`, `*_scales`).
    pub mxfp4: bool,
}

/// `quantization_config` of a `family` checkpoint.
pub(super) fn quantization(q: Option<&Value>, family: Architecture) -> Result<Quant, EngineError> {
    let Some(q) = q.filter(|q| !q.is_null()) else {
        return Ok(Quant::default());
    };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("(no quant_method)");
    match method {
        "fp8" => {}
        "mxfp4" if family == Architecture::GptOss => {
            return Ok(Quant {
                fp8: None,
                mxfp4: true,
            });
        }
        "mxfp4" => {
            return Err(unsupported(
                "config.json `quantization_config.quant_method` `mxfp4`: the native engine reads MXFP4 for gpt-oss's experts only",
            ));
        }
        _ => {
            return Err(unsupported(format!(
                "config.json `quantization_config.quant_method` `{method}`: the native engine runs bf16, f16 and f32 checkpoints, FP8 ones (`fp8`) and gpt-oss's MXFP4 experts (`mxfp4`)"
            )));
        }
    }
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str)
        && fmt != "e4m3"
    {
        return Err(unsupported(format!(
            "config.json `quantization_config.fmt` `{fmt}`: the native engine reads e4m3 FP8 weights"
        )));
    }
    let block = match q.get("weight_block_size") {
        None | Some(Value::Null) => None,
        Some(Value::Array(b)) => match b.iter().map(Value::as_u64).collect::<Option<Vec<_>>>() {
            Some(v) if v.len() == 2 && v.iter().all(|&x| x > 0 && x <= 1 << 20) => {
                Some([v[0] as usize, v[1] as usize])
            }
            _ => {
                return Err(corrupt(
                    "config.json `quantization_config.weight_block_size` must be two positive integers",
                ));
            }
        },
        Some(v) => {
            return Err(corrupt(format!(
                "config.json `quantization_config.weight_block_size` must be a list, got {v}"
            )));
        }
    };
    Ok(Quant {
        fp8: Some(Fp8 { block }),
        mxfp4: false,
    })
}
