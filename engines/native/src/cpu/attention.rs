//! Native engine, CPU backend: bidirectional attention over one long input, as matrix products
//! (below Whisper's encoder, `whisper/net.rs`, once per layer per `seq_set_input`).
//!
//! Every one of `n` positions attends to all `n`: per head, the scores `S = Q·Kᵀ·scale` are one
//! product, each row of `S` becomes its softmax in place, and the output is `S·V`, a second
//! product written into the head's columns. At Whisper's 1,500 positions and 64-wide heads the
//! two products are 94 % of the layer's attention work, and the `gemm` crate's packed kernels do
//! them several times faster than one dot product per (query, key) pair, which is what the
//! short-input path (`encoder::attention`, BERT's inputs of at most a few hundred tokens) does.
//! The scores of one head at a time are held: `n × n` f32 (9 MB at 1,500).

use rayon::prelude::*;

use super::ops;

/// `out[i][head]` = softmax over j of `q[i][head] · k[j][head] × scale`, weighting `v[j][head]`;
/// `q`, `k`, `v` and `out` are `n` rows of `heads × hd`.
#[allow(clippy::too_many_arguments)]
pub fn full(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    heads: usize,
    hd: usize,
    scale: f32,
    out: &mut [f32],
) {
    let h = heads * hd;
    assert!(
        q.len() >= n * h && k.len() >= n * h && v.len() >= n * h && out.len() >= n * h,
        "attention over {n} rows of {h}: a buffer is too short"
    );
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let mut s = vec![0.0f32; n * n];
    for head in 0..heads {
        let off = head * hd;
        // SAFETY: S is n × n (row stride n); Q's head is n × hd at `off` with row stride h; the
        // right-hand side is Kᵀ (hd × n), read from K's head (element (c, j) at j·h + off + c);
        // every index stays inside the slices checked above.
        unsafe {
            gemm::gemm(
                n,
                n,
                hd,
                s.as_mut_ptr(),
                1,
                n as isize,
                false,
                q.as_ptr().add(off),
                1,
                h as isize,
                k.as_ptr().add(off),
                h as isize,
                1,
                0.0,
                scale,
                false,
                false,
                false,
                par,
            );
        }
        s.par_chunks_mut(n).for_each(softmax);
        // SAFETY: the output's head is n × hd at `off` with row stride h; S is n × n; V's head
        // is n × hd at `off` with row stride h; all inside the slices checked above, and the
        // written columns of `out` are this head's only.
        unsafe {
            gemm::gemm(
                n,
                hd,
                n,
                out.as_mut_ptr().add(off),
                1,
                h as isize,
                false,
                s.as_ptr(),
                1,
                n as isize,
                v.as_ptr().add(off),
                1,
                h as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
    }
}

const LANES: usize = 16;

/// A row's softmax in place, in passes the compiler vectorises: the maximum and the sum in 16
/// partial lanes (a running scalar sum would serialise the exponentials), [`ops::exp`] over the
/// row, then one scale.
fn softmax(row: &mut [f32]) {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut max = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for j in 0..LANES {
            lanes[j] = if c[j] > lanes[j] { c[j] } else { lanes[j] };
        }
    }
    max = lanes.iter().copied().fold(max, f32::max);
    row.iter_mut().for_each(|x| *x = ops::exp(*x - max));
    let mut sums = [0.0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut sum: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for j in 0..LANES {
            sums[j] += c[j];
        }
    }
    sum += sums.iter().sum::<f32>();
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|x| *x *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agrees_with_one_dot_product_per_pair() {
        let (n, heads, hd) = (37, 3, 8);
        let h = heads * hd;
        let val = |i: usize| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.8;
        let q: Vec<f32> = (0..n * h).map(val).collect();
        let k: Vec<f32> = (0..n * h).map(|i| val(i + 11)).collect();
        let v: Vec<f32> = (0..n * h).map(|i| val(i + 23)).collect();
        let mut got = vec![f32::NAN; n * h];
        let scale = 1.0 / (hd as f32).sqrt();
        full(&q, &k, &v, n, heads, hd, scale, &mut got);
        let mut want = vec![0.0f32; n * h];
        let all = 0..n;
        let spans = std::slice::from_ref(&all);
        crate::encoder::attention(&q, &k, &v, spans, heads, hd, &mut want);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "{worst:e}");
    }
}
