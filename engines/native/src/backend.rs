//! Native engine, the backend boundary (below the step's bookkeeping): what a compute backend
//! does for one step, whatever device it runs on.
//!
//! The model-level code (`lib.rs`) owns the sequences, the block tables and sampling; a backend
//! owns the weights in its memory, the K/V blocks, and the forward pass. The CPU backend
//! (`cpu`) is the one built today; a CUDA backend implements the same trait over device memory
//! (cuBLAS for the linear layers, NVRTC kernels for the rest) and hands back the same logits.

use gantry_engine_abi::EngineError;

use crate::kv::BlockCopy;

/// One step's tokens, flattened across sequences.
pub struct StepInput<'a> {
    pub tokens: &'a [i32],
    /// Position of each token in its sequence.
    pub positions: &'a [usize],
    /// Index into `tables` of each token's sequence.
    pub seq_of: &'a [usize],
    pub tables: &'a [&'a [u32]],
    /// Token indices whose logits are wanted, in the order the rows come back.
    pub logits_rows: &'a [usize],
}

pub trait Backend: Send {
    /// Run the step: append every token's K/V at its position and return the logits of
    /// `logits_rows`, `[rows][vocab]`.
    fn forward(&mut self, input: &StepInput<'_>) -> Result<Vec<f32>, EngineError>;
    /// Copy K/V slots between blocks (prefix reuse's copy on write), before the next forward.
    fn copy_blocks(&mut self, copies: &[BlockCopy]);
    /// Memory this backend holds: weights (mapped or owned) and the KV cache.
    fn bytes_used(&self) -> u64;
    /// One line for logs and the build report.
    fn describe(&self) -> String;
}
