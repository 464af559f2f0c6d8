//! Native engine, CUDA backend (below the step's bookkeeping, beside [`crate::cpu`]): the same
//! forward pass as the CPU backend on one NVIDIA GPU, through `cudarc`.
//!
//! - The linear layers are cuBLAS products (`cublasGemmEx`): weights stay in their checkpoint
//!   dtype in device memory (bf16/f16 read by the tensor cores with f32 accumulation, f32 as
//!   plain fp32), and the activations are rounded to that dtype first, as the CPU bf16 kernel
//!   and llama.cpp do.
//! - Everything else (embedding, RMSNorm, RoPE, the K/V append, paged attention, SiLU/GELU,
//!   soft-capping) is `kernels.cu`, compiled by NVRTC at load for the device's architecture
//!   (cached per architecture for the process).
//! - The K/V cache is the same block layout as on the CPU (`[cell][kv head][head_dim]`, f32),
//!   so the step's bookkeeping (`kv.rs`) is shared unchanged.
//!
//! Every CUDA library is loaded at run time (`dynamic-loading`): the plugin builds and loads on
//! machines without CUDA, and [`unavailable`] says why a CUDA backend cannot run here, which the
//! engine turns into a clear refusal (`backend: cuda unavailable: ...`).

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use gantry_engine_abi::{EngineError, Status};

use crate::backend::{Backend, StepInput, TensorLoader, load_stack};
use crate::config::{Activation, ModelConfig};
use crate::kv::BlockCopy;
use crate::weights::{DType, TensorInfo, Weights};

/// The kernels' source, compiled by NVRTC at load.
pub const KERNELS: &str = include_str!("kernels.cu");

/// Every kernel `kernels.cu` defines (the backend loads each by name).
pub const KERNEL_NAMES: [&str; 14] = [
    "embed",
    "rms_norm",
    "rope",
    "kv_store",
    "copy_range",
    "attention",
    "silu_mul",
    "gelu_tanh_mul",
    "add",
    "add_bias",
    "softcap",
    "gather_rows",
    "to_bf16",
    "to_f16",
];

/// The largest head the attention kernel holds in registers (8 values per lane).
pub const MAX_HEAD_DIM: usize = 256;

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// Threads per block of attention: 8 warps share a token's span.
const ATTN_THREADS: u32 = 256;

/// Run `f`, turning a panic of cudarc's loader (a CUDA library that cannot be opened) into an
/// error line.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
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

/// Compile `kernels.cu` to a cubin for `sm_<major><minor>` with NVRTC. A cubin, not PTX: the
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
fn cubin_for(major: i32, minor: i32) -> Result<Arc<Vec<u8>>, String> {
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

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> EngineError + '_ {
    move |e| {
        let status = if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            Status::OomVram
        } else {
            Status::Internal
        };
        EngineError::new(status, format!("CUDA, {what}: {e}"))
    }
}

/// An i32 kernel argument, checked.
fn int(n: usize) -> Result<i32, EngineError> {
    i32::try_from(n).map_err(|_| EngineError::unsupported(format!("{n} is too large for a kernel")))
}

/// Grid-stride launch over `n` elements.
fn flat(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 4096) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

struct Kernels {
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    kv_store: CudaFunction,
    copy_range: CudaFunction,
    attention: CudaFunction,
    silu_mul: CudaFunction,
    gelu_tanh_mul: CudaFunction,
    add: CudaFunction,
    add_bias: CudaFunction,
    softcap: CudaFunction,
    gather_rows: CudaFunction,
    to_bf16: CudaFunction,
    to_f16: CudaFunction,
}

/// dtype code of the kernels (`load_f32`).
fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
    }
}

/// A weight matrix `[rows, cols]` in device memory, in its checkpoint dtype.
struct DevLinear {
    rows: usize,
    cols: usize,
    dtype: DType,
    w: CudaSlice<u8>,
    bias: Option<CudaSlice<f32>>,
}

