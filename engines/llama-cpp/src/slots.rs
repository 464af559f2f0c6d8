//! llama.cpp engine, sequence slots (below the engine host's calls, beside `step.rs`): which
//! llama.cpp sequence slot each open Gantry sequence holds, the warm slots kept for prefix
//! reuse, and forking and truncating sequences (ABI 1.5).
//!
//! A released sequence's cells stay in its slot. A new sequence takes the free slot whose
//! cached tokens share the longest prefix with its first prompt chunk and skips those tokens
//! ([`Exec::bind`]). Warm cells are evicted whenever the cache is full
//! ([`Exec::evict_warm`]), so a release still gives its capacity back. A fork takes a slot at
//! once with its source's cells shared into it ([`Exec::fork`]); a truncation drops the cells
//! of rejected drafts after a verification step ([`Exec::truncate`], which also says what a
//! sliding-window cache does to them).
//!
//! Adapters (ABI 1.6): a sequence runs one adapter (or the base) from its first step on, a fork
//! runs its source's, and a warm slot remembers the adapter its cells were computed under: a
//! new sequence takes a warm prefix only from a slot of its own adapter.

use std::mem::ManuallyDrop;

use gantry_engine_abi::EngineError;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::token::LlamaToken;

use crate::adapters::LoraAdapter;
use crate::backend_sampling::{Attacher, BackendChain};
use crate::sampler::SeqSampler;
use crate::{logging, oom};

/// One open sequence: its llama.cpp slot, next position and sampler state.
pub(crate) struct Seq {
    /// Bound on the first step, when the prompt is known (see `bind`).
    pub(crate) slot: Option<i32>,
    pub(crate) n_past: i32,
    /// Tokens in this sequence's KV cells, in order.
    pub(crate) history: Vec<i32>,
    pub(crate) sampler: Option<SeqSampler>,
    /// Its chain in llama.cpp's backend, when it samples there (`backend_sampling.rs`): then
    /// `sampler` stays `None`.
    pub(crate) backend: Option<BackendChain>,
    /// The chain its slot came with (`FreeSlot::backend`), until its first sample keeps or
    /// replaces it (`Exec::choose_samplers`).
    pub(crate) inherited: Option<BackendChain>,
    /// Leading tokens of the first chunk taken from a warm slot (ABI 1.4 `seq_cached_tokens`);
    /// set by `bind`.
    pub(crate) cached: Option<usize>,
    /// The LoRA adapter it runs (ABI 1.6 `seq_set_adapter`); 0 = the base model.
    pub(crate) adapter: u64,
}

/// A llama.cpp sequence slot no open sequence holds. Its KV may still hold
/// the tokens of the sequence that last used it ("warm"), for prefix reuse.
pub(crate) struct FreeSlot {
    pub(crate) id: i32,
    pub(crate) tokens: Vec<i32>,
    pub(crate) released_at: u64,
    /// The adapter `tokens`' cells were computed under (0 = the base model).
    pub(crate) adapter: u64,
    /// The backend chain of the sequence that last held the slot, still attached: detaching
    /// it would make llama.cpp reserve its graph again, so it waits for the next sequence,
    /// which keeps it (greedy) or replaces it in one reservation (`backend_sampling.rs`).
    pub(crate) backend: Option<BackendChain>,
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
    /// Loaded LoRA adapters by id (`adapters.rs`), the next id, and the one the context runs
    /// now (0 = none).
    pub(crate) adapters: std::collections::HashMap<u64, LoraAdapter>,
    pub(crate) next_adapter: u64,
    pub(crate) active_adapter: u64,
    /// Attaches backend sampler chains to slots; `None` = every sequence samples on the host.
    pub(crate) attacher: Option<Attacher>,
    /// llama.cpp's pointer to `ctx`, for its count of reused graphs; `None` when the binding
    /// does not show it.
    pub(crate) raw: Option<crate::backend_sampling::RawContext>,
    /// The context's `n_ubatch`, and the ubatches its decodes have run (`decode`).
    pub(crate) n_ubatch: u64,
    pub(crate) ubatches: u64,
}

impl Exec {
    /// `llama_decode` of the batch, counted: llama.cpp splits it into ubatches of `n_ubatch`
    /// tokens, and builds (or reuses) one graph for each.
    pub(crate) fn decode(&mut self) -> Result<(), llama_cpp_2::DecodeError> {
        let n = self.batch.n_tokens().max(0) as u64;
        self.ubatches += n.div_ceil(self.n_ubatch.max(1)).max(1);
        self.ctx.decode(&mut self.batch)
    }

