//! Native engine, CPU backend, in a step's products: f32 weights on a CPU with AVX-512F.
//!
//! The weight `W` (`[n, k]`, `y = x · Wᵀ`) is packed once at load into panels of [`NR`] output
//! rows, k-major (`[panel][k][NR]`, the last panel padded with zeros), and a product runs a
//! register tile of `R` ≤ [`MR`] input rows × [`NR`] outputs: per k, two 16-lane loads of the
//! panel, one broadcast per input row and `2 R` fused multiply-adds, twelve accumulators in
//! registers. Tasks are (panel, chunk of input rows) pairs on the engine's pool.
//!
//! Why not the `gemm` crate here: its AVX-512 kernels are behind its `nightly` feature, so on a
//! stable toolchain it runs 8-lane AVX2 kernels, which took 68 % of an embedding batch's time
//! (all-MiniLM-L6-v2, 32 inputs, `perf`). AVX-512 intrinsics are stable Rust since 1.89.
//!
//! Each output element is one accumulator summed in k order, whatever the number of rows and
//! the tile they fall in, so a row's result does not depend on what else is in the product.

#![allow(unsafe_code)]

use rayon::prelude::*;

/// Output rows per panel: two 16-lane registers.
pub const NR: usize = 32;
/// Input rows per register tile.
pub const MR: usize = 6;
/// Input rows per task (a multiple of [`MR`]).
const MC: usize = 8 * MR;

/// Whether this CPU has AVX-512F, checked once.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A weight packed into panels (see the module header).
pub struct Panels {
    n: usize,
    k: usize,
    data: Vec<f32>,
}

/// The output, written by tasks at disjoint elements.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: every task writes its own (rows, panel) block of the output and nothing else.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    /// The address of element `i` (a method, so closures capture the whole `Out`).
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

impl Panels {
    /// Pack `w` (`n` rows of `k`, row-major).
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "a weight of {n} x {k}");
        let panels = n.div_ceil(NR);
        let mut data = vec![0.0f32; panels * k * NR];
        for (r, row) in w.chunks_exact(k).enumerate() {
            let (p, j) = (r / NR, r % NR);
            let panel = &mut data[p * k * NR..(p + 1) * k * NR];
            for (kk, &v) in row.iter().enumerate() {
                panel[kk * NR + j] = v;
            }
        }
        Self { n, k, data }
    }

    /// Bytes the panels hold.
    pub fn bytes(&self) -> u64 {
        (self.data.len() * 4) as u64
    }

    /// `y[m][n] = x[m][k] · Wᵀ`, on the current pool.
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        assert!(
            x.len() >= m * k && y.len() >= m * n,
            "a product of {m} rows"
        );
        assert!(available(), "panels are packed only where AVX-512F is");
        let panels = n.div_ceil(NR);
        let chunks = m.div_ceil(MC);
        let out = Out(y.as_mut_ptr());
        (0..panels * chunks).into_par_iter().for_each(|task| {
            let (p, c) = (task % panels, task / panels);
            let cols = NR.min(n - p * NR);
            let b = &self.data[p * k * NR..(p + 1) * k * NR];
            let end = ((c + 1) * MC).min(m);
            let mut i = c * MC;
            while i < end {
                let r = MR.min(end - i);
                let a = &x[i * k..(i + r) * k];
                // SAFETY: rows i .. i + r of y are inside it (m x n, checked above) and the
                // tile writes columns p NR .. p NR + cols < n of them, which no other task
                // writes; `a` holds r rows of k and `b` k x NR values; AVX-512F is present.
                unsafe {
                    tile(r, a, b, k, out.at(i * n + p * NR), n, cols);
                }
                i += r;
            }
        });
    }
}

