//! Native engine, CUDA backend, in the step: the matrix products on cuBLAS (`cublasGemmEx`).
//!
//! Weights are read in their dtype (bf16/f16 by the tensor cores, f32 as plain fp32) with f32
//! accumulation and f32 output; the input activations are already in the weights' type (the
//! kernel before each product writes them so). cuBLAS gets a workspace of its own at load, so
//! a product allocates nothing and can be captured in a CUDA graph.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use gantry_engine_abi::{EngineError, Status};

use super::upload::DevLinear;
use super::{cuda_err, int};
use crate::weights::DType;

/// cuBLAS's workspace (the size PyTorch gives it on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

pub(super) struct Gemm {
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
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
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, EngineError> {
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
        })
    }

    /// `y[m][rows] = x[m][cols] · Wᵀ` (bias excluded: the kernel after the product adds it),
    /// with x in W's dtype at device address `x` and y f32 at `y`. cuBLAS is column-major: this
    /// is `yᵀ = W · xᵀ` with W read transposed (`[rows, cols]` row-major is `cols x rows`).
    pub fn run(&self, l: &DevLinear, x: u64, m: usize, y: u64) -> Result<(), EngineError> {
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
}
