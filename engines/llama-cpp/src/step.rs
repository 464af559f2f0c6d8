//! llama.cpp engine, the step (below the engine host's `step`): every entry's new tokens in
//! one `llama_batch` per adapter, one `llama_decode` each, then each sampled row.
//!
//! The batch: a new sequence is first bound to a slot (`slots.rs`), which may skip the prefix
//! its warm cells hold; a step that finds the cache full drops the warm cells once and tries
//! again. Sampling: each row's sampler (`sampler.rs`) reads its own logits and its own
//! sequence's chain, so the sequences of a step are sampled in parallel on up to the engine's
//! thread count (a step's llama.cpp threads are idle by then), inline when one samples.
//!
//! Adapters (ABI 1.6): llama.cpp applies a LoRA adapter to the whole context, so the entries
//! are grouped by the adapter their sequence runs, and each group is decoded on its own under
//! its adapter (the base first, then by adapter id) and sampled before the next group's decode
//! overwrites the logits. A step whose entries all run one adapter decodes once, as before;
//! a mixed step pays one decode and, for each adapter switch, llama.cpp's graph reservation.
//!
//! Verification (ABI 1.5 `GANTRY_STEP_SAMPLE_ALL`, speculative decoding): an entry of drafted
//! tokens asks for the logits of every one of its tokens and is sampled after each, in order,
//! through its sequence's one chain (one job per sequence, so sequences still sample in
//! parallel); its samples fill `tokens.len()` consecutive result slots. The host then drops
//! the rejected drafts with `seq_truncate` (`slots.rs`).

use std::collections::BTreeMap;
use std::ops::Range;

use gantry_engine_abi::{EngineError, SampledToken, Sampling, StepEntry};
use llama_cpp_2::token::LlamaToken;

use crate::sampler::SeqSampler;
use crate::slots::Exec;
use crate::{LlamaLoaded, oom};

/// One sequence's rows to sample, in order: where its first answer goes, its sequence and
/// what it samples from (each row with the position of the token whose logits it is).
struct Job<'a> {
    out: usize,
    seq: u64,
    rows: Vec<(usize, &'a [f32])>,
    params: &'a Sampling,
    allowed: Option<&'a [u32]>,
    sampler: SeqSampler,
}

/// Sample every job's rows, the jobs on up to `threads` threads and each job's rows in order
/// through its own chain; one result list per job, in the jobs' order.
fn sample_jobs(
    jobs: &mut [Job<'_>],
    threads: usize,
) -> Vec<Vec<Result<SampledToken, EngineError>>> {
    let run = |j: &mut Job<'_>| {
        j.rows
            .iter()
            .map(|&(after, logits)| j.sampler.sample(logits, after, j.params, j.allowed))
            .collect::<Vec<_>>()
    };
    let threads = threads.clamp(1, jobs.len().max(1));
    if threads == 1 {
        return jobs.iter_mut().map(run).collect();
    }
    let per = jobs.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .chunks_mut(per)
            .map(|chunk| {
                let n = chunk.len();
                (
                    n,
                    s.spawn(move || chunk.iter_mut().map(run).collect::<Vec<_>>()),
                )
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|(n, h)| {
                h.join().unwrap_or_else(|_| {
                    (0..n)
                        .map(|_| vec![Err(EngineError::internal("a sampling thread panicked"))])
                        .collect()
                })
            })
            .collect()
    })
}

/// Refuse a verification entry (`sample_all`) the plugin cannot sample exactly: before any
/// KV changes, so a refused step leaves every sequence as it was.
fn check_sample_all(e: &StepEntry<'_>, bound: bool, truncatable: bool) -> Result<(), EngineError> {
    let Some(params) = e.sample.filter(|_| e.sample_all) else {
        return Ok(());
    };
    let refuse = |why: &str| {
        Err(EngineError::unsupported(format!(
            "sequence {}: sampling after every token (GANTRY_STEP_SAMPLE_ALL) {why}",
            e.seq
        )))
    };
    if params.has_penalties() {
        // Each row's penalties would have to see the samples of the rows before it as the
        // tokens fed, which a verification does not feed.
        return refuse("is not done with repetition, frequency or presence penalties");
    }
    if e.allowed.is_some() {
        return refuse("is not done with an allowed-token mask");
    }
    if !truncatable {
        // Its rejected drafts could not be dropped afterwards (`seq_truncate`).
        return refuse("is not done on a recurrent or hybrid model");
    }
    if !bound {
        // A first entry may skip a reused prefix (`slots.rs`), whose rows it has no logits of.
        return refuse("needs a sequence already stepped; it verifies drafts, not a prompt");
    }
    Ok(())
}

