//! Native engine, CPU backend: the element-wise and attention operations of a layer.
//!
//! Written as plain loops over fixed-width lanes so the compiler vectorises them for the
//! machine (`-C target-cpu=native` in local builds): a sum is kept in 16 separate partial sums,
//! which is what lets it use SIMD registers without reassociating floating-point additions.

use rayon::prelude::*;

use crate::config::Activation;

const LANES: usize = 16;

/// Σ a[i]·b[i] in 16 partial sums.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// y += a·x
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// RMSNorm of each `dim`-row of `x` into `out`: x / sqrt(mean(x²) + eps) · w, with w + 1 for
/// Gemma. The mean is accumulated in f64 (as ggml does).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, plus_one: bool, out: &mut [f32]) {
    let dim = w.len();
    for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss: f64 = row.iter().map(|&v| f64::from(v * v)).sum();
        let scale = (1.0 / (ss / dim as f64 + f64::from(eps)).sqrt()) as f32;
        if plus_one {
            for ((o, &v), &w) in o.iter_mut().zip(row).zip(w) {
                *o = v * scale * (1.0 + w);
            }
        } else {
            for ((o, &v), &w) in o.iter_mut().zip(row).zip(w) {
                *o = v * scale * w;
            }
        }
    }
}

/// RMSNorm in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32, plus_one: bool) {
    let dim = w.len();
    let mut tmp = vec![0.0; dim];
    for row in x.chunks_exact_mut(dim) {
        rms_norm(row, w, eps, plus_one, &mut tmp);
        row.copy_from_slice(&tmp);
    }
}

/// cos and sin of every (token, pair) for one rotary setting: `[T][half]` each.
pub fn rope_table(positions: &[usize], inv_freq: &[f32], attn_factor: f32) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0.0; positions.len() * half];
    let mut sin = vec![0.0; positions.len() * half];
    for (t, &p) in positions.iter().enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            // transformers computes the angle in f32: position × inverse frequency.
            let a = p as f32 * f;
            cos[t * half + i] = a.cos() * attn_factor;
            sin[t * half + i] = a.sin() * attn_factor;
        }
    }
    (cos, sin)
}

