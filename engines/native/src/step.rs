//! Native engine, the step (between the ABI's `Model::step` in `lib.rs` and the backend): one
//! batch of entries through the KV bookkeeping ([`crate::kv`]), one forward pass
//! ([`crate::backend`]) and the samplers ([`crate::sampler`]).
//!
//! Each entry's sequence is bound to its cached prefix on its first chunk, gets the blocks its
//! new tokens need (all or nothing: a step that does not fit fails before any KV changes), the
//! backend runs every token of the batch in one forward pass, full blocks are registered for
//! reuse, and each sampling entry draws its token. An entry with `sample_all` (ABI 1.5,
//! speculative decoding: the host verifies drafted tokens) wants a logits row after every one
//! of its tokens; its rows are sampled in order with the sequence's sampler, each sample
//! recorded before the next, as if the tokens had been fed one per step. The results are flat:
//! one slot per entry, `tokens.len()` for a `sample_all` entry.
//!
//! LoRA adapters (ABI 1.6): the flattened rows of consecutive entries whose sequences run the
//! same adapter form one run ([`crate::lora::AdapterRun`]); the backend adds each run's update
//! to its rows only. Base entries form no run.

use gantry_engine_abi::{EngineError, LogLevel, SampledToken, Status, StepEntry};

use crate::backend::{SampleRow, StepInput};
use crate::lora::{AdapterRun, push_run};
use crate::sampler::SeqSampler;
use crate::{DecoderModel, Exec};

