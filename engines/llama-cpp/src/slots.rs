//! llama.cpp engine, sequence slots (below the engine host's calls, beside `step.rs`): which
//! llama.cpp sequence slot each open Gantry sequence holds, and the warm slots kept for prefix
//! reuse.
//!
//! A released sequence's cells stay in its slot. A new sequence takes the free slot whose
//! cached tokens share the longest prefix with its first prompt chunk and skips those tokens
//! ([`Exec::bind`]). Warm cells are evicted whenever the cache is full
//! ([`Exec::evict_warm`]), so a release still gives its capacity back.

use std::mem::ManuallyDrop;

use gantry_engine_abi::EngineError;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;

use crate::logging;
use crate::sampler::SeqSampler;

/// One open sequence: its llama.cpp slot, next position and sampler state.
pub(crate) struct Seq {
    /// Bound on the first step, when the prompt is known (see `bind`).
    pub(crate) slot: Option<i32>,
    pub(crate) n_past: i32,
    /// Tokens in this sequence's KV cells, in order.
    pub(crate) history: Vec<i32>,
    pub(crate) sampler: Option<SeqSampler>,
    /// Leading tokens of the first chunk taken from a warm slot (ABI 1.4 `seq_cached_tokens`);
    /// set by `bind`.
    pub(crate) cached: Option<usize>,
}

/// A llama.cpp sequence slot no open sequence holds. Its KV may still hold
/// the tokens of the sequence that last used it ("warm"), for prefix reuse.
pub(crate) struct FreeSlot {
    pub(crate) id: i32,
    pub(crate) tokens: Vec<i32>,
    pub(crate) released_at: u64,
}

/// A warm slot whose history goes on longer than this past a new sequence's prefix is shared
/// with it rather than cut. A shorter tail is usually the same conversation coming back (its
/// last reply re-tokenized, the token kept for its logits), which supersedes it.
const SHARE_MIN_TAIL: usize = 32;

/// Everything `step` mutates, behind one lock.
///
/// Prefix cache: a released sequence's cells stay in its slot. A new
/// sequence takes the free slot whose cached tokens share the longest prefix
/// with its first prompt chunk and skips those tokens. When that prefix is only
/// part of the warm slot's cells and an empty slot is free, the sequence takes
/// the empty slot with the prefix's cells shared into it (llama.cpp's unified
/// cache lets cells belong to several sequences), so the warm slot keeps its
/// whole history for the sequence that continues it. Warm cells are evicted
/// whenever the cache is full, so a release still gives its capacity back.
pub(crate) struct Exec {
    pub(crate) ctx: ManuallyDrop<LlamaContext<'static>>,
    pub(crate) batch: LlamaBatch<'static>,
    pub(crate) seqs: std::collections::HashMap<u64, Seq>,
    pub(crate) free_slots: Vec<FreeSlot>,
    pub(crate) next_id: u64,
    pub(crate) clock: u64,
    /// The model's attention window (`<arch>.attention.sliding_window`); 0 = none.
    pub(crate) n_swa: usize,
}

