//! Native engine, CUDA backend, in the step: the matrix products, on cuBLAS (`cublasGemmEx`)
//! or, for decode steps of a few tokens over 16-bit weights, on the `gemv` kernel
//! (`kernels/gemv.cu`).
//!
//! Weights are read in their dtype (bf16/f16 by the tensor cores, f32 as plain fp32) with f32
//! accumulation and f32 output; the input activations are already in the weights' type (the
//! kernel before each product writes them so). cuBLAS gets a workspace of its own at load, so
//! a product allocates nothing and can be captured in a CUDA graph.
//!
//! With one or two tokens a product is a read of the weights and little arithmetic, and
//! cuBLAS's kernels for it read them at 2.0–3.9 TB/s on an H200 (`docs/benchmarks.md`);
//! `gemv` keeps eight 16-byte loads of weights per lane in flight, and splits the columns of a
//! product with few rows over several warps ([`gemv_split`]). `GANTRY_NATIVE_CUDA_GEMV` sets
//! the most tokens it takes (default [`GEMV_MAX`], 0: cuBLAS for every product) and
//! `GANTRY_NATIVE_CUDA_GEMV_SPLIT` (1, 2 or 4) fixes the split, for comparisons.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use gantry_engine_abi::{EngineError, Status};

use super::upload::DevLinear;
use super::{cuda_err, int};
use crate::weights::DType;

/// cuBLAS's workspace (the size PyTorch gives it on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// The most tokens `gemv` takes (its largest instance, `gemv2`): from four tokens on, cuBLAS's
/// products were faster on an H200 (`docs/benchmarks.md`), and eight-token instances of this
/// kernel lost to them by a quarter.
pub const GEMV_MAX: usize = 2;
/// Warps per block of `gemv`, and rows of W per warp (`GEMV_ROWS`).
const GEMV_WARPS: u32 = 4;
const GEMV_ROWS: usize = 4;

pub(super) struct Gemm {
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    /// `gemv1`, `gemv2` (`kernels/gemv.cu`): the instance for `m` tokens is `gemv[m - 1]`.
    gemv: [CudaFunction; GEMV_MAX],
    /// Products of at most this many tokens go to `gemv` (0: none).
    gemv_max: usize,
    /// Multiprocessors of the device (how far `gemv` splits a product's columns).
    sms: usize,
    /// `GANTRY_NATIVE_CUDA_GEMV_SPLIT`: the split of every product, instead of [`gemv_split`].
    split_override: Option<usize>,
}

/// Warps of a `gemv` block that share its rows (1, 2 or [`GEMV_WARPS`]): enough warps over
/// the product that every multiprocessor has at least 16 issuing weight loads (an H200 reads at
/// its bandwidth only with that many bytes in flight), without splitting a product whose rows
/// already give that many.
pub(super) fn gemv_split(rows: usize, sms: usize) -> usize {
    let warps = rows.div_ceil(GEMV_ROWS);
    let want = 16 * sms;
    if warps >= want {
        1
    } else if 2 * warps >= want {
        2
    } else {
        GEMV_WARPS as usize
    }
}

/// `GANTRY_NATIVE_CUDA_GEMV`: the most tokens `gemv` takes, at most [`GEMV_MAX`].
fn gemv_max_from_env() -> usize {
    std::env::var("GANTRY_NATIVE_CUDA_GEMV")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(GEMV_MAX, |v| v.min(GEMV_MAX))
}

fn data_type(d: DType) -> blas_sys::cudaDataType {
    use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
    match d {
        DType::F32 => CUDA_R_32F,
        DType::F16 => CUDA_R_16F,
        DType::Bf16 => CUDA_R_16BF,
    }
}