type Layer = crate::backend::Layer<CudaSlice<f32>, DevLinear>;

struct LayerKv {
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
}

pub struct CudaBackend {
    cfg: ModelConfig,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    device_name: String,
    arch: (i32, i32),
    embed: DevLinear,
    /// `None`: the output projection is the embedding table (tied).
    lm_head: Option<DevLinear>,
    layers: Vec<Layer>,
    final_norm: CudaSlice<f32>,
    /// Inverse frequencies and cos/sin factor of each rotary setting.
    ropes: Vec<(CudaSlice<f32>, f32)>,
    kv: Vec<LayerKv>,
    block_size: usize,
    /// Device bytes this model holds (weights, norms, KV cache).
    bytes: u64,
    /// A KV block copy that failed, reported by the next forward.
    copy_failed: Option<String>,
}

/// Uploads with shape checks; errors name the tensor. Counts the bytes it allocates.
struct Uploader<'a> {
    w: &'a Weights,
    stream: &'a Arc<CudaStream>,
    bytes: u64,
}

impl Uploader<'_> {
    fn f32s(&mut self, v: &[f32], what: &str) -> Result<CudaSlice<f32>, EngineError> {
        self.bytes += (v.len() * 4) as u64;
        self.stream.clone_htod(v).map_err(cuda_err(what))
    }

    fn matrix(&mut self, name: &str, t: &TensorInfo) -> Result<DevLinear, EngineError> {
        let bytes = self.w.bytes(t);
        self.bytes += bytes.len() as u64;
        Ok(DevLinear {
            rows: t.shape[0],
            cols: t.shape[1],
            dtype: t.dtype,
            w: self.stream.clone_htod(bytes).map_err(cuda_err(name))?,
            bias: None,
        })
    }
}

impl TensorLoader for Uploader<'_> {
    type Vec = CudaSlice<f32>;
    type Linear = DevLinear;

    fn vec(&mut self, name: &str, len: usize) -> Result<CudaSlice<f32>, EngineError> {
        let t = self.w.expect(name, &[len])?;
        let v = self.w.to_f32(t);
        self.f32s(&v, name)
    }

    fn linear(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<DevLinear, EngineError> {
        let wname = format!("{name}.weight");
        let t = self.w.expect(&wname, &[rows, cols])?;
        let mut l = self.matrix(&wname, t)?;
        if bias {
            l.bias = Some(self.vec(&format!("{name}.bias"), rows)?);
        }
        Ok(l)
    }
}

/// Scratch of one step.
struct Bufs {
    x: CudaSlice<f32>,
    hbuf: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    o: CudaSlice<f32>,
    g: CudaSlice<f32>,
    u: CudaSlice<f32>,
    /// Activations rounded to 16 bits for the products.
    half: CudaSlice<u16>,
}

/// The step's per-token indices on the device.
struct Index {
    tokens: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    cells: CudaSlice<i32>,
    seq_of: CudaSlice<i32>,
    table_off: CudaSlice<i32>,
    tables: CudaSlice<u32>,
    rows: CudaSlice<i32>,
}

