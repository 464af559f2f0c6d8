//! Native engine, CUDA backend: the step's memory, allocated once and reused by every step.
//!
//! [`Bufs`] holds every per-step device buffer (activations, logits, the input area, the
//! sampler's scratch and output) sized for the largest batch and token count the model was
//! reserved for; [`Pinned`] is page-locked host memory for the step's one input copy and one
//! output copy. A step needing more than the buffers hold (a longer prompt chunk than reserved)
//! grows them first, outside any captured graph, and the graphs are captured again.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, result, sys};
use gantry_engine_abi::EngineError;

use super::cuda_err;
use super::pack::{HEADER, OUT_WORDS, P_WORDS};
use crate::config::ModelConfig;

/// What the buffers are sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Caps {
    /// Tokens of one step (prompt chunks and decodes together).
    pub tokens: usize,
    /// Sampled rows of one step (one per sequence at most).
    pub rows: usize,
    /// Words of the input area.
    pub in_words: usize,
    /// Logit adjustments (bias and penalty entries) of one step.
    pub adj: usize,
}

impl Caps {
    /// Room for `tokens` tokens and `rows` rows with block tables of `table_len` entries and
    /// masks for every row.
    pub fn new(tokens: usize, rows: usize, table_len: usize, vocab: usize) -> Self {
        let adj = rows * 64;
        Self {
            tokens,
            rows,
            adj,
            in_words: HEADER
                + 5 * tokens
                + rows * (P_WORDS + 2 + table_len + vocab.div_ceil(32))
                + 3 * adj
                + 4,
        }
    }

    /// The smallest caps at least `self` that hold `need` (each doubled until it does).
    pub fn grown(self, need: Caps) -> Caps {
        let up = |have: usize, want: usize| {
            let mut v = have.max(1);
            while v < want {
                v *= 2;
            }
            v
        };
        Caps {
            tokens: up(self.tokens, need.tokens),
            rows: up(self.rows, need.rows),
            in_words: up(self.in_words, need.in_words),
            adj: up(self.adj, need.adj),
        }
    }

    pub fn holds(&self, need: &Caps) -> bool {
        need.tokens <= self.tokens
            && need.rows <= self.rows
            && need.in_words <= self.in_words
            && need.adj <= self.adj
    }
}

/// Device addresses of the step's buffers (kernel arguments are these addresses, so a graph
/// captured with them replays on the same memory).
pub(super) struct Bufs {
    pub caps: Caps,
    /// Residual stream, f32 `[tokens][hidden]`.
    pub x: u64,
    /// Norm outputs, activation type `[tokens][hidden]`.
    pub h: u64,
    /// Fused QKV output, f32 `[tokens][q + k + v]`.
    pub qkv: u64,
    /// Attention output, activation type `[tokens][q]`.
    pub att: u64,
    /// Output and down products, f32 `[tokens][hidden]`.
    pub o: u64,
    /// Fused gate/up output, f32 `[tokens][2 x intermediate]`.
    pub gu: u64,
    /// Gated activation, activation type `[tokens][intermediate]`.
    pub g: u64,
    /// The rows a prompt step samples, gathered, activation type `[rows][hidden]`.
    pub hrows: u64,
    /// f32 `[rows][vocab]`.
    pub logits: u64,
    /// The input area, `in_words` i32.
    pub input: u64,
    /// The sampler's scratch, f32 `[adj]`.
    pub adj_orig: u64,
    /// The sampler's output, i32 `[rows][OUT_WORDS]`.
    pub out: u64,
    /// Attention's pieces, f32 `[tokens][heads][splits][2 + head_dim]`
    /// (`attend::attention_splits`: tokens x splits <= max(1024, tokens)).
    pub attn_part: u64,
    /// Pieces of each (token, attention block) that `attention_tiled` has written, i32
    /// `[tokens][heads]`: zero between launches (the merging block sets its counter back).
    pub attn_done: u64,
    pub bytes: u64,
    _owners: Vec<CudaSlice<u8>>,
}

