//! One engine step (scheduler thread, after admission): plan the batch ([`crate::batch`]),
//! compute the allowed-token masks of the constrained sequences that sample (in parallel),
//! run the engine, then turn each sampled token into text (incremental UTF-8, stop
//! sequences, end-of-generation tokens, grammar end, `max_tokens`) and send it.

use std::time::Instant;

use gantry_engine_abi::{EngineError, SampledToken, StepEntry};

use crate::batch::{Planned, plan_step};
use crate::draft::{accepted, prompt_lookup};
use crate::draft_len::{Candidate, choose};
use crate::engine::Engine;
use crate::job::{FinishReason, GenError, GenEvent, TokenLogprob};
use crate::metrics::SchedulerMetrics;
use crate::run::{Running, Scheduler};
use crate::text_stream::StopScan;

/// The draft length of a seeded request that samples, where lengths are otherwise adaptive
/// (see `cut_drafts`): what a step of 4 tokens verifies, the cheapest multi-token step on
/// llama.cpp's CPU kernels.
const SEEDED_DRAFT_TOKENS: usize = 3;

impl<E: Engine> Scheduler<E> {
    pub(crate) fn step(&mut self) {
        self.start_forks();
        self.release_drafts();
        let progress: Vec<_> = self.running.iter().map(Running::progress).collect();
        let plan = plan_step(&progress, self.settings.prefill_chunk_tokens);
        if plan.is_empty() {
            return;
        }
        if !self.compute_masks(&plan) {
            return; // a grammar failed: its request ended; plan again without it
        }
        let drafts = self.drafts(&plan);
        // What each decode entry feeds: its pending token, then its draft.
        let decode_tokens: Vec<Vec<i32>> = plan
            .iter()
            .zip(&drafts)
            .filter(|(p, _)| p.prompt_tokens == 0)
            .map(|(p, d)| {
                let mut t = Vec::with_capacity(1 + d.len());
                t.push(self.running[p.index].next.unwrap_or_default());
                t.extend_from_slice(d);
                t
            })
            .collect();
        let mut decode = decode_tokens.iter();
        let mut entries: Vec<StepEntry<'_>> = Vec::with_capacity(plan.len());
        let mut total = 0usize;
        for (p, d) in plan.iter().zip(&drafts) {
            let r = &self.running[p.index];
            let tokens: &[i32] = match p.prompt_tokens {
                0 => decode.next().map(|t| &t[..]).unwrap_or_default(),
                n => &r.job.prompt[r.fed..r.fed + n],
            };
            total += tokens.len();
            entries.push(StepEntry {
                seq: r.seq,
                tokens,
                sample: p.samples.then_some(&r.job.sampling),
                fresh: r.job.fresh,
                allowed: r
                    .job
                    .grammar
                    .as_deref()
                    .filter(|_| p.samples)
                    .map(|g| g.mask()),
                sample_all: !d.is_empty(),
            });
        }
        self.metrics.steps.inc();
        self.metrics.step_tokens.observe(total as f64);
        self.figures.step_began(self.epoch);
        let began = Instant::now();
        let result = self.engine.step(&entries);
        if plan.iter().all(|p| p.prompt_tokens == 0) {
            self.step_costs
                .observe(total, began.elapsed().as_secs_f64());
        }
        self.figures.step_ended();
        drop(entries);

        let results = match result {
            Ok(r) => r,
            Err(_) if self.check_crash() => return,
            Err(e) => return self.fail_step(&plan, e),
        };
        let now = Instant::now();
        let mut results = results.into_iter();
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        for (p, draft) in plan.iter().zip(&drafts) {
            let sampled: Vec<Option<SampledToken>> =
                results.by_ref().take(1 + draft.len()).collect();
            let r = &mut self.running[p.index];
            if p.prompt_tokens > 0 && r.fed == 0 {
                // The prompt's first chunk ran: the engine now knows what it took from a cache.
                r.cached = self.engine.seq_cached_tokens(r.seq).map(|c| {
                    let prompt = r.job.prompt.len() as u64;
                    let c = c.min(prompt);
                    self.metrics.prompt_tokens_cached.inc_by(c);
                    self.metrics.prompt_tokens_evaluated.inc_by(prompt - c);
                    c as u32
                });
            }
            r.fed += p.prompt_tokens;
            if p.prompt_tokens == 0 {
                r.next = None;
                r.fed_decode += 1 + draft.len();
                r.acceptance.forget();
            }
            let tokens: Vec<SampledToken> = sampled.into_iter().flatten().collect();
            let emit = if draft.is_empty() {
                tokens.len()
            } else {
                // Verification: the drafted tokens that matched, and the sample after them.
                let ids: Vec<i32> = tokens.iter().map(|t| t.token).collect();
                let kept = accepted(draft, &ids);
                if let (Some(dm), Some(d)) = (self.draft.as_mut(), r.draft.as_mut())
                    && !dm.verified(d, kept)
                {
                    r.draft = None; // released next step; it catches up from scratch
                }
                self.metrics.draft_tokens.inc_by(draft.len() as u64);
                self.metrics.accepted_tokens.inc_by(kept as u64);
                r.acceptance.verified(draft.len(), kept);
                self.acceptance.model_verified(draft.len(), kept);
                let dropped = draft.len() - kept;
                if dropped > 0 {
                    let keep = r.positions() - dropped;
                    if let Err(e) = self.engine.seq_truncate(r.seq, keep as u64) {
                        let _ = r.job.events.send(GenEvent::Error(GenError::Engine(e)));
                        finished.push((p.index, FinishReason::Failed));
                        continue;
                    }
                    r.fed_decode -= dropped;
                }
                (kept + 1).min(tokens.len())
            };
            let out = Output {
                engine: &self.engine,
                metrics: &self.metrics,
                eog: &self.eog,
            };
            for tok in tokens.into_iter().take(emit) {
                if let Some(reason) = out.on_token(r, tok, now) {
                    finished.push((p.index, reason));
                    break;
                }
            }
        }
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            let r = self.running.swap_remove(i);
            self.finish(r, reason);
        }
        self.start_forks();
    }

    /// The draft of every decode entry of the plan (empty where it drafts nothing): from the
    /// draft model when the model has one, else by prompt lookup over the sequence's text;
    /// when the model verifies drafts, the request allows it, few enough sequences decode, and
    /// the draft fits the request's `max_tokens`, the context and the KV cells left.
    fn drafts(&mut self, plan: &[Planned]) -> Vec<Vec<i32>> {
        let spec = self.settings.speculation;
        let decoding = plan.iter().filter(|p| p.prompt_tokens == 0).count();
        let none = || vec![Vec::new(); plan.len()];
        if !self.drafts || decoding > spec.max_batch {
            return none();
        }
        let load = self.load();
        let mut free = self
            .capacity
            .kv_tokens
            .saturating_sub(load.kv_tokens + decoding as u64) as usize;
        // The most each entry may draft.
        let ks: Vec<usize> = plan
            .iter()
            .map(|p| {
                let r = &self.running[p.index];
                if p.prompt_tokens > 0 || r.context.is_empty() {
                    return 0;
                }
                let left =
                    (r.job.max_tokens.saturating_sub(r.generated) as usize).saturating_sub(1);
                let room = self.context_length.saturating_sub(r.positions() + 1);
                let k = spec.draft_tokens.min(left).min(room).min(free);
                free -= k;
                k
            })
            .collect();
        if self.draft.is_some() {
            return self.model_drafts(plan, &ks);
        }
        let mut drafts: Vec<Vec<i32>> = plan
            .iter()
            .zip(&ks)
            .map(|(p, &k)| {
                let r = &self.running[p.index];
                prompt_lookup(&r.context, spec.ngram_min, spec.ngram_max, k).to_vec()
            })
            .collect();
        if spec.adaptive {
            self.cut_drafts(plan, &mut drafts);
        }
        drafts
    }

    /// Cut each draft to the length that makes the most tokens per second of this step, from
    /// its sequence's acceptance rate and the measured step costs (`draft_len.rs`).
    ///
    /// A seeded request that samples keeps a fixed length ([`SEEDED_DRAFT_TOKENS`]): its
    /// sampler draws once per verified position, so its text depends on the lengths, which
    /// must then not depend on timing or on other requests.
    fn cut_drafts(&self, plan: &[Planned], drafts: &mut [Vec<i32>]) {
        let prior = self.acceptance.model_rate();
        // The tokens the step carries whatever is chosen: one for each decoding sequence and
        // the fixed drafts (a prompt chunk's cost is not in the table; its steps are not
        // measured).
        let mut base = plan.iter().filter(|p| p.prompt_tokens == 0).count();
        let mut drafting = Vec::new();
        for (i, p) in plan.iter().enumerate() {
            let job = &self.running[p.index].job;
            if job.fresh && !job.sampling.is_greedy() {
                drafts[i].truncate(SEEDED_DRAFT_TOKENS);
                base += drafts[i].len();
            } else if !drafts[i].is_empty() {
                drafting.push(i);
            }
        }
        if drafting.is_empty() {
            return;
        }
        let candidates: Vec<Candidate> = drafting
            .iter()
            .map(|&i| Candidate {
                rates: self.running[plan[i].index].acceptance.rates_now(prior),
                available: drafts[i].len(),
            })
            .collect();
        let ks = choose(base, &candidates, &self.step_costs);
        tracing::trace!(
            model = %self.metrics.model,
            ?candidates,
            ?ks,
            costs = ?self.step_costs.measured(),
            "draft lengths"
        );
        for (&i, k) in drafting.iter().zip(ks) {
            drafts[i].truncate(k);
        }
    }

    /// Release the draft model's sequences whose target sequence ended (however it ended).
    fn release_drafts(&mut self) {
        if let Some(dm) = self.draft.as_mut() {
            let held = self
                .running
                .iter()
                .filter_map(|r| r.draft.map(|d| d.seq))
                .collect();
            dm.release_unheld(&held);
        }
    }

    /// Drafts decoded by the draft model (`draft_model.rs`), at most `ks[i]` for entry `i`.
    fn model_drafts(&mut self, plan: &[Planned], ks: &[usize]) -> Vec<Vec<i32>> {
        let none = || vec![Vec::new(); plan.len()];
        let Some(dm) = self.draft.as_mut() else {
            return none();
        };
        // The sequences that draft, in `running` order, and where each sits in the plan.
        let mut at = vec![None; self.running.len()];
        for (j, (p, &k)) in plan.iter().zip(ks).enumerate() {
            if k > 0 {
                at[p.index] = Some((j, k));
            }
        }
        let mut slots = Vec::new();
        let mut list = Vec::new();
        for (r, at) in self.running.iter_mut().zip(&at) {
            if let Some((j, k)) = *at {
                slots.push(j);
                list.push(crate::draft_model::Want {
                    context: &r.context,
                    draft: &mut r.draft,
                    k,
                });
            }
        }
        if list.is_empty() {
            return none();
        }
        self.figures.step_began(self.epoch);
        let result = dm.draft(&mut list, self.settings.prefill_chunk_tokens);
        self.figures.step_ended();
        drop(list);
        let drafted = match result {
            Ok(d) => d,
            Err(e) => {
                if dm.crashed() {
                    tracing::warn!(model = %self.metrics.model, error = %e, "the draft model's worker died; no more drafts");
                    self.draft = None;
                } else {
                    tracing::warn!(model = %self.metrics.model, error = %e, "draft step failed; no drafts this step");
                }
                return none();
            }
        };
        let mut out = none();
        for (j, d) in slots.into_iter().zip(drafted) {
            out[j] = d;
        }
        out
    }

    /// The header's rule: on a failed step the host releases the affected sequences.
    fn fail_step(&mut self, plan: &[Planned], e: EngineError) {
        tracing::warn!(model = %self.metrics.model, error = %e, "engine step failed");
        let mut idx: Vec<usize> = plan.iter().map(|p| p.index).collect();
        idx.sort_unstable_by(|a, b| b.cmp(a));
        for i in idx {
            let r = self.running.swap_remove(i);
            self.engine.seq_release(r.seq);
            self.metrics.finished("error");
            r.job.send_all(GenEvent::Error(GenError::Engine(e.clone())));
        }
    }

    /// Compute the allowed-token masks of the constrained entries that sample in this step,
    /// in parallel across the batch (a mask depends on the token before it, so it cannot
    /// start before the previous step ended). A grammar that fails ends its request with an
    /// error; returns false when that happened (the caller plans the step again).
    fn compute_masks(&mut self, plan: &[Planned]) -> bool {
        use rayon::prelude::*;
        let mut sampling = vec![false; self.running.len()];
        for p in plan {
            sampling[p.index] = p.samples && self.running[p.index].job.grammar.is_some();
        }
        let todo: Vec<(usize, &mut Box<dyn crate::engine::Grammar>)> = self
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| sampling[*i])
            .filter_map(|(i, r)| r.job.grammar.as_mut().map(|g| (i, g)))
            .collect();
        if todo.is_empty() {
            return true;
        }
        let t = Instant::now();
        let results: Vec<(usize, Result<f64, String>)> = if todo.len() == 1 {
            todo.into_iter()
                .map(|(i, g)| (i, g.compute_mask()))
                .collect()
        } else {
            todo.into_par_iter()
                .map(|(i, g)| (i, g.compute_mask()))
                .collect()
        };
        self.metrics
            .constraint_batch
            .observe(t.elapsed().as_secs_f64());
        let mut failed: Vec<(usize, String)> = Vec::new();
        for (i, r) in results {
            match r {
                Ok(secs) => self.metrics.constraint_mask.observe(secs),
                Err(e) => failed.push((i, e)),
            }
        }
        if failed.is_empty() {
            return true;
        }
        failed.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, e) in failed {
            let r = self.running.swap_remove(i);
            tracing::warn!(model = %self.metrics.model, seq = r.seq, error = %e, "constrained decoding failed");
            let _ = r
                .job
                .events
                .send(GenEvent::Error(GenError::Engine(EngineError::internal(e))));
            self.finish(r, FinishReason::Failed);
        }
        false
    }

    /// Flush held text, report usage, release the sequence.
    pub(crate) fn finish(&mut self, mut r: Running, reason: FinishReason) {
        // The times of an aligned job, read before the sequence goes: from the prompt's last
        // token (which predicted the first generated one) on, one per generated token.
        // And the probability it asked for, from the same sequence. Only for a sequence that
        // ended as it should: an expired or failed one is not worth a decoder pass.
        let ok = matches!(reason, FinishReason::Stop | FinishReason::Length);
        let times = (r.job.align && ok).then(|| {
            let first = r.job.prompt.len().saturating_sub(1);
            self.engine
                .seq_token_times(r.seq, first)
                .map(GenEvent::Times)
        });
        let probe = r.job.probe.filter(|_| ok).map(|(n, token)| {
            self.engine
                .seq_token_prob(r.seq, n, token)
                .map(GenEvent::Probe)
        });
        self.engine.seq_release(r.seq);
        if let Some(lp) = r.stop_logprob {
            let _ = r.job.events.send(GenEvent::StopLogprob(lp));
        }
        for ev in [times, probe].into_iter().flatten() {
            match ev {
                Ok(ev) => {
                    let _ = r.job.events.send(ev);
                }
                Err(e) => {
                    tracing::warn!(model = %self.metrics.model, seq = r.seq, error = %e, "token times or probability failed");
                    let _ = r.job.events.send(GenEvent::Error(GenError::Engine(e)));
                    self.metrics.finished(FinishReason::Failed.label());
                    return;
                }
            }
        }
        if !r.job.forks.is_empty() {
            // It ended before its forks started (deadline, failure): so do they.
            let end = match reason {
                FinishReason::Failed => GenEvent::Error(GenError::Engine(EngineError::internal(
                    "another choice of this request failed before this one started",
                ))),
                reason => GenEvent::Done {
                    reason,
                    prompt_tokens: r.job.prompt.len() as u32,
                    cached_tokens: None,
                    completion_tokens: 0,
                    queued: r.queued,
                },
            };
            self.end_forks(&mut r.job, &end);
        }
        if reason == FinishReason::Failed {
            self.metrics.finished(reason.label());
            return; // the error event was sent
        }
        let tail = r.utf8.finish();
        let mut rest = match r.stops.push(&tail) {
            StopScan::Emit(t) | StopScan::Stopped(t) => t,
        };
        // Held text that never became a stop sequence belongs to the output.
        rest.push_str(&r.stops.finish());
        if !rest.is_empty() {
            let _ = r.job.events.send(GenEvent::Token {
                text: rest,
                logprob: None,
            });
        }
        self.metrics
            .e2e
            .observe(r.job.arrived.elapsed().as_secs_f64());
        self.metrics.finished(reason.label());
        let _ = r.job.events.send(GenEvent::Done {
            reason,
            prompt_tokens: r.job.prompt.len() as u32,
            cached_tokens: r.cached,
            completion_tokens: r.generated,
            queued: r.queued,
        });
    }
}