impl CudaBackend {
    /// Put the model on device `ordinal`: compile the kernels, upload the weights in their
    /// dtype, allocate the KV cache. Refuses before allocating when the device's free memory
    /// cannot hold weights and cache.
    pub fn new(
        cfg: &ModelConfig,
        weights: &Weights,
        n_blocks: usize,
        block_size: usize,
        ordinal: usize,
    ) -> Result<Self, EngineError> {
        if let Some(why) = unavailable() {
            return Err(EngineError::unsupported(format!(
                "backend: cuda unavailable: {why}"
            )));
        }
        let (h, hd, nkv) = (cfg.hidden, cfg.head_dim, cfg.n_kv_heads);
        if hd > MAX_HEAD_DIM || hd % 2 != 0 {
            return Err(EngineError::unsupported(format!(
                "head_dim {hd}: the CUDA attention kernel takes even head sizes up to {MAX_HEAD_DIM}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("opening the device"))?;
        let device_name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        let arch = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        let stream = ctx.new_stream().map_err(cuda_err("stream"))?;
        // SAFETY: the backend uses this one stream for every operation, in order, so
        // cudarc's cross-stream events are not needed.
        unsafe { ctx.disable_event_tracking() };

        let cells = n_blocks * block_size * nkv * hd;
        let kv_bytes = (cells * 2 * 4 * cfg.n_layers) as u64;
        let (free, total) = ctx.mem_get_info().map_err(cuda_err("memory info"))?;
        let need = weights.mapped_bytes() + kv_bytes;
        if need > free as u64 {
            return Err(EngineError::new(
                Status::OomVram,
                format!(
                    "the model needs ~{need} bytes on {device_name} (weights {} + KV {kv_bytes}); {free} of {total} are free",
                    weights.mapped_bytes()
                ),
            ));
        }

        let cubin =
            cubin_for(arch.0, arch.1).map_err(|e| EngineError::new(Status::LoadFailed, e))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.as_ref().clone()))
            .map_err(cuda_err("loading the kernels"))?;
        let f = |name: &str| module.load_function(name).map_err(cuda_err("kernel"));
        let k = Kernels {
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            kv_store: f("kv_store")?,
            copy_range: f("copy_range")?,
            attention: f("attention")?,
            silu_mul: f("silu_mul")?,
            gelu_tanh_mul: f("gelu_tanh_mul")?,
            add: f("add")?,
            add_bias: f("add_bias")?,
            softcap: f("softcap")?,
            gather_rows: f("gather_rows")?,
            to_bf16: f("to_bf16")?,
            to_f16: f("to_f16")?,
        };
        let blas = CudaBlas::new(Arc::clone(&stream))
            .map_err(|e| EngineError::new(Status::LoadFailed, format!("cuBLAS: {e}")))?;

        let mut up = Uploader {
            w: weights,
            stream: &stream,
            bytes: 0,
        };
        let et = weights.expect("model.embed_tokens.weight", &[cfg.vocab, h])?;
        let embed = up.matrix("model.embed_tokens.weight", et)?;
        let stack = load_stack(cfg, weights, &mut up)?;
        let mut ropes = Vec::with_capacity(cfg.ropes.len());
        for r in &cfg.ropes {
            let (inv, factor) = r.inv_freq(hd);
            ropes.push((up.f32s(&inv, "rotary frequencies")?, factor));
        }
        let mut kv = Vec::with_capacity(cfg.n_layers);
        for _ in 0..cfg.n_layers {
            kv.push(LayerKv {
                k: stream
                    .alloc_zeros::<f32>(cells)
                    .map_err(cuda_err("allocating the KV cache"))?,
                v: stream
                    .alloc_zeros::<f32>(cells)
                    .map_err(cuda_err("allocating the KV cache"))?,
            });
        }
        let bytes = up.bytes + kv_bytes;
        stream.synchronize().map_err(cuda_err("upload"))?;
        Ok(Self {
            cfg: cfg.clone(),
            ctx,
            stream,
            blas,
            k,
            device_name,
            arch,
            embed,
            lm_head: stack.lm_head,
            layers: stack.layers,
            final_norm: stack.final_norm,
            ropes,
            kv,
            block_size,
            bytes,
            copy_failed: None,
        })
    }

    /// `y[m][rows] = x[m][cols] · Wᵀ (+ bias)` on cuBLAS: column-major, that is
    /// `yᵀ = W · xᵀ` with W read transposed (`[rows, cols]` row-major is `cols x rows`).
    fn linear(
        &self,
        l: &DevLinear,
        x: &CudaSlice<f32>,
        m: usize,
        half: &mut CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        let n_in = m * l.cols;
        let x_type = match l.dtype {
            DType::F32 => CUDA_R_32F,
            DType::Bf16 => {
                self.launch1(&self.k.to_bf16, flat(n_in), x, half, int(n_in)?)?;
                CUDA_R_16BF
            }
            DType::F16 => {
                self.launch1(&self.k.to_f16, flat(n_in), x, half, int(n_in)?)?;
                CUDA_R_16F
            }
        };
        let w_type = x_type;
        let (alpha, beta) = (1.0f32, 0.0f32);
        {
            let s = &self.stream;
            let (wp, _w) = l.w.device_ptr(s);
            let (xp, _x) = if l.dtype == DType::F32 {
                x.device_ptr(s)
            } else {
                half.device_ptr(s)
            };
            let (yp, _y) = y.device_ptr_mut(s);
            // SAFETY: W holds rows x cols values of `w_type`, the input m x cols of `x_type`,
            // y at least m x rows f32 (the caller sized it); the handle is bound to `stream`,
            // which orders the product after the conversion above.
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
                    w_type,
                    int(l.cols)?,
                    xp as *const c_void,
                    x_type,
                    int(l.cols)?,
                    (&beta as *const f32).cast::<c_void>(),
                    yp as *mut c_void,
                    CUDA_R_32F,
                    int(l.rows)?,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| EngineError::internal(format!("cuBLAS product: {e}")))?;
        }
        if let Some(b) = &l.bias {
            let n = m * l.rows;
            let mut lb = self.stream.launch_builder(&self.k.add_bias);
            let (cols, n) = (int(l.rows)?, int(n)?);
            lb.arg(&mut *y).arg(b).arg(&cols).arg(&n);
            // SAFETY: y holds m x rows values, b rows values (add_bias's contract).
            unsafe { lb.launch(flat(m * l.rows)) }.map_err(cuda_err("bias"))?;
        }
        Ok(())
    }

    /// A kernel of signature `(const float* in, T* out, int n)`.
    fn launch1<T>(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        input: &CudaSlice<f32>,
        out: &mut CudaSlice<T>,
        n: i32,
    ) -> Result<(), EngineError> {
        let mut b = self.stream.launch_builder(f);
        b.arg(input).arg(out).arg(&n);
        // SAFETY: both buffers hold at least n values (the callers' sizes).
        unsafe { b.launch(cfg) }.map_err(cuda_err("kernel"))?;
        Ok(())
    }

    /// RMSNorm of `rows` rows of `dim` from `x` into `out` (which may be the same buffer).
    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: Option<&mut CudaSlice<f32>>,
        dim: usize,
        rows: usize,
    ) -> Result<(), EngineError> {
        let (dim, n) = (int(dim)?, int(rows)?);
        let (eps, plus_one) = (self.cfg.rms_eps, i32::from(self.cfg.norm_plus_one));
        let mut b = self.stream.launch_builder(&self.k.rms_norm);
        b.arg(x).arg(w);
        match out {
            Some(o) => b.arg(o),
            None => b.arg(x),
        };
        b.arg(&dim).arg(&eps).arg(&plus_one).arg(&n);
        // SAFETY: x and out hold rows x dim values, w dim values; in place, each thread
        // rewrites only the elements it read.
        unsafe { b.launch(per_row(rows)) }.map_err(cuda_err("rms_norm"))?;
        Ok(())
    }

