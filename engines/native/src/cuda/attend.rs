//! Native engine, CUDA backend, in the step: attention's launch for one layer, between the
//! QKV kernel (`qkv_rope_store`, which appended this step's K/V) and the output product.
//!
//! `attention_tiled` (`kernels/attention.cu`) is split over the key span (flash-decoding) so
//! that a decode step of a few sequences still fills the GPU; a block loads a tile of K/V rows
//! into shared memory with all its loads in flight, and the last piece of a split merges the
//! pieces in the same launch. This module sizes the split and the tiles.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gantry_engine_abi::EngineError;

use super::{CudaBackend, cuda_err, int};

/// Threads per block of attention: one warp per query head of the block.
const ATTN_THREADS: u32 = 32 * ATTN_HEADS as u32;

/// Query heads one attention block serves (`ATTN_HEADS` in `kernels/attention.cu`).
const ATTN_HEADS: usize = 4;

/// Shared memory a block may take without opting in to more.
const SMEM_LIMIT: usize = 48 * 1024;

/// `attention_tiled`'s static shared memory (its "last piece" flag, rounded up).
const TILED_STATIC_SMEM: usize = 16;

/// Pieces each token's key span is cut into: enough that the step has about four attention
/// blocks per multiprocessor (a small decode batch still fills the GPU; a batch that fills it
/// already is not cut), at most 16, one for a long prompt chunk. `blocks` is the blocks per
/// token before the split (K/V heads x groups of query heads). tokens x pieces <=
/// max(1024, tokens), which is what the step's buffers hold.
pub(super) fn attention_splits(tokens: usize, blocks: usize, sms: usize) -> usize {
    let base = (tokens * blocks).max(1);
    (4 * sms)
        .div_ceil(base)
        .clamp(1, 16)
        .min((1024 / tokens.max(1)).max(1))
}

/// Attention blocks per token before the split: one per K/V head and group of up to
/// [`ATTN_HEADS`] of its query heads.
pub(super) fn attention_blocks(n_heads: usize, n_kv_heads: usize) -> usize {
    n_kv_heads * (n_heads / n_kv_heads).div_ceil(ATTN_HEADS)
}

/// Floats from one K or V row of `attention_tiled`'s tiles to the next: the head rounded up to
/// 32 floats, plus 4, so that 16-byte accesses of 8 lanes to 8 rows meet no bank twice (and
/// rows stay 16-byte aligned).
fn tiled_stride(head_dim: usize) -> usize {
    head_dim.next_multiple_of(32) + 4
}

/// Dynamic shared memory of `attention_tiled` for a tile of `tile` positions: the block's
/// queries, the K and V tiles, the weights per head, the cells.
fn tiled_smem(head_dim: usize, tile: usize) -> usize {
    (ATTN_HEADS * head_dim + 2 * tile * tiled_stride(head_dim) + ATTN_HEADS * tile + tile) * 4
}

/// Positions per tile of `attention_tiled`: 32, or 16 or 8 where 32 rows of K and V of this
/// head size do not fit in [`SMEM_LIMIT`] (16 for 256-wide heads).
pub(super) fn attention_tile(head_dim: usize) -> usize {
    let mut tile = 32;
    while tile > 8 && tiled_smem(head_dim, tile) + TILED_STATIC_SMEM > SMEM_LIMIT {
        tile /= 2;
    }
    tile
}

/// One layer's attention: where its K/V cache is and how it reads it.
pub(super) struct LayerAttention {
    pub k_cache: u64,
    pub v_cache: u64,
    /// Sliding window (0: none).
    pub window: i32,
    /// Token slots of the step.
    pub tokens: usize,
}

impl CudaBackend {
    /// Attention of the step's tokens over their sequences' caches, from the q rows of the
    /// fused QKV output into `att` (the output product's input).
    pub(super) fn attention(&self, a: &LayerAttention) -> Result<(), EngineError> {
        let c = &self.cfg;
        let b = &self.bufs;
        let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
        let (hd32, nh32, nkv32, bs32) = (int(hd)?, int(nh)?, int(nkv)?, int(self.block_size)?);
        let n = a.tokens;
        let q_stride = i64::from(int((nh + 2 * nkv) * hd)?);
        let blocks = attention_blocks(nh, nkv);
        let splits = attention_splits(n, blocks, self.sms);
        let splits32 = int(splits)?;
        let softcap = c.attn_softcap.unwrap_or(0.0);
        let (kvdt, act) = (self.kv_dt, self.act_dt);
        let tile = attention_tile(hd);
        let (tile32, stride32) = (int(tile)?, int(tiled_stride(hd))?);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, blocks as u32, splits as u32),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: tiled_smem(hd, tile) as u32,
        };
        let mut lb = self.stream.launch_builder(&self.k.attention);
        lb.arg(&b.qkv)
            .arg(&q_stride)
            .arg(&a.k_cache)
            .arg(&a.v_cache)
            .arg(&kvdt)
            .arg(&b.input)
            .arg(&b.attn_part)
            .arg(&b.attn_done)
            .arg(&b.att)
            .arg(&act)
            .arg(&nh32)
            .arg(&nkv32)
            .arg(&hd32)
            .arg(&bs32)
            .arg(&a.window)
            .arg(&c.attn_scale)
            .arg(&softcap)
            .arg(&splits32)
            .arg(&tile32)
            .arg(&stride32);
        // SAFETY: q rows of qkv hold n x nh x hd values, attn_part n x nh x splits pieces
        // (sized by attention_splits), attn_done n x nh zeroed counters that the kernel leaves
        // zeroed, att n x nh x hd values; each token's positions are covered by its sequence's
        // block table (the step grew it first); the shared memory is tiled_smem's, within the
        // default limit.
        unsafe { lb.launch(cfg) }.map_err(cuda_err("attention_tiled"))?;
        self.profile.mark("attention", &self.stream);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_the_default_shared_memory() {
        assert_eq!(attention_tile(256), 16);
        assert_eq!(attention_tile(128), 32);
        assert_eq!(attention_tile(64), 32);
        for hd in [32, 64, 80, 96, 112, 128, 160, 192, 256] {
            let tile = attention_tile(hd);
            assert!(
                tiled_smem(hd, tile) + TILED_STATIC_SMEM <= SMEM_LIMIT,
                "head_dim {hd}, tile {tile}"
            );
            assert_eq!(32 % tile, 0);
            assert_eq!(tiled_stride(hd) % 32, 4);
        }
    }

    #[test]
    fn splits_fill_the_gpu_within_the_buffers() {
        // 132 multiprocessors (an H100 or H200): Gemma 3 270M has one block per token.
        assert_eq!(attention_splits(1, 1, 132), 16);
        assert_eq!(attention_splits(64, 1, 132), 9);
        assert_eq!(attention_splits(256, 1, 132), 3);
        assert_eq!(attention_splits(2048, 1, 132), 1);
        for tokens in [1, 7, 64, 300, 1024, 5000] {
            assert!(tokens * attention_splits(tokens, 1, 132) <= tokens.max(1024));
        }
    }
}
