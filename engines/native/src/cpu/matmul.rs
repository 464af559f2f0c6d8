//! Native engine, CPU backend: the linear layers, `y = x · Wᵀ` for a weight `W` stored
//! `[out, in]` as in Hugging Face checkpoints.
//!
//! Three kernels:
//! - bf16 weights on a CPU with AVX-512 BF16: a hand-written kernel (`vdpbf16ps`, 32 bf16
//!   products per instruction, f32 accumulators), reading the weights in place from the
//!   memory-mapped file. No maintained Rust GEMM crate multiplies bf16 with these instructions
//!   (`gemm` has f16/f32/f64 kernels, none for bf16), and at decode time the step is bound by
//!   streaming the weights once: the kernel reads each weight row once per step whatever the
//!   batch, like llama.cpp's own bf16 path, which also rounds the activations to bf16 first.
//! - f32 weights (and f16/bf16 weights converted to f32 at load on CPUs without AVX-512 BF16)
//!   on a CPU with AVX-512F: packed at load into panels for a hand-written AVX-512 kernel
//!   ([`super::panels`], which says why not `gemm` there);
//! - the same elsewhere: the `gemm` crate, except for a few rows (decode steps, short
//!   embedding inputs: up to [`SMALL_M`]), where `gemm` spends more time packing the weight
//!   matrix on every call than multiplying, and a row-parallel dot-product loop that reads each
//!   weight row once for all the step's rows serves instead.
//!
//! Both give each output element the same arithmetic whatever the batch size and whichever
//! other rows share the step (the bf16 kernel by construction: one accumulator per element,
//! the same k order in every tile shape), so a sequence's numbers do not depend on who else
//! is batched with it. `gemm` picks kernels by shape, so f32 models only promise agreement
//! within rounding.

#![allow(unsafe_code)]

use rayon::prelude::*;

use super::panels::{self, Panels};
use crate::weights::{DType, TensorInfo, Weights};

/// Weight storage the kernels read.
pub enum WeightData {
    /// bf16 bytes in the mapped file, read in place.
    MappedBf16(TensorInfo),
    /// f32 values owned by the engine (converted from f16/bf16, or copied from f32).
    F32(Vec<f32>),
    /// The same, packed for the AVX-512F kernel.
    Panels(Panels),
}

/// A linear layer: `rows` outputs of `cols` inputs, with an optional bias.
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
    pub bias: Option<Vec<f32>>,
}

/// Up to this many input rows, f32 products take [`small_m`] rather than `gemm`.
pub const SMALL_M: usize = 32;

/// `y[m][n] = x[m][k] · W[n][k]ᵀ` for few rows: weight rows split across the pool, each
/// weight row read once and dotted with every input row while it is in cache.
fn small_m(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, y: &mut [f32]) {
    // Weight rows per task: enough work to amortise the task, a few tasks per thread.
    let per_task = n.div_ceil(rayon::current_num_threads() * 4).max(8);
    let out = SharedOut(y.as_mut_ptr());
    (0..n.div_ceil(per_task)).into_par_iter().for_each(|task| {
        for r in task * per_task..((task + 1) * per_task).min(n) {
            let wr = &w[r * k..(r + 1) * k];
            for i in 0..m {
                let v = dot(&x[i * k..(i + 1) * k], wr);
                // SAFETY: element (i, r) lies inside y (m x n, checked by the caller's
                // debug assertions and slice lengths), and only this task writes column r.
                unsafe { *out.at(i * n + r) = v };
            }
        }
    });
}

/// A pointer to the output shared by the tasks of [`small_m`], which write disjoint columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

impl SharedOut {
    /// The element at `offset` (a method, so closures capture the Send wrapper, not the
    /// raw pointer inside it).
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}
// SAFETY: the tasks write disjoint output columns (each its own weight rows).
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