    /// `x += y` over n values.
    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<(), EngineError> {
        let n32 = int(n)?;
        let mut b = self.stream.launch_builder(&self.k.add);
        b.arg(x).arg(y).arg(&n32);
        // SAFETY: both hold n values.
        unsafe { b.launch(flat(n)) }.map_err(cuda_err("add"))?;
        Ok(())
    }

    fn upload_index(&self, input: &StepInput<'_>) -> Result<Index, EngineError> {
        let bs = self.block_size;
        let mut cells = Vec::with_capacity(input.tokens.len());
        for (i, &p) in input.positions.iter().enumerate() {
            let table = input.tables[input.seq_of[i]];
            cells.push(int(table[p / bs] as usize * bs + p % bs)?);
        }
        let mut table_off = Vec::with_capacity(input.tables.len());
        let mut flat_tables = Vec::new();
        for t in input.tables {
            table_off.push(int(flat_tables.len())?);
            flat_tables.extend_from_slice(t);
        }
        if flat_tables.is_empty() {
            flat_tables.push(0);
        }
        let positions = input
            .positions
            .iter()
            .map(|&p| int(p))
            .collect::<Result<Vec<_>, _>>()?;
        let seq_of = input
            .seq_of
            .iter()
            .map(|&s| int(s))
            .collect::<Result<Vec<_>, _>>()?;
        let mut rows = input
            .logits_rows
            .iter()
            .map(|&r| int(r))
            .collect::<Result<Vec<_>, _>>()?;
        if rows.is_empty() {
            rows.push(0);
        }
        let s = &self.stream;
        let up = cuda_err("step upload");
        Ok(Index {
            tokens: s.clone_htod(input.tokens).map_err(&up)?,
            positions: s.clone_htod(&positions).map_err(&up)?,
            cells: s.clone_htod(&cells).map_err(&up)?,
            seq_of: s.clone_htod(&seq_of).map_err(&up)?,
            table_off: s.clone_htod(&table_off).map_err(&up)?,
            tables: s.clone_htod(&flat_tables).map_err(&up)?,
            rows: s.clone_htod(&rows).map_err(&up)?,
        })
    }