/// Rotate each head of each token (`rotate_half` layout: pair i is (x[i], x[i + half])), over
/// the first `2 × half` dimensions of each head, `half` being the tables' pairs per token
/// (partial RoPE leaves the rest as it is).
pub fn rope(x: &mut [f32], n_heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let tokens = x.len() / (n_heads * head_dim);
    if tokens == 0 {
        return;
    }
    let half = cos.len() / tokens;
    for (t, tok) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for h in tok.chunks_exact_mut(head_dim) {
            let (a, b) = h[..2 * half].split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/// e^x for the activations: Cephes-style range reduction and a degree-6 polynomial
/// (relative error below 2e-7), in branch-free arithmetic the compiler vectorises, unlike
/// the libm call.
#[inline]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_66;
    let p = p * r + 0.5;
    let p = p * r * r + r + 1.0;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// erf(x) by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7, 5e-7 in f32) over
/// [`exp`]: branch free, so a loop of it vectorises, where libm's `erff` is a call per value
/// (13 % of an embedding batch's time in a profile, on one thread). PyTorch's vectorised CPU
/// `erf` uses the same formula.
#[inline]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let p = 1.061_405_4;
    let p = p * t - 1.453_152;
    let p = p * t + 1.421_413_7;
    let p = p * t - 0.284_496_72;
    let p = p * t + 0.254_829_6;
    (1.0 - p * t * exp(-a * a)).copysign(x)
}

/// GELU with the exact error function (BERT's `gelu`), in place.
pub fn gelu_erf(x: &mut [f32]) {
    for v in x {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// SiLU(g)·u into g.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    for (g, &u) in g.iter_mut().zip(u) {
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

/// GELU(g) with the tanh approximation, times u, into g.
pub fn gelu_tanh_mul(g: &mut [f32], u: &[f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    for (g, &u) in g.iter_mut().zip(u) {
        let x = *g;
        let y = C * (x + 0.044_715 * x * x * x);
        // tanh(y) = 1 - 2 / (e^(2y) + 1)
        let t = 1.0 - 2.0 / (exp(2.0 * y) + 1.0);
        *g = 0.5 * x * (1.0 + t) * u;
    }
}

/// The MLP's activation into `g`: `act(g) * u` for a gated MLP, `relu(u)²` for
/// [`Activation::Relu2`] (no gate; `g` only receives).
pub fn activate(act: Activation, g: &mut [f32], u: &[f32]) {
    match act {
        Activation::ClampedSwiglu { limit } => {
            for (g, &u) in g.iter_mut().zip(u) {
                let x = g.min(limit);
                *g = x / (1.0 + (-1.702 * x).exp()) * (u.clamp(-limit, limit) + 1.0);
            }
        }
        Activation::Silu => silu_mul(g, u),
        Activation::GeluTanh => gelu_tanh_mul(g, u),
        Activation::Relu2 => {
            for (g, &u) in g.iter_mut().zip(u) {
                let r = u.max(0.0);
                *g = r * r;
            }
        }
    }
}

/// One layer's KV storage: `[block][slot][kv head][head_dim]` for K and for V.
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// What attention needs to know about each token of the step.
pub struct AttnTokens<'a> {
    pub positions: &'a [usize],
    /// Block table of each token's sequence.
    pub tables: &'a [&'a [u32]],
    pub seq_of: &'a [usize],
}

pub struct AttnShape<'a> {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub window: Option<usize>,
    pub scale: f32,
    pub softcap: Option<f32>,
    /// A logit per head that joins each softmax's denominator and nothing else (gpt-oss).
    pub sinks: Option<&'a [f32]>,
}

/// A pointer the attention tasks share; each writes its own token's heads.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: every task writes only the output rows of its (token, kv head) pair, so no two
// tasks write the same element.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    /// Taking the pointer through a method makes closures capture the whole `Out` (which is
    /// `Sync`), not its raw field.
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// Causal attention of every token over its own sequence's cached positions `0..=pos` (the
/// last `window` of them for a sliding layer). `q` is `[T][n_heads][head_dim]`; the result goes
/// to `out` in the same layout. Work is split by (token, kv head) across the thread pool.
pub fn attention(
    q: &[f32],
    kv: &LayerKv,
    toks: &AttnTokens<'_>,
    s: &AttnShape<'_>,
    out: &mut [f32],
) {
    let t_count = toks.positions.len();
    let group = s.n_heads / s.n_kv_heads;
    let hd = s.head_dim;
    let row = s.n_heads * hd;
    debug_assert_eq!(out.len(), t_count * row);
    let o = Out(out.as_mut_ptr());
    (0..t_count * s.n_kv_heads)
        .into_par_iter()
        .for_each(|item| {
            let (t, g) = (item / s.n_kv_heads, item % s.n_kv_heads);
            let pos = toks.positions[t];
            let table = toks.tables[toks.seq_of[t]];
            let lo = match s.window {
                Some(w) => (pos + 1).saturating_sub(w),
                None => 0,
            };
            let span = pos + 1 - lo;
            let kv_at = |p: usize| {
                let cell = table[p / s.block_size] as usize * s.block_size + p % s.block_size;
                (cell * s.n_kv_heads + g) * hd
            };
            let mut scores = vec![0.0f32; group * span];
            for p in lo..=pos {
                let at = kv_at(p);
                let k = &kv.k[at..at + hd];
                for h in 0..group {
                    let qh = &q[t * row + (g * group + h) * hd..][..hd];
                    let mut sc = dot(qh, k) * s.scale;
                    if let Some(cap) = s.softcap {
                        sc = (sc / cap).tanh() * cap;
                    }
                    scores[h * span + (p - lo)] = sc;
                }
            }
            let mut acc = vec![0.0f32; group * hd];
            for h in 0..group {
                let sc = &mut scores[h * span..(h + 1) * span];
                let sink = s.sinks.map(|k| k[g * group + h]);
                let max = sc
                    .iter()
                    .copied()
                    .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
                let mut sum = sink.map_or(0.0, |k| (k - max).exp());
                for v in sc.iter_mut() {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                let inv = 1.0 / sum;
                sc.iter_mut().for_each(|v| *v *= inv);
            }
            for p in lo..=pos {
                let at = kv_at(p);
                let v = &kv.v[at..at + hd];
                for h in 0..group {
                    axpy(
                        scores[h * span + (p - lo)],
                        v,
                        &mut acc[h * hd..(h + 1) * hd],
                    );
                }
            }
            // SAFETY: this task alone writes heads g*group..(g+1)*group of token t, which lie
            // inside `out` (t < T, heads < n_heads).
            unsafe {
                let dst = o.ptr().add(t * row + g * group * hd);
                std::ptr::copy_nonoverlapping(acc.as_ptr(), dst, group * hd);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_exp_is_close_to_libm() {
        for i in -800..800 {
            let x = i as f32 / 10.0;
            let (a, b) = (exp(x), x.exp());
            assert!(((a - b) / b).abs() < 1e-6, "{x}: {a} vs {b}");
        }
    }

    #[test]
    fn the_fast_erf_is_close_to_libm() {
        for i in -600..600 {
            let x = i as f32 / 100.0;
            let (a, b) = (erf(x), libm::erff(x));
            assert!((a - b).abs() < 5e-7, "{x}: {a} vs {b}");
        }
    }

    #[test]
    fn rope_rotates_pairs_half_a_head_apart() {
        let mut x = vec![1.0, 0.0, 0.0, 1.0];
        let (c, s) = rope_table(&[1], &[std::f32::consts::FRAC_PI_2, 0.0], 1.0);
        rope(&mut x, 1, 4, &c, &s);
        // Pair 0 = (x0, x2) = (1, 0) turned by 90°: (0, 1). Pair 1 = (x1, x3) unchanged.
        assert!((x[0]).abs() < 1e-6 && (x[2] - 1.0).abs() < 1e-6);
        assert_eq!((x[1], x[3]), (0.0, 1.0));
    }
}
