//! Speculative decoding with a draft model (scheduler thread, before the target's engine
//! step): a smaller model with the same tokenizer decodes the drafts that the target then
//! verifies in one step, exactly as it verifies prompt-lookup drafts (`draft.rs`).
//!
//! Each replica's scheduler owns a private instance of the draft model (vLLM's and
//! llama-server's `-md` arrangement), driven through the same [`Engine`] seam as the target.
//! Every target sequence that drafts has a sequence of its own in the draft engine, which
//! holds a prefix of the target's text (prompt, then generated tokens):
//!
//! 1. **catch up**: the tokens the draft has not seen yet (the whole prompt the first time,
//!    afterwards the last accepted draft token and the target's own sample) go in one entry,
//!    greedily sampled after its last token: the first drafted token. A catch-up longer than
//!    the prefill budget is fed in chunks over several steps without drafting;
//! 2. **draft**: `k - 1` more one-token greedy steps, batched across the sequences that draft;
//!    a sequence stops early at an end-of-generation token;
//! 3. **after verification**: the draft sequence keeps the accepted drafted tokens and drops
//!    the rest (`seq_truncate`), so the next catch-up is at most two tokens.
//!
//! The drafts are greedy, so the verification's rule (a draft token is kept while it equals
//! what the target samples at its position) keeps the target's output exactly what it is
//! without drafts, for greedy and for sampled requests alike. A draft engine that fails a step
//! drops its sequences (they catch up from scratch later); one whose worker died stops
//! drafting for good, and the target goes on without drafts.

use std::collections::HashSet;

use gantry_engine_abi::{EngineError, Sampling, StepEntry};

use crate::engine::Engine;

/// A target sequence's sequence in the draft engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DraftSeq {
    pub(crate) seq: u64,
    /// Leading tokens of the target's context the draft sequence holds.
    pub(crate) fed: usize,
    /// The target's context length when the current draft was made.
    pub(crate) base: usize,
}

/// The draft model of one replica's scheduler.
pub struct DraftModel {
    engine: Box<dyn Engine>,
    /// Draft sequences open in the engine (released once no running sequence holds them).
    open: HashSet<u64>,
    greedy: Sampling,
    context_length: usize,
    eog: Vec<i32>,
}

/// One sequence that wants a draft: its context and its sequence in the draft engine.
pub(crate) struct Want<'a> {
    pub(crate) context: &'a [i32],
    pub(crate) draft: &'a mut Option<DraftSeq>,
    /// Most tokens to draft.
    pub(crate) k: usize,
}

impl DraftModel {
    pub fn new(engine: Box<dyn Engine>) -> Self {
        let limits = engine.limits();
        Self {
            engine,
            open: HashSet::new(),
            greedy: Sampling::greedy(),
            context_length: limits.context_length as usize,
            eog: limits.eog_tokens,
        }
    }

    /// Whether the draft engine's worker died (drafting stops for good).
    pub(crate) fn crashed(&self) -> bool {
        self.engine.crashed().is_some()
    }

    /// Release the draft sequences no running sequence holds any more (however it ended).
    pub(crate) fn release_unheld(&mut self, held: &HashSet<u64>) {
        let gone: Vec<u64> = self.open.difference(held).copied().collect();
        for seq in gone {
            self.open.remove(&seq);
            self.engine.seq_release(seq);
        }
    }