    fn alloc_bufs(&self, t: usize) -> Result<Bufs, EngineError> {
        let c = &self.cfg;
        let (h, qd, kvd, ff) = (
            c.hidden,
            c.n_heads * c.head_dim,
            c.n_kv_heads * c.head_dim,
            c.intermediate,
        );
        let s = &self.stream;
        let e = cuda_err("step buffers");
        let widest = h.max(qd).max(ff);
        Ok(Bufs {
            x: s.alloc_zeros(t * h).map_err(&e)?,
            hbuf: s.alloc_zeros(t * h).map_err(&e)?,
            q: s.alloc_zeros(t * qd).map_err(&e)?,
            k: s.alloc_zeros(t * kvd).map_err(&e)?,
            v: s.alloc_zeros(t * kvd).map_err(&e)?,
            att: s.alloc_zeros(t * qd).map_err(&e)?,
            o: s.alloc_zeros(t * h).map_err(&e)?,
            g: s.alloc_zeros(t * ff).map_err(&e)?,
            u: s.alloc_zeros(t * ff).map_err(&e)?,
            half: s.alloc_zeros(t * widest).map_err(&e)?,
        })
    }

    fn run(&mut self, input: &StepInput<'_>) -> Result<Vec<f32>, EngineError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        let c = &self.cfg;
        let t = input.tokens.len();
        for &tok in input.tokens {
            if usize::try_from(tok).map_or(true, |id| id >= c.vocab) {
                return Err(EngineError::unsupported(format!(
                    "token id {tok} is outside the vocabulary"
                )));
            }
        }
        let (h, hd, nh, nkv) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads);
        let (kvd, ff) = (nkv * hd, c.intermediate);
        let ix = self.upload_index(input)?;
        let mut b = self.alloc_bufs(t)?;
        let (t32, h32) = (int(t)?, int(h)?);

        // Embeddings, scaled (Gemma: by sqrt(hidden)).
        {
            let dtype = dtype_code(self.embed.dtype);
            let mut lb = self.stream.launch_builder(&self.k.embed);
            lb.arg(&self.embed.w)
                .arg(&dtype)
                .arg(&ix.tokens)
                .arg(&h32)
                .arg(&c.embed_scale)
                .arg(&mut b.x)
                .arg(&t32);
            // SAFETY: every token id was checked against the vocabulary; x holds t x h.
            unsafe { lb.launch(per_row(t)) }.map_err(cuda_err("embed"))?;
        }

