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

use gantry_engine_abi::{EngineError, SampledToken, Sampling, StepEntry};

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
        let first: Vec<(usize, &[i32], bool)> = feeds
            .iter()
            .map(|(i, range, samples)| {
                let context: &[i32] = wants[*i].context;
                (*i, &context[range.clone()], *samples)
            })
            .collect();
        let sampled = self.step(wants, &first)?;
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
            let feeds: Vec<(usize, &[i32], bool)> = drafting
                .iter()
                .zip(&feed)
                .map(|(&i, t)| (i, &t[..], true))
                .collect();
            let sampled = self.step(wants, &feeds)?;
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

    /// One draft-engine step: each `(want, tokens, samples)` feeds `tokens` to that want's
    /// draft sequence, greedily sampled after the last when `samples`; one slot per entry.
    fn step(
        &mut self,
        wants: &mut [Want<'_>],
        feeds: &[(usize, &[i32], bool)],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let entries: Vec<StepEntry<'_>> = feeds
            .iter()
            .map(|&(i, tokens, samples)| StepEntry {
                seq: wants[i].draft.map(|d| d.seq).unwrap_or_default(),
                tokens,
                sample: samples.then_some(&self.greedy),
                fresh: false,
                allowed: None,
                sample_all: false,
            })
            .collect();
        let result = self.engine.step(&entries);
        drop(entries);
        result.map_err(|e| self.forget(wants, e))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineLimits, Overrun};
    use gantry_api::WorkerCrash;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    /// A toy draft model: after token `t` it predicts `t + 1` (99 ends a generation). It
    /// records what each sequence holds and the tokens of every step.
    #[derive(Default)]
    struct Toy {
        seqs: HashMap<u64, Vec<i32>>,
        next: u64,
        steps: Vec<Vec<(u64, usize)>>,
        released: Vec<u64>,
    }

    struct ToyEngine(Arc<Mutex<Toy>>);

    impl Engine for ToyEngine {
        fn limits(&self) -> EngineLimits {
            EngineLimits {
                max_sequences: 4,
                kv_capacity_tokens: 4096,
                context_length: 64,
                eog_tokens: vec![99],
                speculation: true,
                audio_sample_rate: 0,
            }
        }
        fn seq_open(&mut self) -> Result<u64, EngineError> {
            let mut t = self.0.lock().expect("toy");
            t.next += 1;
            let id = t.next;
            t.seqs.insert(id, Vec::new());
            Ok(id)
        }
        fn seq_release(&mut self, seq: u64) {
            let mut t = self.0.lock().expect("toy");
            t.seqs.remove(&seq);
            t.released.push(seq);
        }
        fn step(
            &mut self,
            entries: &[StepEntry<'_>],
        ) -> Result<Vec<Option<SampledToken>>, EngineError> {
            let mut t = self.0.lock().expect("toy");
            t.steps
                .push(entries.iter().map(|e| (e.seq, e.tokens.len())).collect());
            let mut out = Vec::new();
            for e in entries {
                let held = t.seqs.get_mut(&e.seq).expect("open sequence");
                held.extend_from_slice(e.tokens);
                out.push(e.sample.map(|_| SampledToken {
                    token: (held.last().copied().unwrap_or(0) + 1).min(99),
                    logprob: f32::NAN,
                    top: Vec::new(),
                }));
            }
            Ok(out)
        }
        fn seq_truncate(&mut self, seq: u64, n_keep: u64) -> Result<(), EngineError> {
            let mut t = self.0.lock().expect("toy");
            t.seqs
                .get_mut(&seq)
                .expect("open sequence")
                .truncate(n_keep as usize);
            Ok(())
        }
        fn seq_cached_tokens(&mut self, _seq: u64) -> Option<u64> {
            None
        }
        fn embed_batch(&mut self, _inputs: &[Vec<i32>]) -> Result<Vec<Vec<f32>>, EngineError> {
            Err(EngineError::unsupported("toy"))
        }
        fn token_bytes(&self, _token: i32) -> Vec<u8> {
            Vec::new()
        }
        fn crashed(&self) -> Option<WorkerCrash> {
            None
        }
        fn on_overrun(&self) -> Overrun {
            Overrun::MarkHung
        }
    }

    fn toy() -> (DraftModel, Arc<Mutex<Toy>>) {
        let state = Arc::new(Mutex::new(Toy::default()));
        (DraftModel::new(Box::new(ToyEngine(state.clone()))), state)
    }

    #[test]
    fn a_draft_catches_up_then_decodes_k_tokens_one_step_each_and_keeps_what_was_accepted() {
        let (mut dm, toy) = toy();
        // The target's context: prompt 1..=5 and its pending token 6.
        let mut context = vec![1, 2, 3, 4, 5, 6];
        let mut draft = None;
        let mut wants = [Want {
            context: &context,
            draft: &mut draft,
            k: 3,
        }];
        let out = dm.draft(&mut wants, 512).expect("drafted");
        assert_eq!(out, vec![vec![7, 8, 9]]);
        let d = draft.expect("a draft sequence");
        {
            let t = toy.lock().expect("toy");
            // One catch-up step of the whole context, then one token per step.
            assert_eq!(
                t.steps,
                vec![vec![(d.seq, 6)], vec![(d.seq, 1)], vec![(d.seq, 1)]]
            );
            assert_eq!(t.seqs[&d.seq], [1, 2, 3, 4, 5, 6, 7, 8]);
        }
        // The target kept 1 of the 3 drafted tokens: the draft drops 8 and holds 1..=7.
        let mut d = d;
        assert!(dm.verified(&mut d, 1));
        assert_eq!(toy.lock().expect("toy").seqs[&d.seq], [1, 2, 3, 4, 5, 6, 7]);
        // The target's text goes on with 7 and its own sample 20: only 20 is fed next.
        context.extend([7, 20]);
        let mut draft = Some(d);
        let mut wants = [Want {
            context: &context,
            draft: &mut draft,
            k: 2,
        }];
        assert_eq!(
            dm.draft(&mut wants, 512).expect("drafted"),
            vec![vec![21, 22]]
        );
        let t = toy.lock().expect("toy");
        assert_eq!(
            t.steps[3],
            vec![(d.seq, 1)],
            "a catch-up of the missing token only"
        );
        assert_eq!(t.seqs[&d.seq], [1, 2, 3, 4, 5, 6, 7, 20, 21]);
    }

    #[test]
    fn a_long_catch_up_is_fed_in_chunks_without_drafting_and_an_end_token_stops_a_draft() {
        let (mut dm, toy) = toy();
        let context: Vec<i32> = (1..=10).collect();
        let mut draft = None;
        let mut wants = [Want {
            context: &context,
            draft: &mut draft,
            k: 3,
        }];
        // A budget of 4 catch-up tokens: 10 tokens take three steps, drafting after the last.
        assert_eq!(
            dm.draft(&mut wants, 4).expect("step"),
            vec![Vec::<i32>::new()]
        );
        assert_eq!(
            dm.draft(&mut wants, 4).expect("step"),
            vec![Vec::<i32>::new()]
        );
        assert_eq!(
            dm.draft(&mut wants, 4).expect("step"),
            vec![vec![11, 12, 13]]
        );
        // Near the end token, the draft stops at it.
        let context = vec![96, 97];
        let mut other = None;
        let mut wants = [Want {
            context: &context,
            draft: &mut other,
            k: 5,
        }];
        assert_eq!(dm.draft(&mut wants, 64).expect("step"), vec![vec![98, 99]]);
        // Sequences no running target holds any more are released.
        let keep = draft.expect("first").seq;
        dm.release_unheld(&HashSet::from([keep]));
        let t = toy.lock().expect("toy");
        assert_eq!(t.seqs.keys().copied().collect::<Vec<_>>(), [keep]);
        assert_eq!(t.released, [other.expect("second").seq]);
    }

    #[test]
    fn a_context_past_the_drafts_own_drafts_nothing() {
        let (mut dm, toy) = toy();
        let context: Vec<i32> = (0..62).collect();
        let mut draft = None;
        let mut wants = [Want {
            context: &context,
            draft: &mut draft,
            k: 3,
        }];
        // 62 + 3 tokens would not fit the draft's 64-token context.
        assert_eq!(
            dm.draft(&mut wants, 512).expect("step"),
            vec![Vec::<i32>::new()]
        );
        assert!(draft.is_none() && toy.lock().expect("toy").steps.is_empty());
    }
}