/// Dot product with 16 independent accumulators (the compiler keeps them in vector registers
/// and uses fused multiply-adds), then the tail.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ta.iter().zip(tb) {
        s = x.mul_add(*y, s);
    }
    s
}

/// Whether this CPU has AVX-512 BF16 (`vdpbf16ps`), checked once.
pub fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU runs a bf16 kernel that reads the weights in place (checked once):
/// AVX-512 BF16, or AVX2 with FMA (bf16 widened to f32 in registers, as ggml does on AVX2).
pub fn has_bf16_kernel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx512_bf16()
                || (std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma"))
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The bf16 kernel this CPU runs, for the build report.
pub fn bf16_kernel_name() -> &'static str {
    if has_avx512_bf16() {
        "AVX-512 BF16"
    } else if has_bf16_kernel() {
        "AVX2+FMA (bf16 widened in registers)"
    } else {
        "none"
    }
}

impl Linear {
    /// Prepare a `[rows, cols]` weight for this CPU.
    pub fn new(w: &Weights, t: &TensorInfo, bias: Option<Vec<f32>>) -> Self {
        let bf16 = t.dtype == DType::Bf16 && has_bf16_kernel();
        Self::prepare(w, t, bias, bf16)
    }

    /// A `[rows, cols]` weight computed in f32 (its input not rounded), whatever its dtype.
    pub fn f32(w: &Weights, t: &TensorInfo) -> Self {
        Self::prepare(w, t, None, false)
    }

    /// A `[rows, cols]` weight as plain f32 values, multiplied by the `gemm` crate past
    /// [`SMALL_M`] rows whatever the CPU: for layers that only ever see long inputs (Whisper's
    /// encoder: 1,500 and 3,000 rows), where `gemm`'s packing pays for itself and its kernels
    /// beat the panels.
    pub fn unpacked(w: &Weights, t: &TensorInfo, bias: Option<Vec<f32>>) -> Self {
        Self {
            rows: t.shape[0],
            cols: t.shape[1],
            data: WeightData::F32(w.to_f32(t)),
            bias,
        }
    }

    /// bf16 weights read in place by the bf16 kernel (`bf16`), else f32 values owned (packed
    /// for the AVX-512F kernel where there is one).
    fn prepare(w: &Weights, t: &TensorInfo, bias: Option<Vec<f32>>, bf16: bool) -> Self {
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let data = if bf16 {
            WeightData::MappedBf16(t.clone())
        } else if panels::available() {
            WeightData::Panels(Panels::pack(&w.to_f32(t), rows, cols))
        } else {
            WeightData::F32(w.to_f32(t))
        };
        Self {
            rows,
            cols,
            data,
            bias,
        }
    }

    /// Bytes this layer adds to the process beyond the mapped file.
    pub fn owned_bytes(&self) -> u64 {
        match &self.data {
            WeightData::MappedBf16(_) => 0,
            WeightData::F32(v) => (v.len() * 4) as u64,
            WeightData::Panels(p) => p.bytes(),
        }
    }

    /// `y[m][rows] = x[m][cols] · Wᵀ (+ bias)`.
    pub fn forward(&self, w: &Weights, x: &[f32], m: usize, y: &mut [f32], scratch: &mut Vec<u16>) {
        debug_assert_eq!(x.len(), m * self.cols);
        debug_assert_eq!(y.len(), m * self.rows);
        if m == 0 {
            return;
        }
        match &self.data {
            WeightData::MappedBf16(t) => {
                #[cfg(target_arch = "x86_64")]
                {
                    let bytes = w.bytes(t);
                    to_bf16(x, scratch);
                    bf16::matmul(scratch, bytes, m, self.rows, self.cols, y);
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    let _ = (w, t, scratch);
                    unreachable!("bf16 weights are converted at load without the kernel");
                }
            }
            WeightData::Panels(p) => p.matmul(x, m, y),
            WeightData::F32(wf) if m <= SMALL_M => small_m(x, wf, m, self.rows, self.cols, y),
            WeightData::F32(wf) => {
                let threads = rayon::current_num_threads();
                // SAFETY: the pointers cover x (m x cols), W (rows x cols) and y (m x rows)
                // as checked above; W is read as its transpose through the strides.
                unsafe {
                    gemm::gemm(
                        m,
                        self.rows,
                        self.cols,
                        y.as_mut_ptr(),
                        1,
                        self.rows as isize,
                        false,
                        x.as_ptr(),
                        1,
                        self.cols as isize,
                        wf.as_ptr(),
                        self.cols as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        if threads > 1 {
                            gemm::Parallelism::Rayon(threads)
                        } else {
                            gemm::Parallelism::None
                        },
                    );
                }
            }
        }
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.rows) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
    }
}