impl Exec {
    /// Give `seq` a slot for a first chunk `tokens`; returns how many leading
    /// tokens its KV already holds. `keep_last` leaves the last token to be
    /// evaluated again when the caller needs its logits; `fresh` takes no
    /// cached prefix at all (`GANTRY_STEP_FRESH`: reproducible sampling), and
    /// on an idle model empties the cache first.
    pub(crate) fn bind(
        &mut self,
        seq: u64,
        tokens: &[i32],
        keep_last: bool,
        fresh: bool,
    ) -> Result<usize, EngineError> {
        let common = |cached: &[i32]| {
            cached
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
        };
        // A seeded sequence on an otherwise idle model starts on an empty cache. In llama.cpp's
        // unified cache, where its cells land (after other conversations' warm cells) changes
        // the rounding of its attention, and at temperature > 0 its text: the same seeded
        // request alone gave another text about one time in three. On a cleared cache (every
        // cell free, the search for free cells back at the first) its cells always land in
        // the same places. Freeing the warm slots one by one would not do: the search would
        // go on from wherever it was. (A KV stream per slot would make this hold on a busy
        // cache too, but cost a third of the throughput at 4 and 8 sequences on CPU.)
        if fresh && !self.seqs.values().any(|s| s.slot.is_some()) {
            self.ctx.clear_kv_cache();
            self.free_slots.iter_mut().for_each(|f| f.tokens.clear());
        }
        // Longest shared prefix wins; then an empty slot; then the least recently released.
        let best = (0..self.free_slots.len())
            .max_by_key(|&i| {
                let f = &self.free_slots[i];
                (
                    // A fresh sequence takes no prefix: it spares the warm slots.
                    if fresh { 0 } else { common(&f.tokens) },
                    f.tokens.is_empty(),
                    std::cmp::Reverse(f.released_at),
                )
            })
            .ok_or_else(|| EngineError::internal("no free slot to bind a sequence"))?;
        let mut slot = self.free_slots.swap_remove(best);
        let mut reuse = if fresh { 0 } else { common(&slot.tokens) };
        if keep_last && reuse == tokens.len() {
            reuse -= 1;
        }
        // A sliding-window cache hands the cells that fell out of a sequence's window to
        // other sequences (warm slots included), oldest first, so a warm slot may have lost
        // its first cells. The prefix is still usable when the window its next token
        // attends to lies above them: always for a continuation of the slot's whole history
        // (the cells inside the window of its next position are never handed out), and, as
        // llama-server decides, when the first cell left is below `reuse - n_swa`. Otherwise
        // start cold.
        let pos_min = self.ctx.kv_cache_seq_pos_min(slot.id);
        let window_kept = reuse == slot.tokens.len()
            || (self.n_swa > 0 && (pos_min.max(0) as usize) < reuse.saturating_sub(self.n_swa));
        if reuse > 0 && pos_min > 0 && !window_kept {
            reuse = 0;
        }
        // Share rather than cut: the warm slot keeps the tail this sequence does not use.
        if reuse > 0
            && slot.tokens.len() - reuse > SHARE_MIN_TAIL
            && let Some(e) = self.free_slots.iter().position(|f| f.tokens.is_empty())
        {
            let empty = self.free_slots[e].id;
            if self
                .ctx
                .copy_kv_cache_seq(slot.id, empty, Some(0), Some(reuse as u32))
                .is_ok()
            {
                let warm = std::mem::replace(&mut slot, self.free_slots.swap_remove(e));
                self.free_slots.push(warm);
            }
        }
        // Drop the cached cells past the shared prefix. Caches that cannot cut a
        // sequence in the middle (recurrent models) refuse: start cold then.
        let cut = self
            .ctx
            .clear_kv_cache_seq(Some(slot.id as u32), Some(reuse as u32), None);
        if reuse > 0 && !matches!(cut, Ok(true)) {
            reuse = 0;
            let _ = self
                .ctx
                .clear_kv_cache_seq(Some(slot.id as u32), None, None);
        }
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| EngineError::internal("binding an unknown sequence"))?;
        s.slot = Some(slot.id);
        s.n_past = reuse as i32;
        s.history = tokens[..reuse].to_vec();
        s.cached = Some(reuse);
        // Tests read this line to check that reuse happened (what the engine evaluates).
        logging::debug(&format!(
            "sequence {seq}: first prompt chunk of {} tokens, {reuse} reused from a warm slot, {} evaluated",
            tokens.len(),
            tokens.len() - reuse
        ));
        Ok(reuse)
    }

    /// Open a sequence (its slot is bound on its first step); `None` when `max` are open.
    pub(crate) fn open(&mut self, max: usize) -> Option<u64> {
        if self.seqs.len() >= max {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Seq {
                slot: None,
                n_past: 0,
                history: Vec::new(),
                sampler: None,
                cached: None,
            },
        );
        Some(id)
    }

    /// Close a sequence. Its cells stay warm for prefix reuse; they are evicted the moment
    /// anyone needs the room (see `step.rs`).
    pub(crate) fn release(&mut self, seq: u64) {
        if let Some(s) = self.seqs.remove(&seq)
            && let Some(id) = s.slot
        {
            self.clock += 1;
            self.free_slots.push(FreeSlot {
                id,
                tokens: s.history,
                released_at: self.clock,
            });
        }
    }

    /// Forget every warm slot's cells; returns whether any were held.
    pub(crate) fn evict_warm(&mut self) -> bool {
        let mut any = false;
        for f in &mut self.free_slots {
            if !f.tokens.is_empty() {
                let _ = self.ctx.clear_kv_cache_seq(Some(f.id as u32), None, None);
                f.tokens.clear();
                any = true;
            }
        }
        any
    }
}

// SAFETY: a llama_context may be used from any thread as long as calls are not
// concurrent; `Exec` is only reached through `LlamaLoaded::exec`'s mutex.
unsafe impl Send for Exec {}