    /// Draft for every entry of `wants` (at most its `k` tokens; empty where it drafts
    /// nothing this step), feeding at most `budget` catch-up tokens in all.
    pub(crate) fn draft(
        &mut self,
        wants: &mut [Want<'_>],
        budget: usize,
    ) -> Result<Vec<Vec<i32>>, EngineError> {
        let mut out = vec![Vec::new(); wants.len()];
        let mut budget = budget;
        // Round 1: catch up, and sample the first drafted token where it caught up whole.
        let mut feeds: Vec<(usize, std::ops::Range<usize>, bool)> = Vec::new();
        for (i, w) in wants.iter_mut().enumerate() {
            let len = w.context.len();
            if w.k == 0 || len + w.k > self.context_length {
                continue;
            }
            let d = match w.draft {
                Some(d) => d,
                None => match self.engine.seq_open() {
                    Ok(seq) => {
                        self.open.insert(seq);
                        w.draft.insert(DraftSeq {
                            seq,
                            fed: 0,
                            base: 0,
                        })
                    }
                    Err(_) => continue, // the draft engine is full: no draft this time
                },
            };
            let missing = len.saturating_sub(d.fed);
            if missing == 0 || budget == 0 {
                continue;
            }
            let take = missing.min(budget);
            budget -= take;
            feeds.push((i, d.fed..d.fed + take, take == missing));
        }
        if feeds.is_empty() {
            return Ok(out);
        }
        let first = {
            let entries: Vec<StepEntry<'_>> = feeds
                .iter()
                .map(|(i, range, samples)| StepEntry {
                    seq: wants[*i].draft.map(|d| d.seq).unwrap_or_default(),
                    tokens: &wants[*i].context[range.clone()],
                    sample: samples.then_some(&self.greedy),
                    fresh: false,
                    allowed: None,
                    sample_all: false,
                })
                .collect();
            self.engine.step(&entries)
        };
        let sampled = match first {
            Ok(s) => s,
            Err(e) => return Err(self.forget(wants, e)),
        };
        // `step` returns one slot per entry, in entry order (`None` where it did not sample).
        let mut drafting: Vec<usize> = Vec::new();
        for ((i, range, _), s) in feeds.iter().zip(sampled) {
            let w = &mut wants[*i];
            if let Some(d) = w.draft.as_mut() {
                d.fed = range.end;
                d.base = w.context.len();
            }
            if let Some(t) = s {
                out[*i].push(t.token);
                if !self.eog.contains(&t.token) && w.k > 1 {
                    drafting.push(*i);
                }
            }
        }
        // Rounds 2..k: one greedy token per sequence and step.
        while !drafting.is_empty() {
            let feed: Vec<[i32; 1]> = drafting
                .iter()
                .map(|&i| [*out[i].last().unwrap_or(&0)])
                .collect();
            let result = {
                let entries: Vec<StepEntry<'_>> = drafting
                    .iter()
                    .zip(&feed)
                    .map(|(&i, t)| StepEntry {
                        seq: wants[i].draft.map(|d| d.seq).unwrap_or_default(),
                        tokens: t,
                        sample: Some(&self.greedy),
                        fresh: false,
                        allowed: None,
                        sample_all: false,
                    })
                    .collect();
                self.engine.step(&entries)
            };
            let sampled = match result {
                Ok(s) => s,
                Err(e) => return Err(self.forget(wants, e)),
            };
            let mut next = Vec::with_capacity(drafting.len());
            for (&i, s) in drafting.iter().zip(sampled) {
                if let Some(d) = wants[i].draft.as_mut() {
                    d.fed += 1;
                }
                let Some(t) = s else { continue };
                out[i].push(t.token);
                if !self.eog.contains(&t.token) && out[i].len() < wants[i].k {
                    next.push(i);
                }
            }
            drafting = next;
        }
        Ok(out)
    }

    /// After the target verified a draft of this sequence and kept `kept` of its tokens: the
    /// draft sequence keeps the context and those tokens. `false` when the engine could not
    /// truncate (the caller drops the draft sequence; it catches up from scratch).
    pub(crate) fn verified(&mut self, d: &mut DraftSeq, kept: usize) -> bool {
        let keep = d.base + kept;
        if d.fed <= keep {
            return true;
        }
        match self.engine.seq_truncate(d.seq, keep as u64) {
            Ok(()) => {
                d.fed = keep;
                true
            }
            Err(_) => false,
        }
    }

    /// A failed draft step: every sequence that took part catches up from scratch.
    fn forget(&mut self, wants: &mut [Want<'_>], e: EngineError) -> EngineError {
        for w in wants.iter_mut() {
            if let Some(d) = w.draft.take() {
                self.open.remove(&d.seq);
                self.engine.seq_release(d.seq);
            }
        }
        e
    }
}