/// What turning a sampled token into output needs, apart from the sequence itself.
struct Output<'a, E> {
    engine: &'a E,
    metrics: &'a SchedulerMetrics,
    eog: &'a [i32],
}

impl<E: Engine> Output<'_, E> {
    /// Handle one sampled token; `Some` when the sequence is done.
    fn on_token(&self, r: &mut Running, tok: SampledToken, now: Instant) -> Option<FinishReason> {
        let metrics = self.metrics;
        match r.last_token_at {
            None => metrics.ttft.observe((now - r.job.arrived).as_secs_f64()),
            Some(prev) => metrics.inter_token.observe((now - prev).as_secs_f64()),
        }
        r.first_token_at.get_or_insert(now);
        r.last_token_at = Some(now);
        if self.eog.contains(&tok.token) {
            if r.job.audio.is_some() && r.job.logprobs.is_some() && tok.logprob.is_finite() {
                r.stop_logprob = Some(tok.logprob);
            }
            return Some(FinishReason::Stop);
        }
        let mut grammar_done = false;
        if let Some(g) = r.job.grammar.as_deref_mut() {
            if let Err(e) = g.consume(tok.token) {
                // The plugin sampled a token outside the mask it was given.
                let _ =
                    r.job
                        .events
                        .send(GenEvent::Error(GenError::Engine(EngineError::internal(
                            format!(
                                "the engine sampled token {} outside the allowed-token mask ({e})",
                                tok.token
                            ),
                        ))));
                return Some(FinishReason::Failed);
            }
            grammar_done = g.is_done();
        }
        metrics.generation_tokens.inc();
        let bytes = self.engine.token_bytes(tok.token);
        let logprob = r.job.logprobs.map(|_| TokenLogprob {
            token: tok.token,
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes: bytes.clone(),
            logprob: tok.logprob,
            top: tok
                .top
                .iter()
                .map(|&(t, lp)| {
                    let b = self.engine.token_bytes(t);
                    (t, String::from_utf8_lossy(&b).into_owned(), b, lp)
                })
                .collect(),
        });
        let text = r.utf8.push(&bytes);
        let (text, stopped) = match r.stops.push(&text) {
            StopScan::Emit(t) => (t, false),
            StopScan::Stopped(t) => (t, true),
        };
        r.generated += 1;
        let _ = r.job.events.send(GenEvent::Token { text, logprob });
        if stopped || grammar_done {
            return Some(FinishReason::Stop);
        }
        if r.generated >= r.job.max_tokens {
            return Some(FinishReason::Length);
        }
        r.next = Some(tok.token);
        if !r.context.is_empty() {
            r.context.push(tok.token);
        }
        None
    }
}
