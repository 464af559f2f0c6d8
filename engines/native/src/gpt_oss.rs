//! Native engine, load step 2 for gpt-oss (called by `decoder_load.rs` once the shards are
//! mapped, before a backend reads them): the fused expert tensors rearranged into one gate, up
//! and down projection per expert, as `crate::backend::load_stack` reads every mixture of
//! experts (`MoeNaming::GptOss`).
//!
//! The checkpoint holds, per layer under `model.layers.{i}.mlp.experts.`:
//! - `gate_up_proj` `[experts][hidden][2 × ff]` (input-major: `x · W`) whose columns alternate
//!   gate, up, gate, up…, and `down_proj` `[experts][ff][hidden]`, in bf16 or f32;
//! - or, as released (`quant_method: mxfp4`), `gate_up_proj_blocks` `[experts][2 × ff][hidden
//!   / 32][16]` with `gate_up_proj_scales` `[experts][2 × ff][hidden / 32]` (row-major: one row
//!   per output), and the same for `down_proj`: each byte two FP4 (e2m1) values, low nibble
//!   first, each block of 32 scaled by `2^(scale − 127)`. They are dequantized to bf16 (exact:
//!   every such value is a bf16 value);
//! - `gate_up_proj_bias` `[experts][2 × ff]` and `down_proj_bias` `[experts][hidden]`.
//!
//! The result is `experts.{e}.{gate,up,down}_proj.{weight,bias}` with weights `[out][in]`, in
//! the checkpoint's float type (bf16 for MXFP4), in one owned shard.

use gantry_engine_abi::EngineError;
use gantry_engine_abi::Status;

use crate::config::ModelConfig;
use crate::weights::{DType, Made, Weights};

/// The e2m1 values of the 16 FP4 codes (sign, two exponent bits, one mantissa bit).
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

fn corrupt(msg: String) -> EngineError {
    EngineError::new(Status::ModelCorrupt, msg)
}

/// One fused expert tensor, read as `[experts][out][in]` whatever its stored layout.
enum Fused<'a> {
    /// `[experts][in][out]` floats.
    Dense(Vec<f32>),
    /// MXFP4 rows `[experts][out]`, each `in / 32` blocks of 16 bytes and their scales.
    Mxfp4 { blocks: &'a [u8], scales: &'a [u8] },
}

impl Fused<'_> {
    /// Row `r` (an output) of expert `e`'s `[out][in]` matrix.
    fn row(&self, e: usize, r: usize, rows: usize, cols: usize, out: &mut Vec<f32>) {
        out.clear();
        match self {
            Fused::Dense(v) => {
                let base = e * cols * rows;
                out.extend((0..cols).map(|c| v[base + c * rows + r]));
            }
            Fused::Mxfp4 { blocks, scales } => {
                let groups = cols / 32;
                let row = e * rows + r;
                for g in 0..groups {
                    let scale = 2f32.powi(i32::from(scales[row * groups + g]) - 127);
                    for &b in &blocks[(row * groups + g) * 16..][..16] {
                        out.push(FP4[usize::from(b & 0x0f)] * scale);
                        out.push(FP4[usize::from(b >> 4)] * scale);
                    }
                }
            }
        }
    }
}

/// `{p}.{name}` as `[experts][rows][cols]` (out, in): the float tensor `[experts][cols][rows]`,
/// or with `mxfp4` its blocks and scales. Returns it and the dtype the split tensors take.
fn fused<'a>(
    w: &'a Weights,
    mxfp4: bool,
    p: &str,
    name: &str,
    [experts, rows, cols]: [usize; 3],
) -> Result<(Fused<'a>, DType), EngineError> {
    if mxfp4 {
        let (b, s) = (format!("{p}.{name}_blocks"), format!("{p}.{name}_scales"));
        let (blocks, bshape) = w
            .packed(&b)
            .ok_or_else(|| corrupt(format!("tensor {b} is missing (quant_method mxfp4)")))?;
        let (scales, sshape) = w
            .packed(&s)
            .ok_or_else(|| corrupt(format!("tensor {s} is missing (quant_method mxfp4)")))?;
        let groups = cols / 32;
        if cols % 32 != 0
            || bshape != [experts, rows, groups, 16]
            || sshape != [experts, rows, groups]
        {
            return Err(corrupt(format!(
                "{b} has shape {bshape:?} and {s} {sshape:?}; the config says [{experts}, {rows}, {groups}, 16] and [{experts}, {rows}, {groups}]"
            )));
        }
        return Ok((Fused::Mxfp4 { blocks, scales }, DType::Bf16));
    }
    let t = w.expect(&format!("{p}.{name}"), &[experts, cols, rows])?;
    Ok((Fused::Dense(w.to_f32(t)), t.dtype))
}

