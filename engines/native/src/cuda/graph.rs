//! Native engine, CUDA backend, in the step: CUDA graphs for decode steps.
//!
//! A decode step (every sequence one token, every token sampled) is padded to the next batch
//! size of [`BUCKETS`]; the padding slots write to a block no sequence owns and their rows are
//! skipped by the sampler. The first step of a size runs eagerly (cuBLAS settles its choices),
//! the second is captured with the stream capture API, and every later one replays the graph:
//! one launch for the step's few hundred kernels. A capture that fails leaves that size eager,
//! with the reason logged. Prompt steps run eagerly. `GANTRY_NATIVE_CUDA_GRAPHS=0` turns the
//! graphs off (every step eager), for comparisons.

use std::collections::BTreeMap;

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

/// The batch sizes a decode step is padded to.
pub const BUCKETS: [usize; 13] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256];

/// The bucket a decode step of `n` sequences runs as, if any holds it within `max`.
pub fn bucket_for(n: usize, max: usize) -> Option<usize> {
    BUCKETS.iter().copied().find(|&b| b >= n && b <= max)
}

/// A captured graph, owned by the backend.
pub(super) struct Graph(pub CudaGraph);

// SAFETY: CUDA graph objects need external serialisation, not a particular thread: the
// backend launches and drops its graphs only from the thread holding the model's lock.
unsafe impl Send for Graph {}

pub(super) enum Slot {
    /// Ran eagerly once at this size.
    Seen,
    Captured(Graph),
    /// Capture failed: eager at this size from now on.
    Failed,
}

#[derive(Default)]
pub(super) struct Graphs {
    pub enabled: bool,
    pub slots: BTreeMap<usize, Slot>,
    pub captures: u64,
    pub replays: u64,
}

impl Graphs {
    pub fn new() -> Self {
        Self {
            enabled: std::env::var("GANTRY_NATIVE_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            ..Self::default()
        }
    }

    /// Drop every graph (the buffers they captured were reallocated).
    pub fn clear(&mut self) {
        self.slots.clear();
    }

    /// The sizes with a captured graph.
    pub fn captured(&self) -> Vec<usize> {
        self.slots
            .iter()
            .filter(|(_, s)| matches!(s, Slot::Captured(_)))
            .map(|(&b, _)| b)
            .collect()
    }
}

pub(super) const CAPTURE_MODE: CUstreamCaptureMode =
    CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;

pub(super) fn instantiate_flags() -> CUgraphInstantiate_flags {
    CUgraphInstantiate_flags(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_step_is_padded_to_the_next_bucket_within_the_reserved_rows() {
        assert_eq!(bucket_for(1, 64), Some(1));
        assert_eq!(bucket_for(3, 64), Some(4));
        assert_eq!(bucket_for(49, 64), Some(64));
        assert_eq!(bucket_for(65, 64), None, "past the reserved rows: eager");
        assert_eq!(bucket_for(200, 256), Some(256));
        assert_eq!(bucket_for(257, 512), None);
    }
}