/// Round f32 to bf16 (nearest even), as ggml does before its bf16 dot products.
pub fn to_bf16(x: &[f32], out: &mut Vec<u16>) {
    out.clear();
    out.extend(x.iter().map(|&v| half::bf16::from_f32(v).to_bits()));
}

#[cfg(target_arch = "x86_64")]
mod bf16 {
    use std::arch::x86_64::*;

    use super::*;

    /// Output rows (weight rows) per tile and input rows (tokens) per tile.
    const NR: usize = 4;
    const MR: usize = 4;
    /// Tokens per block: the block's activations stay in L2 while the weights stream past.
    const MB: usize = 64;

    /// A pointer shared by the worker threads; each writes a disjoint set of columns.
    #[derive(Clone, Copy)]
    struct Out(*mut f32);
    // SAFETY: the tasks below write disjoint output columns (each its own range of weight
    // rows), so sharing the base pointer across threads cannot race.
    unsafe impl Send for Out {}
    // SAFETY: as above.
    unsafe impl Sync for Out {}

    pub fn matmul(x: &[u16], w: &[u8], m: usize, n: usize, k: usize, y: &mut [f32]) {
        assert!(x.len() >= m * k && w.len() >= n * k * 2 && y.len() >= m * n);
        let out = Out(y.as_mut_ptr());
        let avx512 = has_avx512_bf16();
        let tiles = n.div_ceil(NR);
        let threads = rayon::current_num_threads().max(1);
        // A few tasks per thread evens out uneven progress; at least 16 tiles each.
        let per_task = tiles.div_ceil(threads * 4).max(16.min(tiles));
        let tasks = tiles.div_ceil(per_task);
        (0..tasks).into_par_iter().for_each(|task| {
            let t0 = task * per_task;
            let t1 = (t0 + per_task).min(tiles);
            let mut m0 = 0;
            while m0 < m {
                let m1 = (m0 + MB).min(m);
                for tile in t0..t1 {
                    let n0 = tile * NR;
                    let nr = NR.min(n - n0);
                    let mut i = m0;
                    while i < m1 {
                        let mr = MR.min(m1 - i);
                        // SAFETY: rows i..i+mr of x and n0..n0+nr of w lie inside the slices
                        // (asserted above); the CPU has AVX-512 BF16 when `avx512`, else AVX2
                        // and FMA (`has_bf16_kernel`, the only way weights stay bf16); this
                        // task alone writes columns n0..n0+nr.
                        unsafe { dispatch(avx512, x, w, k, n, i, mr, n0, nr, out) };
                        i += mr;
                    }
                }
                m0 = m1;
            }
        });
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn dispatch(
        avx512: bool,
        x: &[u16],
        w: &[u8],
        k: usize,
        n: usize,
        i: usize,
        mr: usize,
        n0: usize,
        nr: usize,
        out: Out,
    ) {
        macro_rules! go {
            ($mr:literal, $nr:literal) => {
                // SAFETY: forwarded from the caller, which checked the CPU's features.
                unsafe {
                    if avx512 {
                        tile::<$mr, $nr>(x, w, k, n, i, n0, out)
                    } else {
                        tile_avx2::<$mr, $nr>(x, w, k, n, i, n0, out)
                    }
                }
            };
        }
        match (mr, nr) {
            (4, 4) => go!(4, 4),
            (4, 3) => go!(4, 3),
            (4, 2) => go!(4, 2),
            (4, 1) => go!(4, 1),
            (3, 4) => go!(3, 4),
            (3, 3) => go!(3, 3),
            (3, 2) => go!(3, 2),
            (3, 1) => go!(3, 1),
            (2, 4) => go!(2, 4),
            (2, 3) => go!(2, 3),
            (2, 2) => go!(2, 2),
            (2, 1) => go!(2, 1),
            (1, 4) => go!(1, 4),
            (1, 3) => go!(1, 3),
            (1, 2) => go!(1, 2),
            _ => go!(1, 1),
        }
    }

    /// `MR x NR` dot products of length `k`: token rows `i..i+MR` against weight rows
    /// `n0..n0+NR`. One accumulator per output element, 32 bf16 pairs per step, the tail
    /// with masked loads; the same instruction sequence for an element in every tile shape.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const M: usize, const N: usize>(
        x: &[u16],
        w: &[u8],
        k: usize,
        n: usize,
        i: usize,
        n0: usize,
        out: Out,
    ) {
        let xp = x.as_ptr();
        let wp = w.as_ptr().cast::<u16>();
        let mut acc = [[_mm512_setzero_ps(); N]; M];
        let mut kk = 0;
        // SAFETY: (the whole body) every load reads inside row r of x (`(i+r)*k + kk .. + 32 <=
        // (i+r+1)*k`) or of w, whose bounds the caller asserted; the masked tail loads touch
        // only the `k - kk` remaining elements; stores go to y[(i+r)*n + n0 + c], inside y.
        // Prefetch addresses may lie past w (the last tiles): they are formed with
        // `wrapping_add` and a prefetch never faults or reads into the program.
        unsafe {
            while kk + 32 <= k {
                for c in 0..N {
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add((n0 + c + 2 * N) * k + kk).cast());
                }
                let mut wv = [std::mem::zeroed::<__m512bh>(); N];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_epi16(
                        wp.add((n0 + c) * k + kk).cast(),
                    ));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_epi16(
                        xp.add((i + r) * k + kk).cast(),
                    ));
                    for (a, v) in row.iter_mut().zip(&wv) {
                        *a = _mm512_dpbf16_ps(*a, xv, *v);
                    }
                }
                kk += 32;
            }
            if kk < k {
                let mask: __mmask32 = (1u32 << (k - kk)) - 1;
                let mut wv = [std::mem::zeroed::<__m512bh>(); N];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(
                        mask,
                        wp.add((n0 + c) * k + kk).cast(),
                    ));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(
                        mask,
                        xp.add((i + r) * k + kk).cast(),
                    ));
                    for (a, v) in row.iter_mut().zip(&wv) {
                        *a = _mm512_dpbf16_ps(*a, xv, *v);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (c, a) in row.iter().enumerate() {
                    *out.0.add((i + r) * n + n0 + c) = _mm512_reduce_add_ps(*a);
                }
            }
        }
    }

    /// Horizontal sum of 8 lanes, in a fixed order.
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// The AVX2 kernel: `MR x NR` dot products of bf16 rows, 8 pairs per step, each bf16
    /// widened to f32 in registers (a bf16 is the top half of an f32) and multiplied-added
    /// with FMA; the tail in scalar code. Like the AVX-512 kernel, an element gets the same
    /// instruction sequence in every tile shape, so results do not depend on the batch.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_avx2<const M: usize, const N: usize>(
        x: &[u16],
        w: &[u8],
        k: usize,
        n: usize,
        i: usize,
        n0: usize,
        out: Out,
    ) {
        let xp = x.as_ptr();
        let wp = w.as_ptr().cast::<u16>();
        let mut acc = [[_mm256_setzero_ps(); N]; M];
        let mut kk = 0;
        // SAFETY: (the whole body) every 8-wide load reads inside row r of x
        // (`(i+r)*k + kk + 8 <= (i+r+1)*k`) or of w, whose bounds the caller asserted; the
        // tail reads the remaining `k - kk` elements one by one; stores go to
        // y[(i+r)*n + n0 + c], inside y. Prefetch addresses may lie past w: formed with
        // `wrapping_add`, and a prefetch never faults.
        unsafe {
            // A macro, not a closure: the intrinsics stay inside this AVX2 function.
            macro_rules! widen {
                ($p:expr) => {
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                        _mm_loadu_si128($p.cast()),
                    )))
                };
            }
            while kk + 8 <= k {
                // The same rows two tiles ahead, one cache line per row every 32 elements:
                // a tile's rows are short (k x 2 bytes) and read side by side, too short for
                // the hardware prefetcher to pick up on its own.
                if kk % 32 == 0 {
                    for c in 0..N {
                        _mm_prefetch::<_MM_HINT_T0>(
                            wp.wrapping_add((n0 + c + 2 * N) * k + kk).cast(),
                        );
                    }
                }
                let mut wv = [_mm256_setzero_ps(); N];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = widen!(wp.add((n0 + c) * k + kk));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = widen!(xp.add((i + r) * k + kk));
                    for (a, v) in row.iter_mut().zip(&wv) {
                        *a = _mm256_fmadd_ps(xv, *v, *a);
                    }
                }
                kk += 8;
            }
            let f = |b: u16| f32::from_bits(u32::from(b) << 16);
            for (r, row) in acc.iter().enumerate() {
                for (c, a) in row.iter().enumerate() {
                    let mut sum = hsum(*a);
                    for j in kk..k {
                        sum += f(*xp.add((i + r) * k + j)) * f(*wp.add((n0 + c) * k + j));
                    }
                    *out.0.add((i + r) * n + n0 + c) = sum;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bf16_kernel_matches_a_plain_dot_product_for_every_tile_shape() {
        // Every x86-64 machine this runs on has AVX2 and FMA at least: the test checks the
        // kernel this CPU uses (named in the failure message).
        assert!(
            has_bf16_kernel(),
            "this CPU has neither AVX-512 BF16 nor AVX2+FMA: the bf16 kernel cannot be checked"
        );
        let kernel = bf16_kernel_name();
        for (m, n, k) in [(1, 1, 7), (3, 5, 40), (9, 13, 64), (70, 6, 100)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
                .collect();
            let wv: Vec<u16> = (0..n * k)
                .map(|i| half::bf16::from_f32(((i * 5 % 11) as f32 - 5.0) / 4.0).to_bits())
                .collect();
            let bytes: Vec<u8> = wv.iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut xb = Vec::new();
            to_bf16(&x, &mut xb);
            let mut y = vec![0.0; m * n];
            #[cfg(target_arch = "x86_64")]
            bf16::matmul(&xb, &bytes, m, n, k, &mut y);
            for r in 0..m {
                for c in 0..n {
                    let want: f32 = (0..k)
                        .map(|j| {
                            half::bf16::from_bits(xb[r * k + j]).to_f32()
                                * half::bf16::from_bits(wv[c * k + j]).to_f32()
                        })
                        .sum();
                    assert!(
                        (y[r * n + c] - want).abs() < 1e-3,
                        "{kernel}: {m}x{n}x{k} at {r},{c}"
                    );
                }
            }
            // Row 0 alone gives the same bits as row 0 in the batch.
            let mut y1 = vec![0.0; n];
            #[cfg(target_arch = "x86_64")]
            bf16::matmul(&xb[..k], &bytes, 1, n, k, &mut y1);
            assert_eq!(y1, y[..n].to_vec());
        }
    }
}