/// Split every layer's fused experts into per-expert projections (see the module header).
pub fn split_experts(cfg: &ModelConfig, w: &mut Weights) -> Result<(), EngineError> {
    let Some(moe) = &cfg.moe else {
        return Ok(());
    };
    let (h, ff, n) = (cfg.hidden, moe.intermediate, moe.experts);
    let elt = match w.get("model.layers.0.mlp.experts.gate_up_proj") {
        Some(t) if !cfg.mxfp4 => t.dtype.size(),
        _ => 2,
    };
    let per_layer = (n * 3 * ff * h + n * (2 * ff + h)) * elt;
    let mut made = Made::with_capacity("gpt-oss experts split", per_layer * cfg.n_layers)?;
    for i in 0..cfg.n_layers {
        let p = format!("model.layers.{i}.mlp.experts");
        let (gate_up, dt) = fused(w, cfg.mxfp4, &p, "gate_up_proj", [n, 2 * ff, h])?;
        let (down, down_dt) = fused(w, cfg.mxfp4, &p, "down_proj", [n, h, ff])?;
        let gu_bias = w.to_f32(w.expect(&format!("{p}.gate_up_proj_bias"), &[n, 2 * ff])?);
        let down_bias = w.expect(&format!("{p}.down_proj_bias"), &[n, h])?;
        let (down_bias, bias_dt) = (w.to_f32(down_bias), down_bias.dtype);
        let mut row = Vec::new();
        for e in 0..n {
            let q = format!("{p}.{e}");
            // Gate rows are the even outputs of gate_up, up rows the odd ones.
            for (half, which) in [(0, "gate_proj"), (1, "up_proj")] {
                let mut values = Vec::with_capacity(ff * h);
                for j in 0..ff {
                    gate_up.row(e, 2 * j + half, 2 * ff, h, &mut row);
                    values.extend_from_slice(&row);
                }
                made.push(
                    format!("{q}.{which}.weight"),
                    dt,
                    vec![ff, h],
                    values.into_iter(),
                );
                let bias = (0..ff).map(|j| gu_bias[e * 2 * ff + 2 * j + half]);
                made.push(format!("{q}.{which}.bias"), bias_dt, vec![ff], bias);
            }
            let mut values = Vec::with_capacity(ff * h);
            for r in 0..h {
                down.row(e, r, h, ff, &mut row);
                values.extend_from_slice(&row);
            }
            made.push(
                format!("{q}.down_proj.weight"),
                down_dt,
                vec![h, ff],
                values.into_iter(),
            );
            let bias = down_bias[e * h..(e + 1) * h].iter().copied();
            made.push(format!("{q}.down_proj.bias"), bias_dt, vec![h], bias);
        }
    }
    w.add(made);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_mxfp4_row_is_two_values_a_byte_low_nibble_first_times_its_block_scale() {
        // One row of 32 inputs: bytes 0x21 (1.0 then 0.5... low nibble 1 = 0.5, high 2 = 1.0)
        // and 0xF7 (low 7 = 6.0, high 15 = -6.0), the rest zero; scale 2^(128 - 127) = 2.
        let mut blocks = [0u8; 16];
        blocks[0] = 0x21;
        blocks[1] = 0xF7;
        let scales = [128u8];
        let f = Fused::Mxfp4 {
            blocks: &blocks,
            scales: &scales,
        };
        let mut row = Vec::new();
        f.row(0, 0, 1, 32, &mut row);
        assert_eq!(&row[..4], &[1.0, 2.0, 12.0, -12.0]);
        assert!(row[4..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn a_dense_fused_tensor_is_read_transposed() {
        // Expert 1 of two, [in = 2][out = 3]: row r of [out][in] is column r.
        let v: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let f = Fused::Dense(v);
        let mut row = Vec::new();
        f.row(1, 2, 3, 2, &mut row);
        assert_eq!(row, [8.0, 11.0]);
    }
}