impl Gemm {
    pub fn new(
        stream: &Arc<CudaStream>,
        gemv: [CudaFunction; GEMV_MAX],
        sms: usize,
    ) -> Result<Self, EngineError> {
        let blas = CudaBlas::new(Arc::clone(stream))
            .map_err(|e| EngineError::new(Status::LoadFailed, format!("cuBLAS: {e}")))?;
        let mut workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(cuda_err("cuBLAS workspace"))?;
        {
            let (wp, _g) = workspace.device_ptr_mut(stream);
            // SAFETY: the workspace outlives the handle's use of it (both live in `Gemm`, the
            // handle is dropped first as fields drop in order).
            unsafe {
                blas_sys::cublasSetWorkspace_v2(*blas.handle(), wp as *mut c_void, WORKSPACE_BYTES)
            }
            .result()
            .map_err(|e| EngineError::new(Status::LoadFailed, format!("cuBLAS workspace: {e}")))?;
        }
        Ok(Self {
            blas,
            _workspace: workspace,
            stream: Arc::clone(stream),
            gemv,
            gemv_max: gemv_max_from_env(),
            sms,
            split_override: std::env::var("GANTRY_NATIVE_CUDA_GEMV_SPLIT")
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|v| [1, 2, GEMV_WARPS as usize].contains(v)),
        })
    }

    /// The most tokens a product runs on `gemv` for (0: none).
    pub fn gemv_max(&self) -> usize {
        self.gemv_max
    }

    /// `y[m][rows] = x[m][cols] · Wᵀ` (bias excluded: the kernel after the product adds it),
    /// with x in W's dtype at device address `x` and y f32 at `y`. cuBLAS is column-major: this
    /// is `yᵀ = W · xᵀ` with W read transposed (`[rows, cols]` row-major is `cols x rows`).
    pub fn run(&self, l: &DevLinear, x: u64, m: usize, y: u64) -> Result<(), EngineError> {
        if m <= self.gemv_max && l.dtype != DType::F32 && l.cols.is_multiple_of(8) {
            return self.run_gemv(l, x, m, y);
        }
        let t = data_type(l.dtype);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _w) = l.w.device_ptr(&self.stream);
        // SAFETY: W holds rows x cols values of its dtype, x at least m x cols of the same
        // type and y m x rows f32 (the step's buffers are sized for the largest m); the
        // handle is bound to the backend's one stream, which orders the product.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                int(l.rows)?,
                int(m)?,
                int(l.cols)?,
                (&alpha as *const f32).cast::<c_void>(),
                wp as *const c_void,
                t,
                int(l.cols)?,
                x as *const c_void,
                t,
                int(l.cols)?,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                int(l.rows)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| EngineError::internal(format!("cuBLAS product: {e}")))
    }

    /// The product on `gemv`: the instance for `m` tokens (at most [`GEMV_MAX`], as `run`
    /// checks), `split` warps per GEMV_ROWS rows of W.
    fn run_gemv(&self, l: &DevLinear, x: u64, m: usize, y: u64) -> Result<(), EngineError> {
        let (rows, cols, m32) = (int(l.rows)?, int(l.cols)?, int(m)?);
        let dt: i32 = if l.dtype == DType::F16 { 1 } else { 2 };
        let (wp, _w) = l.w.device_ptr(&self.stream);
        let split = self
            .split_override
            .unwrap_or_else(|| gemv_split(l.rows, self.sms));
        let split32 = int(split)?;
        let per_block = GEMV_WARPS as usize / split * GEMV_ROWS;
        let cfg = LaunchConfig {
            grid_dim: (l.rows.div_ceil(per_block) as u32, 1, 1),
            block_dim: (GEMV_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut lb = self.stream.launch_builder(&self.gemv[m.max(1) - 1]);
        lb.arg(&wp)
            .arg(&x)
            .arg(&y)
            .arg(&rows)
            .arg(&cols)
            .arg(&m32)
            .arg(&dt)
            .arg(&split32);
        // SAFETY: W holds rows x cols 16-bit values in its own allocation (16-byte aligned,
        // and cols a multiple of 8 keeps every row so), x at least m x cols of the same type
        // at the start of a step buffer, y m x rows f32; m <= the instance's token count;
        // split divides the block's GEMV_WARPS warps.
        unsafe { lb.launch(cfg) }.map_err(cuda_err("gemv"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_splits_only_products_with_too_few_rows() {
        // 132 multiprocessors; Llama 3 8B's products: QKV 6,144 rows, output and down
        // 4,096, gate/up 28,672.
        assert_eq!(gemv_split(28_672, 132), 1);
        assert_eq!(gemv_split(6_144, 132), 2);
        assert_eq!(gemv_split(4_096, 132), 4);
        // Gemma 3 270M's output projection (640 rows) and its 262,144-row head.
        assert_eq!(gemv_split(640, 132), 4);
        assert_eq!(gemv_split(262_144, 132), 1);
    }
}
