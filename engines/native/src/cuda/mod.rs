//! Native engine, CUDA backend (below the step's bookkeeping, beside [`crate::cpu`]): the same
//! forward pass as the CPU backend on one NVIDIA GPU, through `cudarc`, with sampling on the
//! device.
//!
//! Laid out by job: [`nvrtc`] (can CUDA run here; the kernels compiled for the device and
//! loaded), `upload.rs` (weights into device memory, QKV and gate/up fused), `gemm.rs` (cuBLAS
//! products, `gemv` for one or two tokens), `bufs.rs` (the step's buffers, allocated once), `pack.rs` (the step's one input
//! copy and one output copy), `forward.rs` (the launches of a step), `graph.rs` (decode steps
//! captured as CUDA graphs), and the kernels in `kernels/`.
//!
//! - Weights stay in their checkpoint dtype; activations feeding a product and the K/V cache
//!   are in the model's 16-bit type (f32 for f32 checkpoints), the residual stream, products'
//!   outputs and logits f32.
//! - A step is: pack the inputs on the host, one copy to the device, the kernels (or one graph
//!   launch), one copy of the sampled tokens back, one synchronisation.
//! - The K/V cache is the CPU's block layout (`[cell][kv head][head_dim]`) in the cache's type,
//!   plus one block no sequence owns (a padded graph slot writes there), so the step's
//!   bookkeeping (`kv.rs`) is shared unchanged.

mod attend;
mod bufs;
mod forward;
mod gemm;
pub mod graph;
pub mod nvrtc;
mod pack;
mod profile;
mod upload;

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg, result,
};
use gantry_engine_abi::{EngineError, SampledToken, Status};

pub use nvrtc::{KERNEL_NAMES, KERNELS, compile, unavailable};

use crate::backend::{Backend, SampleRow, StepInput};
use crate::config::ModelConfig;
use crate::kv::BlockCopy;
use crate::weights::{DType, Weights};
use bufs::{Bufs, Caps, Pinned};
use forward::Shape;
use gemm::Gemm;
use graph::{Graphs, Slot, bucket_for};
use nvrtc::Kernels;
use pack::{OUT_WORDS, Packed, Padding, pack, unpack};
use profile::Profile;
use upload::DevModel;

/// The largest head the attention kernel holds in registers (8 values per lane).
pub const MAX_HEAD_DIM: usize = 256;

/// The widest residual stream the norms hold in registers (`NORM_PER` x 1,024 threads in
/// `kernels/layer.cu`).
pub const MAX_HIDDEN: usize = 8 * 1024;

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

/// dtype code of the kernels (`ld`/`st` in `kernels/common.cuh`).
fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
    }
}

struct LayerKv {
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
}

pub struct CudaBackend {
    cfg: ModelConfig,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    gemm: Gemm,
    k: Kernels,
    device_name: String,
    arch: (i32, i32),
    /// Multiprocessors of the device (how far attention splits a decode step's key spans).
    sms: usize,
    model: DevModel,
    kv: Vec<LayerKv>,
    /// dtype codes of the activations that feed products, and of the K/V cache.
    act_dt: i32,
    kv_dt: i32,
    act_size: usize,
    /// Blocks the pool hands out; block `n_blocks` is the padding slots' own.
    n_blocks: usize,
    block_size: usize,
    /// Most blocks one sequence's table holds (for the input area's size).
    table_len: usize,
    bufs: Bufs,
    staging: Pinned,
    outputs: Pinned,
    words: Vec<i32>,
    graphs: Graphs,
    profile: Profile,
    kv_bytes: u64,
    /// A KV block copy that failed, reported by the next forward.
    copy_failed: Option<String>,
}

