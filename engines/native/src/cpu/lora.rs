//! Native engine, CPU backend, in the forward pass: LoRA adapters' low-rank updates added to
//! the projections of the rows that run under them (ABI 1.6, segmented LoRA).
//!
//! After a projection's base product `y = x·Wᵀ` over the whole batch, each run of consecutive
//! rows under one adapter ([`crate::lora::AdapterRun`]) gets `y[rows] += scale · (x[rows]·Aᵀ)·Bᵀ`:
//! two small products per run (`[rows, in]·[in, r]`, then `[rows, r]·[r, out]` accumulated into
//! `y`), never the merged `[out, in]` weight. Base rows are untouched, and a step without runs
//! does no work here at all.

use std::collections::HashMap;

use gantry_engine_abi::EngineError;

use crate::lora::{AdapterRun, LoraPair, LoraWeights, Target};

/// One step's runs with their adapters resolved (once per step, not per layer).
pub struct Runs<'a> {
    runs: Vec<(std::ops::Range<usize>, &'a LoraWeights)>,
    /// `x·Aᵀ` of one run, reused across products.
    tmp: Vec<f32>,
}

impl<'a> Runs<'a> {
    /// Resolve `runs` against the loaded adapters; a run of an adapter not loaded is an error
    /// (never a silent base answer).
    pub fn new(
        runs: &[AdapterRun],
        loaded: &'a HashMap<u64, LoraWeights>,
    ) -> Result<Self, EngineError> {
        let runs = runs
            .iter()
            .map(|r| {
                loaded
                    .get(&r.adapter)
                    .map(|w| (r.rows.clone(), w))
                    .ok_or_else(|| {
                        EngineError::internal(format!(
                            "a sequence of this step runs adapter {}, which is not loaded",
                            r.adapter
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            runs,
            tmp: Vec::new(),
        })
    }

    /// Add each run's update of `target` in layer `layer`: `x` is the projection's input
    /// (`[tokens, in]`), `y` its output (`[tokens, out]`) after the base product.
    pub fn apply(&mut self, layer: usize, target: Target, x: &[f32], y: &mut [f32]) {
        for (rows, w) in &self.runs {
            if let Some(p) = w.pair(layer, target) {
                add_update(p, rows.clone(), x, y, &mut self.tmp);
            }
        }
    }
}

/// `y[rows] += scale · (x[rows]·Aᵀ)·Bᵀ`.
fn add_update(
    p: &LoraPair,
    rows: std::ops::Range<usize>,
    x: &[f32],
    y: &mut [f32],
    tmp: &mut Vec<f32>,
) {
    let m = rows.len();
    let (r, d_in, d_out) = (p.rank, p.d_in, p.d_out);
    assert!(
        rows.end * d_in <= x.len() && rows.end * d_out <= y.len(),
        "adapter run past the batch"
    );
    tmp.clear();
    tmp.resize(m * r, 0.0);
    // Small products: threads only pay off for a prompt chunk.
    let par = match rayon::current_num_threads() {
        n if n > 1 && m >= 64 => gemm::Parallelism::Rayon(n),
        _ => gemm::Parallelism::None,
    };
    let xs = &x[rows.start * d_in..rows.end * d_in];
    // SAFETY: xs is m x d_in, A is r x d_in (read transposed through its strides), tmp is
    // m x r; all row-major with the strides given.
    unsafe {
        gemm::gemm(
            m,
            r,
            d_in,
            tmp.as_mut_ptr(),
            1,
            r as isize,
            false,
            xs.as_ptr(),
            1,
            d_in as isize,
            p.a.as_ptr(),
            d_in as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
    let ys = &mut y[rows.start * d_out..rows.end * d_out];
    // SAFETY: tmp is m x r, B is d_out x r (read transposed), ys is m x d_out and is read
    // (read_dst) before the scaled product is added to it.
    unsafe {
        gemm::gemm(
            m,
            d_out,
            r,
            ys.as_mut_ptr(),
            1,
            d_out as isize,
            true,
            tmp.as_ptr(),
            1,
            r as isize,
            p.b.as_ptr(),
            r as isize,
            1,
            1.0,
            p.scale,
            false,
            false,
            false,
            par,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_update_is_added_to_its_rows_only_and_equals_the_merged_weight() {
        // x: 3 rows of 4; W = 0; A [2, 4]; B [3, 2]; run over rows 1..3.
        let (d_in, d_out, r) = (4, 3, 2);
        let x: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
        let a: Vec<f32> = (0..8).map(|i| (i as f32).sin()).collect();
        let b: Vec<f32> = (0..6).map(|i| (i as f32).cos()).collect();
        let p = LoraPair {
            rank: r,
            d_in,
            d_out,
            a: a.clone(),
            b: b.clone(),
            scale: 2.0,
        };
        let mut y = vec![1.0f32; 3 * d_out];
        add_update(&p, 1..3, &x, &mut y, &mut Vec::new());
        for row in 0..3 {
            for o in 0..d_out {
                let mut want = 1.0f64;
                if row > 0 {
                    // merged: scale · Σ_k (Σ_j B[o][j] A[j][k]) x[row][k]
                    for k in 0..d_in {
                        let w: f64 = (0..r)
                            .map(|j| f64::from(b[o * r + j]) * f64::from(a[j * d_in + k]))
                            .sum();
                        want += 2.0 * w * f64::from(x[row * d_in + k]);
                    }
                }
                let got = f64::from(y[row * d_out + o]);
                assert!(
                    (got - want).abs() < 1e-5,
                    "row {row} out {o}: {got} vs {want}"
                );
            }
        }
    }
}