    /// The context's counters (ABI 1.12): ubatches computed, graphs built and reused for them
    /// (on a CUDA backend a reused graph is replayed as a CUDA graph and a built one captured
    /// again), and backend sampler chains attached (each a reservation of llama.cpp's graphs).
    pub(crate) fn counters(&self) -> Vec<(&'static str, u64)> {
        let mut out = vec![("ubatches", self.ubatches)];
        if let Some(raw) = &self.raw {
            let reused = raw.graphs_reused().min(self.ubatches);
            out.push(("graph_reuses", reused));
            out.push(("graph_builds", self.ubatches - reused));
        }
        if let Some(a) = &self.attacher {
            out.push(("sampler_attaches", a.attached.get()));
        }
        out
    }

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
        let adapter = self
            .seqs
            .get(&seq)
            .ok_or_else(|| EngineError::internal("binding an unknown sequence"))?
            .adapter;
        // KV computed under another adapter (or the base) is no prefix of this sequence's.
        let common = |f: &FreeSlot| {
            if f.adapter != adapter {
                return 0;
            }
            f.tokens
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
                    if fresh { 0 } else { common(f) },
                    f.tokens.is_empty(),
                    std::cmp::Reverse(f.released_at),
                )
            })
            .ok_or_else(|| EngineError::internal("no free slot to bind a sequence"))?;
        let mut slot = self.free_slots.swap_remove(best);
        let mut reuse = if fresh { 0 } else { common(&slot) };
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
        s.inherited = slot.backend;
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
                backend: None,
                inherited: None,
                cached: None,
                adapter: 0,
            },
        );
        Some(id)
    }

    /// Close a sequence. Its cells stay warm for prefix reuse; they are evicted the moment
    /// anyone needs the room (see `step.rs`).
    pub(crate) fn release(&mut self, seq: u64) {
        let Some(s) = self.seqs.remove(&seq) else {
            return;
        };
        if let Some(id) = s.slot {
            self.clock += 1;
            self.free_slots.push(FreeSlot {
                id,
                tokens: s.history,
                released_at: self.clock,
                adapter: s.adapter,
                // Left attached (see `FreeSlot::backend`).
                backend: s.backend.or(s.inherited),
            });
        }
    }

    /// Open a sequence whose KV holds what `src`'s holds (ABI 1.5 `seq_fork`), bound at once
    /// to a slot of its own: an empty one, else the least recently released warm one (its
    /// cells go). `src`'s cells are shared into it, not copied (llama.cpp's unified cache lets
    /// a cell belong to several slots), so a fork takes no KV room until the two diverge. The
    /// new sequence has no sampler: its first sample builds its own, with its own seed.
    pub(crate) fn fork(&mut self, src: u64, max: usize) -> Result<u64, EngineError> {
        let s = self
            .seqs
            .get(&src)
            .ok_or_else(|| EngineError::internal(format!("fork of unknown sequence {src}")))?;
        let Some(from) = s.slot else {
            return Err(EngineError::unsupported(format!(
                "sequence {src} has not been stepped: its KV holds nothing to fork"
            )));
        };
        let (n_past, history, adapter) = (s.n_past, s.history.clone(), s.adapter);
        if self.seqs.len() >= max {
            return Err(oom(format!("all {max} sequence slots are in use")));
        }
        // Fewer than `max` sequences are open, so fewer than `max` slots are bound.
        let best = (0..self.free_slots.len())
            .max_by_key(|&i| {
                let f = &self.free_slots[i];
                (f.tokens.is_empty(), std::cmp::Reverse(f.released_at))
            })
            .ok_or_else(|| oom("no free sequence slot to fork into".to_string()))?;
        let FreeSlot {
            id: slot,
            backend: inherited,
            ..
        } = self.free_slots.swap_remove(best);
        let _ = self.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
        self.ctx
            .copy_kv_cache_seq(from, slot, None, None)
            .map_err(|e| EngineError::internal(format!("fork of sequence {src}: {e}")))?;
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Seq {
                slot: Some(slot),
                n_past,
                history,
                sampler: None,
                backend: None,
                inherited,
                // Its first entry is evaluated whole: nothing of it comes from a cache.
                cached: Some(0),
                // The shared cells were computed under the source's adapter.
                adapter,
            },
        );
        logging::debug(&format!(
            "sequence {id}: forked from sequence {src} at {n_past} tokens"
        ));
        Ok(id)
    }

    /// Keep the first `n_keep` tokens of `seq` and drop the rest (ABI 1.5 `seq_truncate`),
    /// with the samples taken after them (its penalties forget them). `n_batch` is the most
    /// tokens one decode takes (see the window check below).
    ///
    /// Sliding-window caches (Gemma 2 and 3; Gemma 3 270M's window is 512 tokens). What the
    /// vendored llama.cpp does (`src/llama-kv-cache.cpp`, `find_slot` and `apply_ubatch`): a
    /// ubatch looking for cells takes, in scan order, any empty cell or any cell held by one
    /// sequence only whose position is outside that sequence's window as of its *current*
    /// last position (`is_masked_swa(n_swa, pos, seq_pos_max + 1)`), and then purges that
    /// sequence's older positions too, to keep its cells contiguous; `seq_rm` brings nothing
    /// back. After a verification adds k drafts to a sequence of n tokens (positions
    /// `n..n + k`) and the truncation keeps `n_keep` (at least n), the cells at positions
    /// `(n_keep - n_swa, n + k - n_swa]` count as outside the window, though position
    /// `n_keep`, where the sequence goes on, still attends to them. So adding k tokens and
    /// removing them CAN free cells inside the window of `n_keep`, when all of these hold:
    /// the sequence held more than `n_swa` tokens with the drafts (`n + k > n_swa`; while the
    /// whole sequence fits in the window nothing of it is
    /// outside, and truncation is exact as with a full cache); a cell search runs between the
    /// verification and the truncation (the host truncates right after the step, so only a
    /// later ubatch of the same step: more than n_ubatch = 512 tokens, a verification beside
    /// a prefill chunk); that search reaches those cells before the free ones; and the cells
    /// are not shared with another slot (a fork's, a shared prefix's: never taken). This
    /// plugin's contexts keep llama.cpp's default full-size SWA cache (`swa_full`, which
    /// llama-cpp-2 does not set: as many cells as the whole context), whose scans meet free
    /// cells before they wrap around to masked ones unless the cache is fragmented (on a
    /// fresh cache the full-attention cache, as large, runs out first; steps built to provoke
    /// the loss did not). Still: the step puts verification entries last in its batch
    /// (in its last ubatch unless they straddle a ubatch boundary), and this checks that
    /// every cell position `n_keep` attends to is there (a sequence's positions are
    /// contiguous, so the first one left, `seq_pos_min`, must be at most
    /// `n_keep + 1 - n_swa`). When some went, the kept tokens are evaluated again from
    /// position 0: exact, at the cost of a prefill of `n_keep` tokens (a lost position's
    /// window cells cannot be recomputed without the window before it, and so on back to the
    /// first token).
    pub(crate) fn truncate(
        &mut self,
        seq: u64,
        n_keep: usize,
        n_batch: usize,
    ) -> Result<(), EngineError> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| EngineError::internal(format!("truncate of unknown sequence {seq}")))?;
        let held = s.n_past as usize;
        if n_keep > held {
            return Err(EngineError::internal(format!(
                "cannot keep {n_keep} tokens of sequence {seq}: it holds {held}"
            )));
        }
        // Nothing to drop (an unbound sequence holds nothing, so it always ends here).
        let Some(slot) = s.slot.filter(|_| n_keep < held) else {
            return Ok(());
        };
        // Caches that cannot cut a sequence in the middle (recurrent and hybrid models)
        // refuse, and are left as they were.
        if !matches!(
            self.ctx
                .clear_kv_cache_seq(Some(slot as u32), Some(n_keep as u32), None),
            Ok(true)
        ) {
            return Err(EngineError::unsupported(format!(
                "this model's cache cannot drop the last tokens of sequence {seq} \
                 (a recurrent or hybrid model)"
            )));
        }
        s.n_past = n_keep as i32;
        s.history.truncate(n_keep);
        if let Some(sampler) = &mut s.sampler {
            sampler.forget_after(n_keep);
        }
        let first = self.ctx.kv_cache_seq_pos_min(slot);
        let needed = (n_keep + 1).saturating_sub(self.n_swa);
        if self.n_swa == 0 || (0..=needed as i32).contains(&first) {
            return Ok(());
        }
        logging::debug(&format!(
            "sequence {seq}: window cells from {needed} lost (first left {first}), \
             evaluating its {n_keep} kept tokens again"
        ));
        self.reevaluate(seq, slot, n_batch)
    }

    /// Evaluate `seq`'s kept tokens (its `history`) again into its slot from position 0, in
    /// chunks of at most `n_batch`, without logits. On failure the sequence keeps what was
    /// evaluated (its host releases it).
    fn reevaluate(&mut self, seq: u64, slot: i32, n_batch: usize) -> Result<(), EngineError> {
        let _ = self.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
        let (history, adapter) = self
            .seqs
            .get(&seq)
            .map(|s| (s.history.clone(), s.adapter))
            .unwrap_or_default();
        let mut done = 0;
        // Under the adapter its cells were computed with.
        let mut result = self.use_adapter(adapter);
        let chunks = if result.is_ok() {
            history.as_slice()
        } else {
            &[]
        };
        for chunk in chunks.chunks(n_batch.max(1)) {
            self.batch.clear();
            for (i, &t) in chunk.iter().enumerate() {
                result = self
                    .batch
                    .add(LlamaToken(t), (done + i) as i32, &[slot], false)
                    .map_err(|e| EngineError::internal(format!("batch: {e}")));
                if result.is_err() {
                    break;
                }
            }
            let mut evicted = false;
            while result.is_ok() {
                match self.decode() {
                    Ok(()) => break,
                    // Full: drop the warm cells of released sequences and try once more.
                    Err(llama_cpp_2::DecodeError::NoKvCacheSlot)
                        if !evicted && self.evict_warm() =>
                    {
                        evicted = true;
                    }
                    Err(llama_cpp_2::DecodeError::NoKvCacheSlot) => {
                        result = Err(oom("KV cache is full".to_string()));
                    }
                    Err(e) => {
                        result = Err(EngineError::internal(format!("llama_decode failed: {e}")));
                    }
                }
            }
            if result.is_err() {
                break;
            }
            done += chunk.len();
        }
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.n_past = done as i32;
            s.history.truncate(done);
        }
        result
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