        let bs32 = int(self.block_size)?;
        let (nh32, nkv32, hd32, kvd32) = (int(nh)?, int(nkv)?, int(hd)?, int(kvd)?);
        for li in 0..self.layers.len() {
            let kind = &c.layers[li];
            let layer = &self.layers[li];
            self.rms_norm(&b.x, &layer.in_norm, Some(&mut b.hbuf), h, t)?;
            self.linear(&layer.q, &b.hbuf, t, &mut b.half, &mut b.q)?;
            self.linear(&layer.k, &b.hbuf, t, &mut b.half, &mut b.k)?;
            self.linear(&layer.v, &b.hbuf, t, &mut b.half, &mut b.v)?;
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                self.rms_norm(&b.q, qn, None, hd, t * nh)?;
                self.rms_norm(&b.k, kn, None, hd, t * nkv)?;
            }
            let (inv, factor) = &self.ropes[kind.rope];
            for (buf, heads) in [(&mut b.q, nh32), (&mut b.k, nkv32)] {
                let mut lb = self.stream.launch_builder(&self.k.rope);
                lb.arg(buf)
                    .arg(&ix.positions)
                    .arg(inv)
                    .arg(factor)
                    .arg(&heads)
                    .arg(&hd32)
                    .arg(&t32);
                // SAFETY: buf holds t x heads x hd values, inv hd / 2, positions t.
                unsafe { lb.launch(flat(t * heads as usize * hd / 2)) }
                    .map_err(cuda_err("rope"))?;
            }
            {
                let kvl = &mut self.kv[li];
                let mut lb = self.stream.launch_builder(&self.k.kv_store);
                lb.arg(&b.k)
                    .arg(&b.v)
                    .arg(&ix.cells)
                    .arg(&mut kvl.k)
                    .arg(&mut kvl.v)
                    .arg(&kvd32)
                    .arg(&t32);
                // SAFETY: each cell indexes a block of this sequence's table, inside the
                // cache (the pool hands out blocks below n_blocks).
                unsafe { lb.launch(flat(t * kvd)) }.map_err(cuda_err("kv_store"))?;
            }
            {
                let kvl = &self.kv[li];
                let window = int(kind.window.unwrap_or(0))?;
                let softcap = c.attn_softcap.unwrap_or(0.0);
                let nwarps = ATTN_THREADS / 32;
                let shared = (nwarps as usize * (2 + hd) * 4) as u32;
                let cfg = LaunchConfig {
                    grid_dim: (t as u32, nh as u32, 1),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: shared,
                };
                let mut lb = self.stream.launch_builder(&self.k.attention);
                lb.arg(&b.q)
                    .arg(&kvl.k)
                    .arg(&kvl.v)
                    .arg(&ix.positions)
                    .arg(&ix.seq_of)
                    .arg(&ix.table_off)
                    .arg(&ix.tables)
                    .arg(&mut b.att)
                    .arg(&nh32)
                    .arg(&nkv32)
                    .arg(&hd32)
                    .arg(&bs32)
                    .arg(&window)
                    .arg(&c.attn_scale)
                    .arg(&softcap);
                // SAFETY: q and att hold t x nh x hd values; positions of each token are
                // covered by its sequence's block table (the step grew it first).
                unsafe { lb.launch(cfg) }.map_err(cuda_err("attention"))?;
            }
            let layer = &self.layers[li];
            self.linear(&layer.o, &b.att, t, &mut b.half, &mut b.o)?;
            if let Some(n) = &layer.post_attn_norm {
                self.rms_norm(&b.o, n, None, h, t)?;
            }
            self.add(&mut b.x, &b.o, t * h)?;