/// The entries of one step that run one adapter: decoded together, sampled before the next
/// group's decode overwrites the context's logits.
struct Group<'a> {
    /// 0 = the base model.
    adapter: u64,
    /// Indices into the step's entries, ascending.
    members: &'a [usize],
    /// By entry: leading tokens already in KV, and where its results go.
    skip: &'a [usize],
    first_slot: &'a [usize],
}

/// Decode `group`'s new tokens under its adapter, in one `llama_decode` (retried once after
/// dropping the warm cells when the cache is full). Returns, aligned with `group.members`, the
/// batch rows whose logits each sampling entry reads: its last token's, or every token's for a
/// verification entry.
fn decode_group(
    ex: &mut Exec,
    entries: &[StepEntry<'_>],
    group: &Group<'_>,
) -> Result<Vec<Option<Range<i32>>>, EngineError> {
    // Verification entries go last in the batch, so that they are in its last ubatch: a
    // later ubatch's cell search could take the window cells of their drafts' positions
    // from a sliding-window cache (see `Exec::truncate`, whose check also covers the decodes
    // of the groups after this one).
    let order: Vec<usize> = (0..group.members.len())
        .filter(|&m| !entries[group.members[m]].verifies())
        .chain((0..group.members.len()).filter(|&m| entries[group.members[m]].verifies()))
        .collect();
    let mut evicted = false;
    loop {
        let mut logits_at: Vec<Option<Range<i32>>> = vec![None; group.members.len()];
        ex.batch.clear();
        for &m in &order {
            let n = group.members[m];
            let (e, k) = (&entries[n], group.skip[n]);
            let s = &ex.seqs[&e.seq];
            let slot = s.slot.unwrap_or_default();
            let last = e.tokens.len().saturating_sub(1);
            let all = e.verifies();
            for (i, &t) in e.tokens.iter().enumerate().skip(k) {
                let want = e.sample.is_some() && (all || i == last);
                ex.batch
                    .add(LlamaToken(t), s.n_past + (i - k) as i32, &[slot], want)
                    .map_err(|err| EngineError::internal(format!("batch: {err}")))?;
            }
            let end = ex.batch.n_tokens();
            let rows = if all { e.tokens.len() - k } else { 1 };
            logits_at[m] = e.sample.map(|_| end - rows as i32..end);
        }
        if ex.batch.n_tokens() == 0 {
            return Ok(logits_at);
        }
        // Switching adapters costs llama.cpp a graph reservation: only when a decode needs it.
        ex.use_adapter(group.adapter)?;
        match ex.decode() {
            Ok(()) => return Ok(logits_at),
            // Full: drop the warm cells of released sequences and try once more.
            Err(llama_cpp_2::DecodeError::NoKvCacheSlot) if !evicted && ex.evict_warm() => {
                evicted = true;
            }
            Err(llama_cpp_2::DecodeError::NoKvCacheSlot) => {
                return Err(oom("KV cache is full".to_string()));
            }
            Err(other) => {
                return Err(EngineError::internal(format!(
                    "llama_decode failed: {other}"
                )));
            }
        }
    }
}

impl LlamaLoaded {
    /// One engine step (see the module header).
    pub(crate) fn run_step(
        &self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let mut guard = self.exec();
        let ex = &mut *guard;
        let total: usize = entries.iter().map(|e| e.tokens.len()).sum();
        let slots: usize = entries.iter().map(StepEntry::result_slots).sum();
        if total == 0 {
            return Ok(vec![None; slots]);
        }
        if total > self.n_batch {
            return Err(EngineError::internal(format!(
                "step carries {total} tokens, the batch holds {}",
                self.n_batch
            )));
        }
        // Refusals first, before any sequence binds or any KV changes.
        let truncatable = !(self.model.is_recurrent() || self.model.is_hybrid());
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
            check_sample_all(e, s.slot.is_some(), truncatable)?;
        }
        // How many leading tokens of each entry are already in KV (prefix reuse).
        let mut skip = vec![0usize; entries.len()];
        for (i, e) in entries.iter().enumerate() {
            if ex.seqs.get(&e.seq).is_some_and(|s| s.slot.is_none()) {
                skip[i] = ex.bind(e.seq, e.tokens, e.sample.is_some(), e.fresh)?;
            }
        }
        // Where each entry's results go, in the entries' order.
        let first_slot: Vec<usize> = entries
            .iter()
            .scan(0, |next, e| {
                let at = *next;
                *next += e.result_slots();
                Some(at)
            })
            .collect();
        // Each sampling entry's sampler: in the backend where its chain fits there.
        ex.choose_samplers(entries, self.n_vocab, self.info.context_length);
        // One decode per adapter, the base first, then by adapter id: a fixed order, since
        // where a group's cells land in the cache depends on the groups decoded before it.
        let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (i, e) in entries.iter().enumerate() {
            let adapter = ex.seqs.get(&e.seq).map_or(0, |s| s.adapter);
            groups.entry(adapter).or_default().push(i);
        }
        let mut out: Vec<Option<SampledToken>> = vec![None; slots];
        let mut failed = None;
        for (adapter, members) in &groups {
            let group = Group {
                adapter: *adapter,
                members,
                skip: &skip,
                first_slot: &first_slot,
            };
            let logits_at = decode_group(ex, entries, &group)?;
            if let Err(e) = self.sample_group(ex, entries, &group, &logits_at, &mut out) {
                failed = failed.or(Some(e));
            }
        }
        failed.map_or(Ok(out), Err)
    }

    /// The bookkeeping of a decoded group's entries, then its sampled rows: the sequences whose
    /// sampler runs on the host are sampled in parallel (each reads its own logits and its own
    /// sequence's chain). The first sampling error, after every row was tried.
    fn sample_group(
        &self,
        ex: &mut Exec,
        entries: &[StepEntry<'_>],
        group: &Group<'_>,
        logits_at: &[Option<Range<i32>>],
        out: &mut [Option<SampledToken>],
    ) -> Result<(), EngineError> {
        let mut jobs: Vec<Job<'_>> = Vec::new();
        let mut failed = None;
        for (&n, at) in group.members.iter().zip(logits_at) {
            let (e, k) = (&entries[n], group.skip[n]);
            let seq = ex
                .seqs
                .get_mut(&e.seq)
                .ok_or_else(|| EngineError::internal("sequence vanished"))?;
            // The position of the entry's first row: its rows are its last tokens.
            let n_past = seq.n_past as usize + (e.tokens.len() - k);
            seq.n_past = n_past as i32;
            seq.history.extend_from_slice(&e.tokens[k..]);
            let (Some(params), Some(at)) = (e.sample, at.clone()) else {
                continue;
            };
            if let Some(chain) = &mut seq.backend {
                // Sampled in the decode: the token alone came back (`backend_sampling.rs`).
                out[group.first_slot[n]] = match chain.take(&ex.ctx, at.start) {
                    Ok(token) => Some(SampledToken {
                        token,
                        logprob: f32::NAN,
                        top: Vec::new(),
                    }),
                    Err(e) => {
                        failed = failed.or(Some(e));
                        None
                    }
                };
                continue;
            }
            let first_pos = n_past - at.len();
            let sampler = seq
                .sampler
                .take()
                .unwrap_or_else(|| SeqSampler::new(params, self.n_vocab, self.info.context_length));
            jobs.push(Job {
                out: group.first_slot[n],
                seq: e.seq,
                rows: at
                    .enumerate()
                    .map(|(r, idx)| (first_pos + r, ex.ctx.get_logits_ith(idx)))
                    .collect(),
                params,
                allowed: e.allowed,
                sampler,
            });
        }
        let results = sample_jobs(&mut jobs, self.sample_threads);
        for (j, rs) in jobs.into_iter().zip(results) {
            if let Some(seq) = ex.seqs.get_mut(&j.seq) {
                seq.sampler = Some(j.sampler);
            }
            for (slot, r) in out[j.out..].iter_mut().zip(rs) {
                match r {
                    Ok(t) => *slot = Some(t),
                    Err(e) => failed = failed.or(Some(e)),
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// A pooled embedding of `tokens` (embedding models), in a free slot for one pass.
    pub(crate) fn run_embed(&self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        let mut v = self.run_embed_batch(&[tokens])?;
        Ok(v.remove(0))
    }

    /// Pooled embeddings of several inputs (ABI 1.8 `embed_batch`): each input in a free
    /// sequence slot of its own, as many per `llama_decode` as there are free slots and room
    /// in the batch (`n_batch` tokens), so one pass serves many inputs.
    pub(crate) fn run_embed_batch(&self, inputs: &[&[i32]]) -> Result<Vec<Vec<f32>>, EngineError> {
        if !self.embedding {
            return Err(EngineError::unsupported(format!(
                "{} is not an embedding model",
                self.info.architecture
            )));
        }
        for (i, tokens) in inputs.iter().enumerate() {
            let fault = if tokens.is_empty() {
                "cannot embed an empty input".to_string()
            } else if tokens.len() > self.n_batch {
                format!(
                    "input has {} tokens, the most an embedding takes is {}",
                    tokens.len(),
                    self.n_batch
                )
            } else {
                continue;
            };
            return Err(EngineError::unsupported(fault).for_input(i, inputs.len()));
        }
        let mut guard = self.exec();
        let ex = &mut *guard;
        if ex.free_slots.is_empty() {
            return Err(oom("no free sequence slot for embedding".into()));
        }
        // Embeddings take free slots' cells for one pass: their warm prefixes go.
        let slots: Vec<i32> = ex
            .free_slots
            .iter_mut()
            .map(|f| {
                f.tokens.clear();
                f.id
            })
            .collect();
        // Embeddings are the base model's.
        ex.use_adapter(0)?;
        let mut out = Vec::with_capacity(inputs.len());
        let mut next = 0;
        while next < inputs.len() {
            ex.batch.clear();
            let (mut used, mut taken) = (0, 0);
            while next < inputs.len()
                && used < slots.len()
                && taken + inputs[next].len() <= self.n_batch
            {
                let slot = slots[used];
                let _ = ex.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
                for (p, &t) in inputs[next].iter().enumerate() {
                    ex.batch
                        .add(LlamaToken(t), p as i32, &[slot], true)
                        .map_err(|err| EngineError::internal(format!("batch: {err}")))?;
                }
                taken += inputs[next].len();
                used += 1;
                next += 1;
            }
            let pass = ex
                .decode()
                .map_err(|err| EngineError::internal(format!("llama_decode failed: {err}")))
                .and_then(|()| {
                    slots[..used]
                        .iter()
                        .map(|&slot| {
                            ex.ctx
                                .embeddings_seq_ith(slot)
                                .map(unit_length)
                                .map_err(|err| {
                                    EngineError::internal(format!("no pooled embedding: {err}"))
                                })
                        })
                        .collect::<Result<Vec<_>, _>>()
                });
            for &slot in &slots[..used] {
                let _ = ex.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
            }
            out.extend(pass?);
        }
        Ok(out)
    }
}

/// The pooled vector scaled to unit length, as OpenAI's `/v1/embeddings` and llama-server
/// (`--embd-normalize 2`, its default) return it and as sentence-transformers models declare
/// (`Normalize`); a zero vector stays zero.
fn unit_length(v: &[f32]) -> Vec<f32> {
    let norm = v
        .iter()
        .map(|x| f64::from(*x) * f64::from(*x))
        .sum::<f64>()
        .sqrt();
    if norm == 0.0 {
        return v.to_vec();
    }
    v.iter().map(|x| (f64::from(*x) / norm) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooled_vectors_come_back_at_unit_length() {
        let v = unit_length(&[3.0, -4.0]);
        assert_eq!(v, [0.6, -0.8]);
        assert_eq!(unit_length(&[0.0, 0.0]), [0.0, 0.0]);
    }

    #[test]
    fn rows_sampled_in_parallel_get_what_one_thread_gives_them_in_order() {
        let logits: Vec<f32> = (0..3000)
            .map(|i| ((i * 7919) % 3000) as f32 / 300.0)
            .collect();
        let params: Vec<Sampling> = (0..7)
            .map(|i| Sampling {
                temperature: 1.0,
                top_k: if i % 2 == 0 { 50 } else { 0 },
                seed: 100 + i,
                ..Sampling::greedy()
            })
            .chain([Sampling::greedy()])
            .collect();
        let jobs = || -> Vec<Job<'_>> {
            params
                .iter()
                .enumerate()
                .map(|(i, p)| Job {
                    out: i,
                    seq: i as u64,
                    rows: vec![(0, &logits[..])],
                    params: p,
                    allowed: None,
                    sampler: SeqSampler::new(p, 3000, 64),
                })
                .collect()
        };
        let tokens = |threads| -> Vec<i32> {
            let mut j = jobs();
            let mut all = Vec::new();
            // Three steps, so each sequence's chain carries its own state across them.
            for _ in 0..3 {
                all.extend(
                    sample_jobs(&mut j, threads)
                        .into_iter()
                        .flatten()
                        .map(|r| r.expect("sampled").token),
                );
            }
            all
        };
        let one = tokens(1);
        assert_eq!(one.len(), 24);
        assert_eq!(one, tokens(3));
        assert_eq!(one, tokens(8));
        // The greedy row is the argmax.
        assert_eq!(one[7], crate::sampler::argmax(&logits));
    }
}