impl CudaBackend {
    /// Put the model on device `ordinal`: compile the kernels, upload the weights in their
    /// dtype, allocate the KV cache and the step's buffers. Refuses before allocating when the
    /// device's free memory cannot hold weights and cache.
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
        let (hd, nkv) = (cfg.head_dim, cfg.n_kv_heads);
        if hd > MAX_HEAD_DIM || hd % 2 != 0 {
            return Err(EngineError::unsupported(format!(
                "head_dim {hd}: the CUDA attention kernel takes even head sizes up to {MAX_HEAD_DIM}"
            )));
        }
        if cfg.hidden > MAX_HIDDEN {
            return Err(EngineError::unsupported(format!(
                "hidden_size {}: the CUDA norms take rows up to {MAX_HIDDEN} wide",
                cfg.hidden
            )));
        }
        if cfg.moe.is_some() {
            return Err(EngineError::unsupported(format!(
                "{}: the CUDA backend of the native engine does not run mixture-of-experts layers yet (its CPU backend does)",
                cfg.class
            )));
        }
        if cfg.mamba.is_some() {
            return Err(EngineError::unsupported(format!(
                "{}: the CUDA backend of the native engine does not run state-space (Mamba-2) layers yet (its CPU backend does)",
                cfg.class
            )));
        }
        if !cfg.activation.gated() || cfg.layers.iter().any(|l| !l.mixer || !l.mlp) {
            return Err(EngineError::unsupported(format!(
                "{}: blocks of one mixer or one MLP and relu² MLPs (Nemotron-H): the CUDA backend of the native engine does not run them yet (its CPU backend does)",
                cfg.class
            )));
        }
        if cfg.residual_scale != 1.0 || cfg.logit_divisor != 1.0 {
            return Err(EngineError::unsupported(format!(
                "{}: residual and logit multipliers: the CUDA backend of the native engine does not apply them yet (its CPU backend does)",
                cfg.class
            )));
        }
        if cfg.rotary_dim != cfg.head_dim {
            return Err(EngineError::unsupported(format!(
                "{}: partial RoPE ({} of {} dimensions): the CUDA backend of the native engine rotates whole heads (its CPU backend does both)",
                cfg.class, cfg.rotary_dim, cfg.head_dim
            )));
        }
        let act = weights
            .expect(cfg.embed_name(), &[cfg.vocab, cfg.hidden])?
            .dtype;
        let act_size = if act == DType::F32 { 4 } else { 2 };
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("opening the device"))?;
        let device_name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        let arch = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(cuda_err("multiprocessor count"))?
            .max(1) as usize;
        let stream = ctx.new_stream().map_err(cuda_err("stream"))?;
        // SAFETY: the backend uses this one stream for every operation, in order, so
        // cudarc's cross-stream events are not needed.
        unsafe { ctx.disable_event_tracking() };

        let cells = (n_blocks + 1) * block_size * nkv * hd;
        let kv_bytes = (cells * 2 * act_size * cfg.n_layers) as u64;
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

        let k = Kernels::load(&ctx, arch)?;
        let gemm = Gemm::new(&stream, k.gemv.clone(), sms)?;
        let model = upload::upload(cfg, weights, &stream)?;
        let mut kv = Vec::with_capacity(cfg.n_layers);
        let e = cuda_err("allocating the KV cache");
        for _ in 0..cfg.n_layers {
            kv.push(LayerKv {
                k: stream.alloc_zeros::<u8>(cells * act_size).map_err(&e)?,
                v: stream.alloc_zeros::<u8>(cells * act_size).map_err(&e)?,
            });
        }
        let table_len = (cfg.max_position as usize)
            .div_ceil(block_size)
            .min(n_blocks)
            + 1;
        let caps = Caps::new(256, 16, table_len, cfg.vocab);
        let bufs = Bufs::new(&stream, cfg, act_size, caps)?;
        let staging = Pinned::new(caps.in_words, true)?;
        let outputs = Pinned::new(caps.rows * OUT_WORDS, false)?;
        stream.synchronize().map_err(cuda_err("upload"))?;
        let code = dtype_code(act);
        let profile = Profile::new(&ctx);
        Ok(Self {
            cfg: cfg.clone(),
            ctx,
            stream,
            gemm,
            k,
            device_name,
            arch,
            sms,
            model,
            kv,
            act_dt: code,
            kv_dt: code,
            act_size,
            n_blocks,
            block_size,
            table_len,
            bufs,
            staging,
            outputs,
            words: Vec::new(),
            graphs: Graphs::new(),
            profile,
            kv_bytes,
            copy_failed: None,
        })
    }

    /// Size the step's buffers for `rows` sequences and `tokens` tokens per step, now rather
    /// than on the first step that needs them.
    pub fn reserve(&mut self, rows: usize, tokens: usize) -> Result<(), EngineError> {
        let need = Caps::new(tokens.max(rows), rows, self.table_len, self.cfg.vocab);
        self.ensure(need)
    }

    /// Grow the buffers (and the pinned copies) to hold `need`; graphs captured on the old
    /// buffers are dropped.
    fn ensure(&mut self, need: Caps) -> Result<(), EngineError> {
        if self.bufs.caps.holds(&need) {
            return Ok(());
        }
        let caps = self.bufs.caps.grown(need);
        self.graphs.clear();
        self.stream.synchronize().map_err(cuda_err("step"))?;
        // The old buffers go first, so the device holds one set at a time.
        self.bufs = Bufs::new(
            &self.stream,
            &self.cfg,
            self.act_size,
            Caps::new(1, 1, 1, 1),
        )?;
        self.bufs = Bufs::new(&self.stream, &self.cfg, self.act_size, caps)?;
        self.staging = Pinned::new(caps.in_words, true)?;
        self.outputs = Pinned::new(caps.rows * OUT_WORDS, false)?;
        Ok(())
    }

    fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _g) = s.device_ptr(&self.stream);
        p
    }

    /// Check, pack and upload a step; grow the buffers first when it needs more.
    fn stage(
        &mut self,
        input: &StepInput<'_>,
        rows: &[SampleRow<'_>],
        padding: Option<&Padding>,
    ) -> Result<Packed, EngineError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        for &tok in input.tokens {
            if usize::try_from(tok).map_or(true, |id| id >= self.cfg.vocab) {
                return Err(EngineError::unsupported(format!(
                    "token id {tok} is outside the vocabulary"
                )));
            }
        }
        let mut words = std::mem::take(&mut self.words);
        let packed = pack(
            &mut words,
            input,
            rows,
            padding,
            self.block_size,
            self.cfg.vocab,
        );
        let result = packed.and_then(|p| {
            let need = Caps {
                tokens: p.n_tokens,
                rows: p.n_rows,
                in_words: words.len(),
                adj: p.n_adj,
            };
            self.ensure(need)?;
            self.staging.words()[..words.len()].copy_from_slice(&words);
            self.staging
                .copy_to_device(words.len(), self.bufs.input, &self.stream)?;
            Ok(p)
        });
        self.words = words;
        result
    }

    /// A sampled step: eager, or a decode step through its size's graph.
    fn run_sampled(
        &mut self,
        input: &StepInput<'_>,
        rows: &[SampleRow<'_>],
    ) -> Result<Vec<SampledToken>, EngineError> {
        let t = input.tokens.len();
        let decode = rows.len() == t && input.logits_rows.iter().enumerate().all(|(i, &r)| i == r);
        let bucket = if self.graphs.enabled && !self.profile.enabled && decode {
            bucket_for(t, self.bufs.caps.rows.max(rows.len()))
        } else {
            None
        };
        match bucket {
            Some(b) => {
                let pad = Padding {
                    to: b,
                    dummy_block: self.n_blocks as u32,
                };
                let p = self.stage(input, rows, Some(&pad))?;
                let shape = Shape {
                    tokens: p.n_tokens,
                    rows: p.n_rows,
                    gather: false,
                    sample: true,
                };
                self.replay_or_capture(b, &shape)?;
            }
            None => {
                let p = self.stage(input, rows, None)?;
                self.encode(&Shape {
                    tokens: p.n_tokens,
                    rows: p.n_rows,
                    gather: !p.identity_rows,
                    sample: true,
                })?;
            }
        }
        let n = rows.len() * OUT_WORDS;
        self.outputs
            .fill_from_device(n, self.bufs.out, &self.stream)?;
        self.stream.synchronize().map_err(cuda_err("step"))?;
        self.profile.collect(decode.then_some(t));
        unpack(&self.outputs.words()[..n], rows)
    }

    /// Run a padded decode step of size `b`: replay its graph, capture it (second time this
    /// size is seen), or run it eagerly (first time, or its capture failed).
    fn replay_or_capture(&mut self, b: usize, shape: &Shape) -> Result<(), EngineError> {
        match self.graphs.slots.get(&b) {
            Some(Slot::Captured(g)) => {
                g.0.launch().map_err(cuda_err("graph launch"))?;
                self.graphs.replays += 1;
                return Ok(());
            }
            Some(Slot::Failed) => return self.encode(shape),
            Some(Slot::Seen) => {}
            None => {
                self.graphs.slots.insert(b, Slot::Seen);
                return self.encode(shape);
            }
        }
        let slot = match self.capture(shape) {
            Ok(g) => {
                g.launch().map_err(cuda_err("graph launch"))?;
                self.graphs.captures += 1;
                Slot::Captured(graph::Graph(g))
            }
            Err(why) => {
                eprintln!("gantry-engine-native: decode steps of {b} stay eager: {why}");
                self.encode(shape)?;
                Slot::Failed
            }
        };
        self.graphs.slots.insert(b, slot);
        Ok(())
    }

    fn capture(&self, shape: &Shape) -> Result<cudarc::driver::CudaGraph, String> {
        self.stream
            .begin_capture(graph::CAPTURE_MODE)
            .map_err(|e| format!("begin capture: {e}"))?;
        let encoded = self.encode(shape);
        let ended = self.stream.end_capture(graph::instantiate_flags());
        encoded.map_err(|e| e.message)?;
        ended
            .map_err(|e| format!("end capture: {e}"))?
            .ok_or_else(|| "the capture recorded nothing".to_string())
    }

    /// Sample `logits` (`rows.len()` rows of the vocabulary) with the device sampler alone:
    /// the sampler checked against the exact distribution, without a model's forward pass.
    pub fn sample_logits(
        &mut self,
        logits: &[f32],
        rows: &[SampleRow<'_>],
    ) -> Result<Vec<SampledToken>, EngineError> {
        let n = rows.len();
        if logits.len() != n * self.cfg.vocab {
            return Err(EngineError::internal("sample_logits: rows x vocab logits"));
        }
        let tokens = vec![0i32; n];
        let positions: Vec<usize> = vec![0; n];
        let seq_of: Vec<usize> = vec![0; n];
        let table = [0u32];
        let tables: Vec<&[u32]> = vec![&table];
        let logits_rows: Vec<usize> = (0..n).collect();
        let input = StepInput {
            tokens: &tokens,
            positions: &positions,
            seq_of: &seq_of,
            tables: &tables,
            logits_rows: &logits_rows,
            adapters: &[],
            slots: &[],
        };
        let p = self.stage(&input, rows, None)?;
        // SAFETY: the logits buffer holds at least n rows of the vocabulary (stage grew it).
        unsafe { result::memcpy_htod_async(self.bufs.logits, logits, self.stream.cu_stream()) }
            .map_err(cuda_err("logits"))?;
        self.launch_sample(p.n_rows)?;
        let words = n * OUT_WORDS;
        self.outputs
            .fill_from_device(words, self.bufs.out, &self.stream)?;
        self.stream.synchronize().map_err(cuda_err("sample"))?;
        unpack(&self.outputs.words()[..words], rows)
    }

    /// Decode-step graphs: the sizes captured, captures and replays so far.
    pub fn graph_stats(&self) -> (Vec<usize>, u64, u64) {
        (
            self.graphs.captured(),
            self.graphs.captures,
            self.graphs.replays,
        )
    }
}

/// Why this backend runs no LoRA adapters (ABI 1.6): it refuses them at load, honestly.
const NO_ADAPTERS: &str =
    "LoRA adapters run on the CPU backend of the native engine; CUDA support is not built yet";

impl Backend for CudaBackend {
    fn forward(&mut self, input: &StepInput<'_>) -> Result<Vec<f32>, EngineError> {
        if let Some(e) = self.copy_failed.take() {
            return Err(EngineError::internal(e));
        }
        if !input.adapters.is_empty() {
            return Err(EngineError::unsupported(NO_ADAPTERS));
        }
        let p = self.stage(input, &[], None)?;
        self.encode(&Shape {
            tokens: p.n_tokens,
            rows: p.n_rows,
            gather: !p.identity_rows,
            sample: false,
        })?;
        let mut logits = vec![0f32; p.n_rows * self.cfg.vocab];
        // SAFETY: the logits buffer holds n_rows x vocab values written by the step above.
        unsafe {
            result::memcpy_dtoh_async(&mut logits, self.bufs.logits, self.stream.cu_stream())
        }
        .map_err(cuda_err("reading the logits"))?;
        self.stream.synchronize().map_err(cuda_err("step"))?;
        Ok(logits)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn forward_sample(
        &mut self,
        input: &StepInput<'_>,
        rows: &[SampleRow<'_>],
    ) -> Result<Vec<SampledToken>, EngineError> {
        if let Some(e) = self.copy_failed.take() {
            return Err(EngineError::internal(e));
        }
        if !input.adapters.is_empty() {
            return Err(EngineError::unsupported(NO_ADAPTERS));
        }
        if rows.len() != input.logits_rows.len() {
            return Err(EngineError::internal(
                "forward_sample: one sampling row per logits row",
            ));
        }
        self.run_sampled(input, rows)
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        if copies.is_empty() {
            return;
        }
        // In 16-bit words: a block's slots are whole rows of kv heads x head_dim values.
        let per = self.cfg.n_kv_heads * self.cfg.head_dim * self.act_size / 2;
        let bs = self.block_size;
        let _ = self.ctx.bind_to_thread();
        for cp in copies {
            let n = (cp.slots * per) as i64;
            let (src, dst) = (
                (cp.src as usize * bs * per) as i64,
                (cp.dst as usize * bs * per) as i64,
            );
            for l in &self.kv {
                for buf in [&l.k, &l.v] {
                    let p = self.addr(buf);
                    let mut lb = self.stream.launch_builder(&self.k.copy_u16);
                    lb.arg(&p).arg(&src).arg(&dst).arg(&n);
                    let cfg = LaunchConfig {
                        grid_dim: ((n as usize).div_ceil(256).clamp(1, 4096) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: src and dst are distinct blocks of this cache, each with room
                    // for `slots` positions.
                    if let Err(e) = unsafe { lb.launch(cfg) } {
                        // The trait returns nothing here: the next forward fails with it, so
                        // no step runs on a cache whose copy did not happen.
                        self.copy_failed = Some(format!("CUDA, copying KV blocks: {e}"));
                    }
                }
            }
        }
    }

    fn bytes_used(&self) -> u64 {
        self.model.bytes + self.kv_bytes + self.bufs.bytes
    }

    fn runs_adapters(&self) -> Result<(), EngineError> {
        Err(EngineError::unsupported(NO_ADAPTERS))
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("graph_captures", self.graphs.captures),
            ("graph_replays", self.graphs.replays),
        ]
    }

    fn describe(&self) -> String {
        let (captured, captures, replays) = self.graph_stats();
        format!(
            "cuda on {} (sm_{}{}, {} multiprocessors), products in the weights' dtype ({}, cuBLAS above), {}-byte activations and K/V, attention by tiles in shared memory, sampling on the device, decode graphs {} (buckets {:?}, captured {:?}, {captures} captures, {replays} replays)",
            self.device_name,
            self.arch.0,
            self.arch.1,
            self.sms,
            match self.gemm.gemv_max() {
                0 => "gemv off".to_string(),
                n => format!("gemv for up to {n} tokens of 16-bit weights"),
            },
            self.act_size,
            if self.graphs.enabled { "on" } else { "off" },
            graph::BUCKETS,
            captured,
        )
    }
}
