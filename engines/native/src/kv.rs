//! Native engine, KV bookkeeping (between the host's step and the forward pass): the paged KV
//! cache's blocks, each sequence's block table, and prefix reuse.
//!
//! The cache is `n_blocks` fixed-size blocks of `block_size` token positions (the backend holds
//! their K and V for every layer). A sequence owns a table of block ids; position `p` lives in
//! block `table[p / block_size]`, slot `p % block_size`. Free blocks sit on a free list.
//!
//! Prefix reuse: a block that is full is registered under a hash of its tokens chained with its
//! parent's hash (so it stands for the whole prefix up to its end). A new sequence walks its
//! first chunk block by block and takes every registered block that matches (shared, reference
//! counted). At the first block that differs it copies the longest matching head of a cached
//! child block into a private block (copy on write: shared blocks are never written). Registered
//! blocks whose last user left stay cached and are evicted least recently used first, only when
//! a block is needed and the free list is empty.
//!
//! LoRA adapters (ABI 1.6): K/V computed under an adapter differs from the base's for the same
//! tokens, so a sequence's chain starts from a root of its adapter ([`SeqBlocks::adapter`]; the
//! base's root is the same for every base sequence). Blocks of one adapter are found only by
//! sequences of that adapter; base sequences still share among themselves.
//!
//! Forks and truncations (ABI 1.5: `n` > 1 and speculative decoding): a fork shares its
//! source's full blocks and copies the partly filled last one; a truncation releases the blocks
//! past the kept length and copies on write the block that now ends the sequence when another
//! sequence reads it or the prefix cache indexes it. The unit tests are in `kv/tests.rs`.

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

use gantry_engine_abi::{EngineError, Status};

pub type BlockId = u32;

/// A copy the backend must make before the step's forward pass: the first `slots` positions of
/// block `src` into block `dst`, in every layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
    pub slots: usize,
}

const ROOT: u64 = 0x9e37_79b9_7f4a_7c15;