            self.rms_norm(&b.x, &layer.ffn_norm, Some(&mut b.hbuf), h, t)?;
            self.linear(&layer.gate, &b.hbuf, t, &mut b.half, &mut b.g)?;
            self.linear(&layer.up, &b.hbuf, t, &mut b.half, &mut b.u)?;
            let act = match c.activation {
                Activation::Silu => &self.k.silu_mul,
                Activation::GeluTanh => &self.k.gelu_tanh_mul,
            };
            {
                let n = int(t * ff)?;
                let mut lb = self.stream.launch_builder(act);
                lb.arg(&mut b.g).arg(&b.u).arg(&n);
                // SAFETY: g and u hold t x ff values.
                unsafe { lb.launch(flat(t * ff)) }.map_err(cuda_err("activation"))?;
            }
            self.linear(&layer.down, &b.g, t, &mut b.half, &mut b.o)?;
            if let Some(n) = &layer.post_ffn_norm {
                self.rms_norm(&b.o, n, None, h, t)?;
            }
            self.add(&mut b.x, &b.o, t * h)?;
        }

        let rows = input.logits_rows.len();
        if rows == 0 {
            self.stream.synchronize().map_err(cuda_err("step"))?;
            return Ok(Vec::new());
        }
        {
            let (n32, r32) = (h32, int(rows)?);
            let mut lb = self.stream.launch_builder(&self.k.gather_rows);
            lb.arg(&b.x)
                .arg(&ix.rows)
                .arg(&mut b.hbuf)
                .arg(&n32)
                .arg(&r32);
            // SAFETY: every row index is a token of this step; hbuf holds t x h >= rows x h.
            unsafe { lb.launch(flat(rows * h)) }.map_err(cuda_err("gather"))?;
        }
        self.rms_norm(&b.hbuf, &self.final_norm, None, h, rows)?;
        let mut logits = self
            .stream
            .alloc_zeros::<f32>(rows * c.vocab)
            .map_err(cuda_err("logits"))?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut half = self
            .stream
            .alloc_zeros::<u16>(rows * h)
            .map_err(cuda_err("logits"))?;
        self.linear(head, &b.hbuf, rows, &mut half, &mut logits)?;
        if let Some(cap) = c.final_softcap {
            let n = int(rows * c.vocab)?;
            let mut lb = self.stream.launch_builder(&self.k.softcap);
            lb.arg(&mut logits).arg(&cap).arg(&n);
            // SAFETY: logits holds rows x vocab values.
            unsafe { lb.launch(flat(rows * c.vocab)) }.map_err(cuda_err("softcap"))?;
        }
        self.stream
            .clone_dtoh(&logits)
            .map_err(cuda_err("reading the logits"))
    }
}

impl Backend for CudaBackend {
    fn forward(&mut self, input: &StepInput<'_>) -> Result<Vec<f32>, EngineError> {
        if let Some(e) = self.copy_failed.take() {
            return Err(EngineError::internal(e));
        }
        self.run(input)
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        if copies.is_empty() {
            return;
        }
        let per = self.cfg.n_kv_heads * self.cfg.head_dim;
        let bs = self.block_size;
        let _ = self.ctx.bind_to_thread();
        for cp in copies {
            let n = (cp.slots * per) as i64;
            let (src, dst) = (
                (cp.src as usize * bs * per) as i64,
                (cp.dst as usize * bs * per) as i64,
            );
            for l in &mut self.kv {
                for buf in [&mut l.k, &mut l.v] {
                    let mut lb = self.stream.launch_builder(&self.k.copy_range);
                    lb.arg(buf).arg(&src).arg(&dst).arg(&n);
                    // SAFETY: src and dst are distinct blocks of this cache, each with room
                    // for `slots` positions.
                    if let Err(e) = unsafe { lb.launch(flat(n as usize)) } {
                        // The trait returns nothing here: the next forward fails with it, so
                        // no step runs on a cache whose copy did not happen.
                        self.copy_failed = Some(format!("CUDA, copying KV blocks: {e}"));
                    }
                }
            }
        }
    }

    fn bytes_used(&self) -> u64 {
        self.bytes
    }

    fn describe(&self) -> String {
        format!(
            "cuda on {} (sm_{}{}), cuBLAS products in the weights' dtype, NVRTC kernels",
            self.device_name, self.arch.0, self.arch.1
        )
    }
}