/// One register tile of `r` rows (dispatch to the tile of that height).
///
/// # Safety
/// As [`tile_r`].
unsafe fn tile(r: usize, a: &[f32], b: &[f32], k: usize, c: *mut f32, ldc: usize, cols: usize) {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        match r {
            1 => tile_r::<1>(a, b, k, c, ldc, cols),
            2 => tile_r::<2>(a, b, k, c, ldc, cols),
            3 => tile_r::<3>(a, b, k, c, ldc, cols),
            4 => tile_r::<4>(a, b, k, c, ldc, cols),
            5 => tile_r::<5>(a, b, k, c, ldc, cols),
            _ => tile_r::<MR>(a, b, k, c, ldc, cols),
        }
    }
}

/// `c[i][j] = Σ_k a[i][k] b[k][j]` for `R` rows and the first `cols` of [`NR`] columns.
///
/// # Safety
/// AVX-512F must be present; `a` holds `R` rows of `k`, `b` `k` rows of [`NR`]; `c` points
/// at `R` rows of stride `ldc`, each with `cols` writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_r<const R: usize>(
    a: &[f32],
    b: &[f32],
    k: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    debug_assert!(a.len() >= R * k && b.len() >= k * NR && cols <= NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    for kk in 0..k {
        // SAFETY: kk < k, so the panel's row kk (NR values) and each a[i][kk] are in bounds.
        unsafe {
            let b0 = _mm512_loadu_ps(bp.add(kk * NR));
            let b1 = _mm512_loadu_ps(bp.add(kk * NR + 16));
            for (i, acc) in acc.iter_mut().enumerate() {
                let ai = _mm512_set1_ps(*ap.add(i * k + kk));
                acc[0] = _mm512_fmadd_ps(ai, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(ai, b1, acc[1]);
            }
        }
    }
    let lo = if cols >= 16 {
        0xffff
    } else {
        (1u16 << cols) - 1
    };
    let hi = if cols >= NR {
        0xffff
    } else if cols > 16 {
        (1u16 << (cols - 16)) - 1
    } else {
        0
    };
    for (i, acc) in acc.iter().enumerate() {
        // SAFETY: row i of c has `cols` writable values; the masks cover exactly those.
        unsafe {
            let row = c.add(i * ldc);
            _mm512_mask_storeu_ps(row, lo, acc[0]);
            _mm512_mask_storeu_ps(row.add(16), hi, acc[1]);
        }
    }
}

/// Never called: panels are packed only where AVX-512F is ([`available`]).
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_r<const R: usize>(
    _a: &[f32],
    _b: &[f32],
    _k: usize,
    _c: *mut f32,
    _ldc: usize,
    _cols: usize,
) {
    unreachable!("panels need AVX-512F")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain triple loop, in f64.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        (0..m)
            .flat_map(|i| {
                (0..n).map(move |j| {
                    (0..k)
                        .map(|kk| f64::from(x[i * k + kk]) * f64::from(w[j * k + kk]))
                        .sum::<f64>() as f32
                })
            })
            .collect()
    }

    #[test]
    fn panel_products_agree_with_a_plain_loop_and_do_not_depend_on_the_batch() {
        if !available() {
            // The kernel cannot run here, and f32 weights are not packed for it.
            eprintln!("no AVX-512F on this machine: the panel kernel is not used here");
            return;
        }
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        // Shapes with every remainder: rows past a tile and a task, columns past a panel and
        // inside its first half.
        for (m, n, k) in [
            (1, 32, 8),
            (7, 45, 33),
            (50, 70, 64),
            (13, 10, 5),
            (97, 384, 96),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let p = Panels::pack(&w, n, k);
            let mut y = vec![f32::NAN; m * n];
            p.matmul(&x, m, &mut y);
            let want = reference(&x, &w, m, n, k);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (k as f32).sqrt(),
                    "{m}x{n}x{k} [{i}]: {a} vs {b}"
                );
            }
            // Row 0 alone gives exactly what it gave in the batch.
            let mut one = vec![0.0; n];
            p.matmul(&x[..k], 1, &mut one);
            assert_eq!(one, y[..n], "{m}x{n}x{k}: row 0 alone");
        }
    }
}