fn chain_hash(parent: u64, tokens: &[i32]) -> u64 {
    // SipHash with fixed keys: deterministic across runs; a collision is caught by comparing
    // the stored tokens before any reuse.
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// Where the chain of a sequence under `adapter` starts (0 = the base model: [`ROOT`]).
fn root_of(adapter: u64) -> u64 {
    if adapter == 0 {
        ROOT
    } else {
        // Never a block's hash in practice: a chain hash of two "tokens" (every registered
        // block holds `block_size` of them), and a parent hash is compared before any reuse.
        chain_hash(ROOT, &[adapter as i32, (adapter >> 32) as i32])
    }
}

struct Registered {
    hash: u64,
    parent: u64,
    tokens: Vec<i32>,
}

/// A sequence's view of the cache.
#[derive(Debug, Default)]
pub struct SeqBlocks {
    pub table: Vec<BlockId>,
    /// Positions written (the next token goes to position `len`).
    pub len: usize,
    /// The tokens at positions `0..len`.
    pub tokens: Vec<i32>,
    /// Hash of each full block of `table`, in order (the chain a next block hangs from).
    hashes: Vec<u64>,
    /// The LoRA adapter the K/V is computed under (0 = the base model): the chain's root, so
    /// a prefix is only ever reused under the adapter that computed it.
    pub adapter: u64,
}

impl SeqBlocks {
    fn root(&self) -> u64 {
        root_of(self.adapter)
    }
}

pub struct BlockPool {
    pub block_size: usize,
    n_blocks: usize,
    refcount: Vec<u32>,
    free: Vec<BlockId>,
    registered: Vec<Option<Registered>>,
    by_hash: HashMap<u64, BlockId>,
    /// Registered blocks of each parent hash (for the copy at the first divergent block).
    children: HashMap<u64, Vec<BlockId>>,
    /// Cached blocks nobody uses, oldest release first: (stamp, block).
    evictable: BTreeSet<(u64, BlockId)>,
    stamp_of: Vec<u64>,
    clock: u64,
    /// Reuse on or off (`false` = every sequence computes its whole prompt).
    pub prefix_cache: bool,
}

impl BlockPool {
    pub fn new(n_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            n_blocks,
            refcount: vec![0; n_blocks],
            free: (0..n_blocks as BlockId).rev().collect(),
            registered: (0..n_blocks).map(|_| None).collect(),
            by_hash: HashMap::new(),
            children: HashMap::new(),
            evictable: BTreeSet::new(),
            stamp_of: vec![0; n_blocks],
            clock: 0,
            prefix_cache: true,
        }
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// Blocks that can be handed out now (free, or cached and evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks holding cached prefixes that nobody uses.
    pub fn cached_idle(&self) -> usize {
        self.evictable.len()
    }

    fn unregister(&mut self, b: BlockId) {
        if let Some(r) = self.registered[b as usize].take() {
            if self.by_hash.get(&r.hash) == Some(&b) {
                self.by_hash.remove(&r.hash);
            }
            if let Some(c) = self.children.get_mut(&r.parent) {
                c.retain(|&x| x != b);
                if c.is_empty() {
                    self.children.remove(&r.parent);
                }
            }
        }
    }

    /// One block for a writer: a free one, else the least recently used cached one.
    fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let first = *self.evictable.iter().next()?;
                self.evictable.remove(&first);
                self.unregister(first.1);
                first.1
            }
        };
        self.refcount[b as usize] = 1;
        Some(b)
    }

    fn retain(&mut self, b: BlockId) {
        if self.refcount[b as usize] == 0 {
            self.evictable.remove(&(self.stamp_of[b as usize], b));
        }
        self.refcount[b as usize] += 1;
    }

    fn release_block(&mut self, b: BlockId) {
        let rc = &mut self.refcount[b as usize];
        *rc = rc.saturating_sub(1);
        if *rc > 0 {
            return;
        }
        if self.registered[b as usize].is_some() {
            self.clock += 1;
            self.stamp_of[b as usize] = self.clock;
            self.evictable.insert((self.clock, b));
        } else {
            self.free.push(b);
        }
    }

    /// Give back every block of a sequence; registered ones stay cached. A partly filled last
    /// block is cached too, as a copy source only: a later prompt that continues the same
    /// prefix copies its matching head (it is never shared, since its owner could have written
    /// on).
    pub fn release(&mut self, seq: &mut SeqBlocks) {
        let bs = self.block_size;
        let full = seq.len / bs;
        if self.prefix_cache
            && !seq.len.is_multiple_of(bs)
            && let Some(&last) = seq.table.get(full)
            && self.refcount[last as usize] == 1
            && self.registered[last as usize].is_none()
        {
            let parent = if full == 0 {
                seq.root()
            } else {
                seq.hashes[full - 1]
            };
            let tokens = seq.tokens[full * bs..seq.len].to_vec();
            // Not in `by_hash`: only the copy-on-write search (`children`) finds it.
            let hash = chain_hash(parent ^ 1, &tokens);
            self.registered[last as usize] = Some(Registered {
                hash,
                parent,
                tokens,
            });
            self.children.entry(parent).or_default().push(last);
        }
        // Deepest first, so that under LRU a prefix outlives its extensions.
        for b in std::mem::take(&mut seq.table).into_iter().rev() {
            self.release_block(b);
        }
        seq.len = 0;
        seq.tokens.clear();
        seq.hashes.clear();
    }

    /// Bind an empty sequence to the cached prefix of its first chunk `tokens`. At most
    /// `limit` positions are reused (the caller keeps the last token to evaluate when it needs
    /// its logits). Returns the positions reused and the copies the backend must make first.
    pub fn bind_prefix(
        &mut self,
        seq: &mut SeqBlocks,
        tokens: &[i32],
        limit: usize,
    ) -> Result<(usize, Vec<BlockCopy>), EngineError> {
        debug_assert!(seq.table.is_empty() && seq.len == 0);
        if !self.prefix_cache || limit == 0 {
            return Ok((0, Vec::new()));
        }
        let bs = self.block_size;
        let limit = limit.min(tokens.len());
        // Full registered blocks along the chain.
        let root = seq.root();
        let mut parent = root;
        let mut full: Vec<(BlockId, u64)> = Vec::new();
        let mut at = 0;
        while at + bs <= tokens.len() {
            let chunk = &tokens[at..at + bs];
            let h = chain_hash(parent, chunk);
            let Some(&b) = self.by_hash.get(&h) else {
                break;
            };
            match &self.registered[b as usize] {
                Some(r) if r.tokens == chunk && r.parent == parent => {}
                _ => break,
            }
            full.push((b, h));
            parent = h;
            at += bs;
        }
        let whole = limit / bs;
        let take = whole.min(full.len());
        for &(b, h) in &full[..take] {
            self.retain(b);
            seq.table.push(b);
            seq.hashes.push(h);
        }
        let mut reused = take * bs;
        let mut copies = Vec::new();
        // The block after them: a head copied from a matching block, privately.
        let parent = if take == 0 { root } else { full[take - 1].1 };
        let want = (limit - reused).min(bs);
        if want > 0 {
            let rest = &tokens[reused..];
            let best = if take < full.len() {
                // The next full block matches whole; only `want` of it may be reused.
                Some((full[take].0, want))
            } else {
                self.children.get(&parent).and_then(|kids| {
                    kids.iter()
                        .filter_map(|&b| {
                            let r = self.registered[b as usize].as_ref()?;
                            let n = r
                                .tokens
                                .iter()
                                .zip(rest)
                                .take_while(|(a, b)| a == b)
                                .count()
                                .min(want);
                            (n > 0).then_some((b, n))
                        })
                        .max_by_key(|&(b, n)| (n, std::cmp::Reverse(b)))
                })
            };
            if let Some((src, n)) = best {
                // The source must survive until the copy runs: take it off the evictable set
                // while allocating the destination.
                self.retain(src);
                let dst = self.allocate();
                self.release_block(src);
                if let Some(dst) = dst {
                    copies.push(BlockCopy { src, dst, slots: n });
                    seq.table.push(dst);
                    reused += n;
                }
            }
        }
        seq.len = reused;
        seq.tokens.extend_from_slice(&tokens[..reused]);
        Ok((reused, copies))
    }

    /// Blocks a sequence needs to grow from `len` to `len + n` positions.
    pub fn blocks_needed(&self, seq: &SeqBlocks, n: usize) -> usize {
        (seq.len + n)
            .div_ceil(self.block_size)
            .saturating_sub(seq.table.len())
    }

    /// Give the sequence room for `n` more positions (the caller checked `available`).
    pub fn grow(&mut self, seq: &mut SeqBlocks, n: usize) -> Result<(), EngineError> {
        for _ in 0..self.blocks_needed(seq, n) {
            let b = self.allocate().ok_or_else(|| {
                EngineError::new(Status::OomRam, "the KV cache has no free block")
            })?;
            seq.table.push(b);
        }
        Ok(())
    }

    /// Record `tokens` as written at the sequence's end and register the blocks they filled.
    pub fn commit(&mut self, seq: &mut SeqBlocks, tokens: &[i32]) {
        let bs = self.block_size;
        seq.tokens.extend_from_slice(tokens);
        seq.len += tokens.len();
        while seq.hashes.len() < seq.len / bs {
            let i = seq.hashes.len();
            let parent = if i == 0 {
                seq.root()
            } else {
                seq.hashes[i - 1]
            };
            let chunk = &seq.tokens[i * bs..(i + 1) * bs];
            let h = chain_hash(parent, chunk);
            seq.hashes.push(h);
            let b = seq.table[i];
            if self.prefix_cache
                && self.registered[b as usize].is_none()
                && !self.by_hash.contains_key(&h)
            {
                self.registered[b as usize] = Some(Registered {
                    hash: h,
                    parent,
                    tokens: chunk.to_vec(),
                });
                self.by_hash.insert(h, b);
                self.children.entry(parent).or_default().push(b);
            }
        }
    }

    /// A new sequence holding what `src` holds (ABI 1.5 `seq_fork`): it shares `src`'s full
    /// blocks (reference counted: a full block is never written again) and gets a private
    /// copy of the partly filled last block, with the same tokens. All or nothing: `OomRam`
    /// when no block is free for that copy. Returns the child and the copy the backend makes.
    pub fn fork(&mut self, src: &SeqBlocks) -> Result<(SeqBlocks, Vec<BlockCopy>), EngineError> {
        let bs = self.block_size;
        let full = src.len / bs;
        let partial = src.len % bs;
        let mut copies = Vec::new();
        // The copy first: nothing is shared when it does not fit.
        let tail = if partial > 0 {
            let dst = self.allocate().ok_or_else(|| {
                EngineError::new(
                    Status::OomRam,
                    "the KV cache has no free block for a forked sequence's last block",
                )
            })?;
            copies.push(BlockCopy {
                src: src.table[full],
                dst,
                slots: partial,
            });
            Some(dst)
        } else {
            None
        };
        let mut table = Vec::with_capacity(full + 1);
        for &b in &src.table[..full] {
            self.retain(b);
            table.push(b);
        }
        table.extend(tail);
        let child = SeqBlocks {
            table,
            len: src.len,
            tokens: src.tokens[..src.len].to_vec(),
            hashes: src.hashes[..full].to_vec(),
            // A fork continues under its source's adapter (its KV was computed so).
            adapter: src.adapter,
        };
        Ok((child, copies))
    }

    /// Keep the first `n_keep` positions of a sequence (ABI 1.5 `seq_truncate`): the blocks
    /// wholly past them are released, and the block that now ends the sequence, when it is
    /// shared or registered in the prefix cache, is replaced by a private copy of its kept
    /// slots (copy on write: the sequence writes on into it, and nobody else may see that).
    /// All or nothing: `OomRam` when that copy has no block and the block is shared (a block
    /// only the cache indexes is unregistered instead). Returns the copy the backend makes.
    pub fn truncate(
        &mut self,
        seq: &mut SeqBlocks,
        n_keep: usize,
    ) -> Result<Vec<BlockCopy>, EngineError> {
        let bs = self.block_size;
        let n_keep = n_keep.min(seq.len);
        let kept = n_keep.div_ceil(bs);
        let partial = n_keep % bs;
        let at = n_keep / bs;
        let cow = partial > 0 && {
            let b = seq.table[at] as usize;
            self.refcount[b] > 1 || self.registered[b].is_some()
        };
        if cow
            && self.refcount[seq.table[at] as usize] > 1
            && self.available() == 0
            && !seq.table[kept..]
                .iter()
                .any(|&b| self.refcount[b as usize] == 1)
        {
            return Err(EngineError::new(
                Status::OomRam,
                "the KV cache has no free block to copy a truncated sequence's shared last block",
            ));
        }
        // Deepest first, as in `release`.
        let dropped: Vec<BlockId> = seq.table.drain(kept..).collect();
        for b in dropped.into_iter().rev() {
            self.release_block(b);
        }
        seq.len = n_keep;
        seq.tokens.truncate(n_keep);
        seq.hashes.truncate(at);
        let mut copies = Vec::new();
        if cow {
            let src = seq.table[at];
            match self.allocate() {
                Some(dst) => {
                    copies.push(BlockCopy {
                        src,
                        dst,
                        slots: partial,
                    });
                    seq.table[at] = dst;
                    self.release_block(src);
                }
                // Checked above: only a block no other sequence reads gets here.
                None => self.unregister(src),
            }
        }
        Ok(copies)
    }

    /// Forget every cached prefix nobody uses (their blocks become free).
    pub fn drop_cached(&mut self) {
        let idle: Vec<(u64, BlockId)> = self.evictable.iter().copied().collect();
        self.evictable.clear();
        for (_, b) in idle {
            self.unregister(b);
            self.free.push(b);
        }
    }
}

#[cfg(test)]
mod tests;