// SAFETY: a llama_context (and a LoRA adapter, which only contexts and its free read) may be
// used from any thread as long as calls are not concurrent; `Exec` is only reached through
// `LlamaLoaded::exec`'s mutex.
unsafe impl Send for Exec {}

#[cfg(test)]
mod tests {
    use gantry_engine_abi::sdk::Model;
    use gantry_engine_abi::{Sampling, StepEntry};

    #[test]
    fn a_truncation_that_finds_window_cells_gone_evaluates_the_kept_tokens_again() {
        let model = crate::testing::load_gemma(1, 1024);
        assert_eq!(model.exec().n_swa, 512, "Gemma 3's window");
        let mut text = String::from("Notes on the rivers of France.");
        let prompt = loop {
            let p = model.tokenize(text.as_bytes(), true, false).expect("tok");
            if p.len() >= 300 {
                break p;
            }
            text.push_str(&format!(" The river {} flows past a town.", p.len()));
        };
        let g = Sampling::greedy();
        let step = |seq, tokens: &[i32], all| {
            let e = StepEntry {
                seq,
                tokens,
                sample: Some(&g),
                fresh: true,
                allowed: None,
                sample_all: all,
            };
            let out = model.step(&[e]).expect("step");
            out.into_iter()
                .map(|t| t.expect("sampled").token)
                .collect::<Vec<_>>()
        };
        // The plain greedy continuation.
        let seq = model.seq_open().expect("seq");
        let mut want = step(seq, &prompt, false);
        for _ in 0..8 {
            let t = step(seq, &want[want.len() - 1..], false);
            want.extend(t);
        }
        model.seq_release(seq);
        // A verification whose second draft is wrong; then the cells of positions 0..100 go
        // (from both caches, which a sliding-window cache never loses, but the check reads the
        // same thing: the first position left is inside the window of the next one).
        let seq = model.seq_open().expect("seq");
        assert_eq!(step(seq, &prompt, false), want[..1]);
        let wrong = (want[1] + 1) % 1000;
        let got = step(seq, &[want[0], wrong, want[2]], true);
        assert_eq!(got[0], want[1]);
        let slot = model.exec().seqs[&seq].slot.expect("bound");
        let cut = model
            .exec()
            .ctx
            .clear_kv_cache_seq(Some(slot as u32), Some(0), Some(100));
        assert_eq!(cut, Ok(true));
        model.seq_truncate(seq, prompt.len() + 1).expect("truncate");
        assert_eq!(
            model.exec().ctx.kv_cache_seq_pos_min(slot),
            0,
            "evaluated again"
        );
        assert_eq!(model.exec().seqs[&seq].n_past as usize, prompt.len() + 1);
        let mut next = got[0];
        for (i, &w) in want[2..].iter().enumerate() {
            next = step(seq, &[next], false)[0];
            assert_eq!(next, w, "token {} after the truncation", i + 2);
        }
        model.seq_release(seq);
    }
}