impl DecoderModel {
    /// `Model::step`: see the module header.
    pub(crate) fn run_step(
        &self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let mut guard = self.exec();
        let ex = &mut *guard;
        self.check(ex, entries)?;
        // Bind new sequences to their cached prefix (copies happen now, while their sources
        // are known to be alive).
        let mut skip = vec![0usize; entries.len()];
        for (i, e) in entries.iter().enumerate() {
            let s = ex.seqs.get_mut(&e.seq).expect("checked above");
            if s.cached.is_some() {
                continue;
            }
            // Every token whose logits are wanted is evaluated: the last one for a sample, all
            // of them for a sample after every token.
            let limit = if e.fresh || e.verifies() {
                0
            } else {
                e.tokens.len() - usize::from(e.sample.is_some())
            };
            let (reused, copies) = ex.pool.bind_prefix(&mut s.blocks, e.tokens, limit)?;
            ex.backend.copy_blocks(&copies);
            skip[i] = reused;
            s.cached = Some(reused);
            self.log.log(
                LogLevel::Debug,
                &format!(
                    "sequence {}: first prompt chunk of {} tokens, {reused} reused from the prefix cache, {} evaluated",
                    e.seq,
                    e.tokens.len(),
                    e.tokens.len() - reused
                ),
            );
        }
        // All the blocks the step needs, or none.
        let needed: usize = entries
            .iter()
            .zip(&skip)
            .map(|(e, &k)| {
                ex.pool
                    .blocks_needed(&ex.seqs[&e.seq].blocks, e.tokens.len() - k)
            })
            .sum();
        if needed > ex.pool.available() {
            return Err(EngineError::new(
                Status::OomRam,
                format!(
                    "the KV cache is full: the step needs {needed} blocks, {} are free",
                    ex.pool.available()
                ),
            ));
        }
        for (e, &k) in entries.iter().zip(&skip) {
            let s = ex.seqs.get_mut(&e.seq).expect("checked above");
            ex.pool.grow(&mut s.blocks, e.tokens.len() - k)?;
        }
        // Every sampling sequence's state, made on its first sample.
        for e in entries {
            if let Some(params) = e.sample {
                let s = ex.seqs.get_mut(&e.seq).expect("checked above");
                s.sampler.get_or_insert_with(|| SeqSampler::new(params));
            }
        }
        // Flatten the batch.
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut seq_of = Vec::new();
        let mut logits_rows = Vec::new();
        let mut tables: Vec<&[u32]> = Vec::with_capacity(entries.len());
        let mut slots = Vec::with_capacity(entries.len());
        let mut adapters: Vec<AdapterRun> = Vec::new();
        for (i, (e, &k)) in entries.iter().zip(&skip).enumerate() {
            let s = &ex.seqs[&e.seq];
            tables.push(&s.blocks.table);
            slots.push(s.slot);
            let start = tokens.len();
            for (j, &t) in e.tokens[k..].iter().enumerate() {
                if e.verifies() {
                    logits_rows.push(tokens.len());
                }
                tokens.push(t);
                positions.push(s.blocks.len + j);
                seq_of.push(i);
            }
            if e.sample.is_some() && !e.verifies() {
                logits_rows.push(tokens.len() - 1);
            }
            push_run(&mut adapters, start..tokens.len(), s.blocks.adapter);
        }
        let input = StepInput {
            tokens: &tokens,
            positions: &positions,
            seq_of: &seq_of,
            tables: &tables,
            logits_rows: &logits_rows,
            adapters: &adapters,
            slots: &slots,
        };
        // A backend that samples on its device hands back tokens (the sequences' sampling
        // state goes in); otherwise logits come back and are sampled here. A step verifying
        // drafts samples several rows of one sequence in order, each seeing the samples before
        // it: it takes the host path.
        let on_device = ex.backend.samples_on_device() && !entries.iter().any(StepEntry::verifies);
        let mut from_device = None;
        let logits = if tokens.is_empty() {
            Vec::new()
        } else if on_device {
            let rows: Vec<SampleRow<'_>> = entries
                .iter()
                .filter_map(|e| {
                    let sampler = ex.seqs[&e.seq].sampler.as_ref()?;
                    Some(SampleRow {
                        params: e.sample?,
                        allowed: e.allowed,
                        generated: sampler.generated(),
                        draw: sampler.generated().len() as u64,
                    })
                })
                .collect();
            from_device = Some(ex.backend.forward_sample(&input, &rows)?.into_iter());
            Vec::new()
        } else {
            ex.backend.forward(&input)?
        };
        drop(tables);
        let slots: usize = entries.iter().map(StepEntry::result_slots).sum();
        let mut out = Vec::with_capacity(slots);
        // Each sampled row in place: the step owns the logits, nothing reads them afterwards.
        let mut logits = logits;
        let mut rows = logits.chunks_exact_mut(self.vocab);
        for (e, &k) in entries.iter().zip(&skip) {
            let s = ex.seqs.get_mut(&e.seq).expect("checked above");
            ex.pool.commit(&mut s.blocks, &e.tokens[k..]);
            let Some(params) = e.sample else {
                out.push(None);
                continue;
            };
            let sampler = s.sampler.as_mut().ok_or_else(|| {
                EngineError::internal("a sampling sequence without its sampler state")
            })?;
            // In token order: each sample is recorded before the next is drawn.
            for _ in 0..e.result_slots() {
                let sampled = match from_device.as_mut() {
                    Some(tokens) => {
                        let t = tokens.next().ok_or_else(|| {
                            EngineError::internal("the backend sampled too few rows")
                        })?;
                        sampler.record(t.token);
                        t
                    }
                    None => {
                        let l = rows.next().ok_or_else(|| {
                            EngineError::internal("the backend returned too few logits rows")
                        })?;
                        sampler.sample(l, params, e.allowed)?
                    }
                };
                out.push(Some(sampled));
            }
        }
        Ok(out)
    }

    /// Check every entry before anything changes.
    fn check(&self, ex: &Exec, entries: &[StepEntry<'_>]) -> Result<(), EngineError> {
        let ctx = self.info.context_length as usize;
        for e in entries {
            let s = ex.seqs.get(&e.seq).ok_or_else(|| {
                EngineError::internal(format!("step on unknown sequence {}", e.seq))
            })?;
            if e.sample.is_some() && e.tokens.is_empty() {
                return Err(EngineError::internal(format!(
                    "sequence {} asks for a sample without tokens",
                    e.seq
                )));
            }
            if e.verifies() && self.config.mamba.is_some() {
                // Its rejected drafts could not be dropped afterwards (`seq_truncate`).
                return Err(EngineError::unsupported(format!(
                    "sequence {}: a sample after every token (draft verification) on {}, whose state-space layers cannot be cut back",
                    e.seq, self.info.architecture
                )));
            }
            if e.verifies() && e.allowed.is_some() {
                return Err(EngineError::unsupported(format!(
                    "sequence {}: a sample after every token (draft verification) with an allowed-token mask",
                    e.seq
                )));
            }
            if s.blocks.len + e.tokens.len() > ctx {
                return Err(EngineError::unsupported(format!(
                    "sequence {} would hold {} tokens, its context is {ctx}",
                    e.seq,
                    s.blocks.len + e.tokens.len()
                )));
            }
        }
        Ok(())
    }
}
