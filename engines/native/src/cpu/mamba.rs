//! Native engine, CPU backend: a Mamba-2 mixer over one step's tokens ([`crate::config::Mamba2`]),
//! in place of attention in the state-space layers of a hybrid model (`cpu/mod.rs` calls it
//! per layer).
//!
//! The input projection runs for the whole batch in one product; then each sequence's tokens go
//! through the causal convolution and the selective scan in order, from the sequence's state
//! slot (its convolution's last inputs and the scan's `heads × head_dim × state` values), which
//! the step leaves updated. A sequence whose first token of the step is at position 0 starts
//! from zeros. Sequences run in parallel on the engine's pool; within one, tokens go one after
//! another (the recurrence `h ← exp(dt·A)·h + dt·x⊗B` is the same computation transformers'
//! chunked scan makes for a prompt, in another order of sums). The gated, RMS-normalised
//! output goes through the output projection for the whole batch.

use rayon::prelude::*;

use crate::backend::Mamba;
use crate::config::Mamba2;
use crate::cpu::matmul::Linear;
use crate::cpu::ops::exp;
use crate::weights::Weights;

/// One step's tokens as the mixer sees them.
pub struct Tokens<'a> {
    /// Position of each token in its sequence.
    pub positions: &'a [usize],
    /// Index of each token's sequence (its entries are consecutive and in order).
    pub seq_of: &'a [usize],
    /// The state slot of each sequence, by sequence index.
    pub slots: &'a [usize],
}

/// softplus as torch computes it (linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// Run the mixer: `x` is the normalised input `[t][hidden]`, `out` gets `[t][hidden]`;
/// `state` holds every slot's state for this layer, `spec.state_floats()` per slot.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    w: &Weights,
    m: &Mamba<Vec<f32>, Linear>,
    spec: &Mamba2,
    eps: f32,
    x: &[f32],
    toks: &Tokens<'_>,
    hidden: usize,
    state: &mut [f32],
    out: &mut [f32],
    scratch: &mut Vec<u16>,
) {
    let t = toks.positions.len();
    let rows = spec.in_proj_rows();
    let inner = spec.inner();
    let mut proj = vec![0.0f32; t * rows];
    m.in_proj.forward(w, x, t, &mut proj, scratch);
    let mut y = vec![0.0f32; t * inner];

    // Each sequence's run of tokens with its own state slot and output rows.
    let per_slot = spec.state_floats();
    let mut slots: Vec<Option<&mut [f32]>> = state.chunks_mut(per_slot).map(Some).collect();
    let mut work = Vec::new();
    let mut rest_y: &mut [f32] = &mut y;
    let mut i = 0;
    while i < t {
        let seq = toks.seq_of[i];
        let end = (i..t).find(|&j| toks.seq_of[j] != seq).unwrap_or(t);
        let (mine, tail) = std::mem::take(&mut rest_y).split_at_mut((end - i) * inner);
        rest_y = tail;
        let slot = slots[toks.slots[seq]]
            .take()
            .expect("one run of tokens per sequence and slot");
        work.push((i..end, slot, mine));
        i = end;
    }
    work.into_par_iter().for_each(|(range, slot, ys)| {
        if toks.positions[range.start] == 0 {
            slot.fill(0.0);
        }
        // The convolved xBC of one token, reused for each token of the run.
        let mut xbc = vec![0.0f32; spec.conv_dim()];
        for (k, tok) in range.enumerate() {
            scan_token(
                m,
                spec,
                &proj[tok * rows..(tok + 1) * rows],
                slot,
                &mut xbc,
                &mut ys[k * inner..(k + 1) * inner],
                eps,
            );
        }
    });
    m.out_proj
        .forward(w, &y, t, &mut out[..t * hidden], scratch);
}

/// One token of one sequence: convolution, scan, gate and norm into `y` (`[inner]`).
fn scan_token(
    m: &Mamba<Vec<f32>, Linear>,
    spec: &Mamba2,
    proj: &[f32],
    state: &mut [f32],
    xbc: &mut [f32],
    y: &mut [f32],
    eps: f32,
) {
    let (inner, cd, k) = (spec.inner(), spec.conv_dim(), spec.conv_kernel);
    let (heads, p, n, g) = (spec.heads, spec.head_dim, spec.state, spec.groups);
    let (z, rest) = proj.split_at(inner);
    let (xbc_in, dt) = rest.split_at(cd);
    let (conv_state, ssm) = state.split_at_mut((k - 1) * cd);

    // Causal depthwise convolution over the last k inputs (k - 1 kept, this one), SiLU.
    for (c, o) in xbc.iter_mut().enumerate() {
        let f = &m.conv[c * k..(c + 1) * k];
        let mut acc = m.conv_bias.as_ref().map_or(0.0, |b| b[c]);
        for (j, &fj) in f[..k - 1].iter().enumerate() {
            acc += fj * conv_state[j * cd + c];
        }
        acc += f[k - 1] * xbc_in[c];
        *o = silu(acc);
    }
    conv_state.copy_within(cd.., 0);
    conv_state[(k - 2) * cd..].copy_from_slice(xbc_in);

    let (xs, bc) = xbc.split_at(inner);
    let (b, c) = bc.split_at(g * n);
    let per_group = heads / g;
    // Heads in parallel too: one sequence's scan is most of a decode step's work outside the
    // products when few sequences run.
    ssm.par_chunks_mut(p * n)
        .zip(y.par_chunks_mut(p))
        .enumerate()
        .for_each(|(h, (state, yh))| {
            let dt = softplus(dt[h] + m.dt_bias[h]).clamp(spec.dt_limit.0, spec.dt_limit.1);
            let da = (-m.a_log[h].exp() * dt).exp();
            let grp = h / per_group;
            let (bh, ch) = (&b[grp * n..(grp + 1) * n], &c[grp * n..(grp + 1) * n]);
            for (q, (s, yq)) in state.chunks_exact_mut(n).zip(yh.iter_mut()).enumerate() {
                let xv = xs[h * p + q];
                let mut acc = 0.0f32;
                for ((sv, &bv), &cv) in s.iter_mut().zip(bh).zip(ch) {
                    *sv = *sv * da + dt * xv * bv;
                    acc += *sv * cv;
                }
                *yq = acc + m.d[h] * xv;
            }
        });
    // y · SiLU(z), RMS-normalised per norm group, times the norm's weight.
    for (v, &zv) in y.iter_mut().zip(z) {
        *v *= silu(zv);
    }
    let width = inner / spec.norm_groups;
    for (grp, chunk) in y.chunks_exact_mut(width).enumerate() {
        let ms = chunk.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let r = 1.0 / (ms + eps).sqrt();
        let wv = &m.norm[grp * width..(grp + 1) * width];
        for (v, &wi) in chunk.iter_mut().zip(wv) {
            *v = *v * r * wi;
        }
    }
}