impl Bufs {
    pub fn new(
        stream: &Arc<CudaStream>,
        cfg: &ModelConfig,
        act_size: usize,
        caps: Caps,
    ) -> Result<Self, EngineError> {
        let (t, r) = (caps.tokens, caps.rows);
        let (h, qd) = (cfg.hidden, cfg.n_heads * cfg.head_dim);
        let qkv = qd + 2 * cfg.n_kv_heads * cfg.head_dim;
        let ff = cfg.intermediate;
        let sizes = [
            t * h * 4,
            t * h * act_size,
            t * qkv * 4,
            t * qd * act_size,
            t * h * 4,
            t * 2 * ff * 4,
            t * ff * act_size,
            r * h * act_size,
            r * cfg.vocab * 4,
            caps.in_words * 4,
            caps.adj.max(1) * 4,
            r * OUT_WORDS * 4,
            t.max(1024) * cfg.n_heads * (2 + cfg.head_dim) * 4,
            t * cfg.n_heads * 4,
        ];
        let mut owners = Vec::with_capacity(sizes.len());
        let mut ptrs = Vec::with_capacity(sizes.len());
        let e = cuda_err("the step's buffers");
        for &n in &sizes {
            let mut s = stream.alloc_zeros::<u8>(n.max(4)).map_err(&e)?;
            let p = {
                let (p, _g) = s.device_ptr_mut(stream);
                p
            };
            ptrs.push(p);
            owners.push(s);
        }
        Ok(Self {
            caps,
            x: ptrs[0],
            h: ptrs[1],
            qkv: ptrs[2],
            att: ptrs[3],
            o: ptrs[4],
            gu: ptrs[5],
            g: ptrs[6],
            hrows: ptrs[7],
            logits: ptrs[8],
            input: ptrs[9],
            adj_orig: ptrs[10],
            out: ptrs[11],
            attn_part: ptrs[12],
            attn_done: ptrs[13],
            bytes: sizes.iter().sum::<usize>() as u64,
            _owners: owners,
        })
    }
}

/// Page-locked host memory of `len` i32 words (`cuMemHostAlloc`): the source of the step's
/// input copy (write-combined: the host only writes it) or the target of its output copy.
pub(super) struct Pinned {
    ptr: *mut i32,
    len: usize,
}

// SAFETY: the allocation is owned by this value alone; the backend uses it from one thread at
// a time (behind the model's lock).
unsafe impl Send for Pinned {}

impl Pinned {
    pub fn new(len: usize, write_combined: bool) -> Result<Self, EngineError> {
        let flags = if write_combined {
            sys::CU_MEMHOSTALLOC_WRITECOMBINED
        } else {
            0
        };
        // SAFETY: a plain allocation of len words; the pointer is freed once in Drop.
        let ptr = unsafe { result::malloc_host(len.max(1) * 4, flags) }
            .map_err(cuda_err("page-locked host memory"))?;
        Ok(Self {
            ptr: ptr.cast(),
            len: len.max(1),
        })
    }

    /// The memory as words. The caller synchronises with the stream before reading what a
    /// copy wrote, and does not write what a copy in flight reads.
    pub fn words(&mut self) -> &mut [i32] {
        // SAFETY: ptr holds len initialised-or-not i32 words, which any bit pattern is.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Copy the first `n` words to device address `dst` on `stream` (asynchronously).
    pub fn copy_to_device(
        &self,
        n: usize,
        dst: u64,
        stream: &CudaStream,
    ) -> Result<(), EngineError> {
        // SAFETY: n <= len (callers check); page-locked, so the copy is truly asynchronous and
        // the memory stays valid while the stream runs it (self outlives the step).
        let src = unsafe { std::slice::from_raw_parts(self.ptr, n.min(self.len)) };
        // SAFETY: dst is a device buffer of at least n words (the input area's capacity).
        unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(cuda_err("the step's input copy"))
    }

    /// Copy `n` words from device address `src` into the start of this memory.
    pub fn fill_from_device(
        &mut self,
        n: usize,
        src: u64,
        stream: &CudaStream,
    ) -> Result<(), EngineError> {
        let n = n.min(self.len);
        // SAFETY: as above; the caller synchronises before reading.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr, n) };
        // SAFETY: src is a device buffer of at least n words (the output's capacity).
        unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
            .map_err(cuda_err("the step's output copy"))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once here.
        let _ = unsafe { result::free_host(self.ptr.cast::<c_void>()) };
    }
}
