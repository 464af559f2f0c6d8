//! Native engine, CUDA backend, at load: whether CUDA can run here, and the kernels compiled
//! by NVRTC for the device's architecture (cached per architecture for the process) and
//! loaded into the backend's context ([`Kernels`]).
//!
//! Every CUDA library is loaded at run time (`dynamic-loading`): the plugin builds and loads on
//! machines without CUDA, and [`unavailable`] says why a CUDA backend cannot run here, which the
//! engine turns into a clear refusal (`backend: cuda unavailable: ...`).

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use gantry_engine_abi::{EngineError, Status};

use super::cuda_err;

/// The kernels' source, one NVRTC program: the shared prelude, then the files by job.
pub const KERNELS: &str = concat!(
    include_str!("kernels/common.cuh"),
    include_str!("kernels/layer.cu"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/gemv.cu"),
    include_str!("kernels/sample.cu"),
);

/// Every kernel the program defines (the backend loads each by name).
pub const KERNEL_NAMES: [&str; 11] = [
    "embed_norm",
    "residual_norm",
    "qkv_rope_store",
    "gated_act",
    "gather_rows",
    "softcap",
    "copy_u16",
    "attention_tiled",
    "gemv1",
    "gemv2",
    "sample",
];

/// Run `f`, turning a panic of cudarc's loader (a CUDA library that cannot be opened) into an
/// error line.
pub(super) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_else(|| "panicked".into());
        Err(format!("{what}: {msg}"))
    })
}

/// Why the CUDA backend cannot run on this machine, or `None` when it can: a driver with at
/// least one device, cuBLAS and NVRTC.
pub fn unavailable() -> Option<String> {
    guarded("CUDA probe", || {
        // SAFETY: each probe only tries to open the library by its candidate names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("no CUDA driver (libcuda.so not found)".into());
        }
        match CudaContext::device_count() {
            Ok(0) => return Err("no CUDA device".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("CUDA driver: {e}")),
        }
        // SAFETY: as above.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(
                "cuBLAS not found (libcublas.so.12 beside the plugin or on the library path)"
                    .into(),
            );
        }
        nvrtc_present()?;
        Ok(())
    })
    .err()
}

fn nvrtc_present() -> Result<(), String> {
    // SAFETY: only tries to open the library by its candidate names.
    if unsafe { nvrtc_sys::is_culib_present() } {
        Ok(())
    } else {
        Err("NVRTC not found (libnvrtc.so.12 beside the plugin or on the library path)".into())
    }
}

/// Compile the kernels to a cubin for `sm_<major><minor>` with NVRTC. A cubin, not PTX: the
/// driver loads it without a JIT step, so a driver older than this NVRTC still runs it.
pub fn compile(major: i32, minor: i32) -> Result<Vec<u8>, String> {
    guarded("NVRTC", || {
        nvrtc_present()?;
        let src = CString::new(KERNELS).map_err(|e| e.to_string())?;
        let name = c"gantry_native_kernels.cu";
        let prog = nvrtc::create_program(&src, Some(name)).map_err(|e| e.to_string())?;
        let opts = [
            format!("--gpu-architecture=sm_{major}{minor}"),
            "--std=c++17".to_string(),
        ];
        // SAFETY: `prog` was created above and is destroyed once below.
        let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
        let result = match compiled {
            Ok(()) => cubin_of(prog),
            Err(e) => {
                // SAFETY: as above.
                let log = unsafe { nvrtc::get_program_log(prog) }.unwrap_or_default();
                // SAFETY: the log is NUL-terminated by NVRTC.
                let log = unsafe { CStr::from_ptr(log.as_ptr()) }.to_string_lossy();
                Err(format!(
                    "compiling the kernels for sm_{major}{minor}: {e}: {log}"
                ))
            }
        };
        // SAFETY: as above.
        let _ = unsafe { nvrtc::destroy_program(prog) };
        result
    })
}

fn cubin_of(prog: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; NVRTC writes the size, then that many bytes.
    unsafe {
        nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| e.to_string())?;
        let mut buf = vec![0u8; size];
        nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
            .result()
            .map_err(|e| e.to_string())?;
        Ok(buf)
    }
}

/// Compiled kernels by (major, minor) architecture.
type CubinCache = Mutex<HashMap<(i32, i32), Arc<Vec<u8>>>>;

/// Compiled kernels by architecture, for the process (one NVRTC run per architecture).
pub(super) fn cubin_for(major: i32, minor: i32) -> Result<Arc<Vec<u8>>, String> {
    static CACHE: OnceLock<CubinCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(c) = cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(major, minor))
    {
        return Ok(Arc::clone(c));
    }
    let c = Arc::new(compile(major, minor)?);
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert((major, minor), Arc::clone(&c));
    Ok(c)
}

/// The kernels a backend launches, loaded into its context.
pub(super) struct Kernels {
    pub embed_norm: CudaFunction,
    pub residual_norm: CudaFunction,
    pub qkv_rope_store: CudaFunction,
    pub gated_act: CudaFunction,
    pub gather_rows: CudaFunction,
    pub softcap: CudaFunction,
    pub copy_u16: CudaFunction,
    /// `attention_tiled` (`attend.rs`).
    pub attention: CudaFunction,
    pub sample: CudaFunction,
    /// `gemv1`, `gemv2` (`gemm.rs`).
    pub gemv: [CudaFunction; super::gemm::GEMV_MAX],
}

impl Kernels {
    /// The kernels for `arch` (compiled once per process) loaded into `ctx`.
    pub(super) fn load(ctx: &Arc<CudaContext>, arch: (i32, i32)) -> Result<Self, EngineError> {
        let cubin =
            cubin_for(arch.0, arch.1).map_err(|e| EngineError::new(Status::LoadFailed, e))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.as_ref().clone()))
            .map_err(cuda_err("loading the kernels"))?;
        let f = |name: &str| module.load_function(name).map_err(cuda_err("kernel"));
        Ok(Self {
            embed_norm: f("embed_norm")?,
            residual_norm: f("residual_norm")?,
            qkv_rope_store: f("qkv_rope_store")?,
            gated_act: f("gated_act")?,
            gather_rows: f("gather_rows")?,
            softcap: f("softcap")?,
            copy_u16: f("copy_u16")?,
            attention: f("attention_tiled")?,
            sample: f("sample")?,
            gemv: [f("gemv1")?, f("gemv2")?],
        })
    }
}
