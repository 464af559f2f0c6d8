//! llama.cpp engine, sampling step: turns one sequence's logits into its next token (+ logprobs).
//!
//! Greedy requests without penalties or biases take a plain argmax over the
//! logits, which skips building llama.cpp's 'candidates' array of the whole
//! vocabulary on every token. Everything else runs a per-sequence llama.cpp
//! sampler chain built on the sequence's first sample and kept until release,
//! so penalties see the sequence's own history and the seeded RNG its own stream.
//! A chain whose first cut is top-k (no bias, no penalties before it) gets only the k
//! best tokens as candidates, found by partial selection, instead of the whole vocabulary:
//! the chain's top-k would keep the same ones. A row samples from its logits alone (no
//! context), so the step samples its rows in parallel (`step.rs`); a verification entry
//! (`GANTRY_STEP_SAMPLE_ALL`) samples its rows in order through the same chain.
//!
//! The chain is kept in two parts, the biases and penalties (`head`) and the cuts and draw
//! (`tail`), so that `seq_truncate` can make the penalties forget the samples taken after
//! the dropped tokens ([`SeqSampler::forget_after`]) without restarting the seeded draw.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use gantry_engine_abi::{EngineError, SampledToken, Sampling};
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;

pub(crate) enum SeqSampler {
    Argmax,
    Chain(Chain),
}

/// A sampler chain in two llama.cpp chains applied one after the other, which is what one
/// chain of all their samplers does (`llama_sampler_chain_apply` / `_accept` run each
/// sampler in turn); each part stays a chain so that a disabled sampler (llama.cpp's empty
/// "?penalties", which has no `apply`) is skipped as a chain skips it.
pub(crate) struct Chain {
    /// Logit biases, then the penalties: the only part with history (the penalties').
    head: LlamaSampler,
    /// top-k, top-p, min-p, temperature and the seeded draw (or greedy).
    tail: LlamaSampler,
    /// With penalties: every sample the head accepted, with the position of the token it
    /// followed, so that the head can be rebuilt without the samples `seq_truncate` drops.
    seen: Option<Vec<(usize, i32)>>,
    /// The penalties' window (`penalty_last_n`): the head's history holds no more.
    last_n: usize,
}

// SAFETY: a llama_sampler is plain heap state with no thread affinity; it is
// only touched while the model's exec mutex is held.
unsafe impl Send for SeqSampler {}

impl SeqSampler {
    /// The sampler of one sequence; `n_ctx` is its context, the penalties' window when
    /// `penalty_last_n` is -1 (the header's "whole context": llama.cpp's own sampler takes a
    /// negative window as 0, penalties off, so the caller must say how long "whole" is).
    pub(crate) fn new(p: &Sampling, n_vocab: i32, n_ctx: u32) -> Self {
        if p.is_greedy() && !p.has_penalties() && p.logit_bias.is_empty() {
            return SeqSampler::Argmax;
        }
        let last_n = match p.penalty_last_n {
            n if n < 0 => i32::try_from(n_ctx).unwrap_or(i32::MAX),
            n => n,
        };
        let mut head = Vec::new();
        if !p.logit_bias.is_empty() {
            let biases: Vec<LlamaLogitBias> = p
                .logit_bias
                .iter()
                .map(|&(t, b)| LlamaLogitBias::new(LlamaToken(t), b))
                .collect();
            head.push(LlamaSampler::logit_bias(n_vocab, &biases));
        }
        if p.has_penalties() {
            head.push(LlamaSampler::penalties(
                n_vocab,
                last_n,
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            ));
        }
        let mut tail = Vec::new();
        if p.is_greedy() {
            tail.push(LlamaSampler::greedy());
        } else {
            if p.top_k > 0 {
                tail.push(LlamaSampler::top_k(p.top_k));
            }
            if p.top_p < 1.0 {
                tail.push(LlamaSampler::top_p(p.top_p, 1));
            }
            if p.min_p > 0.0 {
                tail.push(LlamaSampler::min_p(p.min_p, 1));
            }
            tail.push(LlamaSampler::temp(p.temperature));
            tail.push(LlamaSampler::dist(seed32(p.seed)));
        }
        SeqSampler::Chain(Chain {
            head: LlamaSampler::chain_simple(head),
            tail: LlamaSampler::chain_simple(tail),
            seen: p.has_penalties().then(Vec::new),
            last_n: usize::try_from(last_n).unwrap_or(0),
        })
    }

    /// Sample the next token from one row of logits, the row of the token at position `after`
    /// of the sequence. With an allowed-token mask (ABI 1.2), disallowed tokens leave the
    /// distribution before the chain runs: biases, penalties, top-k/p, temperature and the
    /// reported logprobs all see only the allowed tokens.
    pub(crate) fn sample(
        &mut self,
        raw: &[f32],
        after: usize,
        p: &Sampling,
        allowed: Option<&[u32]>,
    ) -> Result<SampledToken, EngineError> {
        let masked;
        let logits = match allowed {
            None => raw,
            Some(mask) => {
                masked = apply_mask(raw, mask)?;
                &masked[..]
            }
        };
        let token = match self {
            SeqSampler::Argmax => argmax(logits),
            SeqSampler::Chain(c) => {
                // Only finite logits become candidates (a masked token's probability is 0, so
                // leaving it out changes nothing but the work), and only the k best when the
                // chain starts by cutting to them.
                let mut cands = candidates(logits, top_k_first(p));
                c.head.apply(&mut cands);
                c.tail.apply(&mut cands);
                let t = cands.selected_token().ok_or_else(|| {
                    EngineError::internal("the sampler chain selected no allowed token")
                })?;
                // Into the chain's history (penalties), as llama_sampler_sample does.
                c.head.accept(t);
                c.tail.accept(t);
                if let Some(seen) = &mut c.seen {
                    seen.push((after, t.0));
                }
                t.0
            }
        };
        let (logprob, top) = if p.want_logprob || p.top_logprobs > 0 {
            logprobs(logits, token, p.top_logprobs as usize)
        } else {
            (f32::NAN, Vec::new())
        };
        Ok(SampledToken {
            token,
            logprob,
            top,
        })
    }

    /// Advance the seeded draw past `n` samples taken elsewhere (a backend chain's, before the
    /// sequence moved to the host: `backend_sampling.rs`), so the sequence draws on where it
    /// was. llama.cpp's draw takes one number from its generator per sample, also of a single
    /// candidate, which is what it is given here.
    pub(crate) fn skip_draws(&mut self, n: usize) {
        let SeqSampler::Chain(c) = self else { return };
        for _ in 0..n {
            let one = LlamaTokenData::new(LlamaToken(0), 0.0, 0.0);
            c.tail
                .apply(&mut LlamaTokenDataArray::new(vec![one], false));
        }
    }

    /// Forget the samples taken after the tokens at positions `n_keep` and later (ABI 1.5
    /// `seq_truncate`): the penalties' history is rebuilt from the samples kept. The seeded
    /// draw goes on where it was (the header: each sample draws from the generator).
    pub(crate) fn forget_after(&mut self, n_keep: usize) {
        let SeqSampler::Chain(c) = self else { return };
        let Some(seen) = &mut c.seen else { return };
        if seen.last().is_none_or(|&(pos, _)| pos < n_keep) {
            return;
        }
        seen.retain(|&(pos, _)| pos < n_keep);
        // Only the biases and penalties reset (the biases have no state), then the window's
        // samples go back in, in order.
        c.head.reset();
        let from = seen.len().saturating_sub(c.last_n);
        for &(_, t) in &seen[from..] {
            c.head.accept(LlamaToken(t));
        }
    }
}

/// The seed of llama.cpp's RNG, which takes 32 bits: the 64-bit seed folded.
pub(crate) fn seed32(seed: u64) -> u32 {
    (seed ^ (seed >> 32)) as u32
}

/// The k of a chain whose first step is top-k: no bias and no penalties run before it.
fn top_k_first(p: &Sampling) -> Option<usize> {
    (!p.is_greedy() && p.top_k > 0 && p.logit_bias.is_empty() && !p.has_penalties())
        .then_some(p.top_k as usize)
}

/// The chain's candidates: the finite logits; with `k`, only the k largest (ties at the cut
/// are broken by position), found by partial selection rather than a sort of the vocabulary,
/// in vocabulary order. The chain then draws what it draws from the whole vocabulary, except
/// that among tokens of exactly equal logits it may name another one.
fn candidates(logits: &[f32], k: Option<usize>) -> LlamaTokenDataArray {
    let finite = || {
        logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(t, &l)| (t as i32, l))
    };
    let data = |(t, l): (i32, f32)| LlamaTokenData::new(LlamaToken(t), l, 0.0);
    match k.filter(|&k| k > 0 && k < logits.len()) {
        None => LlamaTokenDataArray::from_iter(finite().map(data), false),
        Some(k) => {
            // One pass keeping the k best in a min-heap: most tokens cost one comparison with
            // the heap's smallest. The heap orders by logit, then the lower id as the larger.
            let key = |(t, l): (i32, f32)| Reverse((TotalF32(l), Reverse(t)));
            let mut heap: BinaryHeap<Reverse<(TotalF32, Reverse<i32>)>> =
                BinaryHeap::with_capacity(k + 1);
            for c in finite() {
                if heap.len() < k {
                    heap.push(key(c));
                } else if heap.peek().is_some_and(|m| key(c) < *m) {
                    heap.pop();
                    heap.push(key(c));
                }
            }
            let mut best: Vec<(i32, f32)> = heap
                .into_iter()
                .map(|Reverse((TotalF32(l), Reverse(t)))| (t, l))
                .collect();
            // In vocabulary order, as the whole array would reach the chain.
            best.sort_unstable_by_key(|c| c.0);
            LlamaTokenDataArray::from_iter(best.into_iter().map(data), false)
        }
    }
}

/// An f32 ordered by `total_cmp`.
#[derive(Clone, Copy, PartialEq)]
struct TotalF32(f32);

impl Eq for TotalF32 {}

impl PartialOrd for TotalF32 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TotalF32 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// The logits with every token outside `mask` set to -inf; an error when no token is allowed.
fn apply_mask(raw: &[f32], mask: &[u32]) -> Result<Vec<f32>, EngineError> {
    let mut out = vec![f32::NEG_INFINITY; raw.len()];
    let mut any = false;
    for (w, &word) in mask.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let t = w * 32 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if let Some(&l) = raw.get(t) {
                out[t] = l;
                any = true;
            }
        }
    }
    if any {
        Ok(out)
    } else {
        Err(EngineError::internal(
            "the allowed-token mask allows no token of the vocabulary",
        ))
    }
}

/// Index of the largest logit; the lowest index wins a tie, as in llama.cpp's greedy sampler.
pub(crate) fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as i32
}

/// Log-softmax of `token` and the `n` most likely tokens under the raw model distribution.
pub(crate) fn logprobs(logits: &[f32], token: i32, n: usize) -> (f32, Vec<(i32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let lp = |t: usize| logits[t] - lse;
    let chosen = usize::try_from(token)
        .ok()
        .filter(|&t| t < logits.len())
        .map_or(f32::NEG_INFINITY, lp);
    let mut top: Vec<(i32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        // Keep the n best in a small sorted buffer: O(vocab * n) with n <= 20.
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < n || l > top[top.len() - 1].1 {
                let pos = top.partition_point(|&(_, v)| v >= l);
                top.insert(pos, (i as i32, l));
                top.truncate(n);
            }
        }
        for e in &mut top {
            e.1 -= lse;
        }
    }
    (chosen, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_candidates_are_the_k_best_and_draw_what_the_whole_vocabulary_draws() {
        // Distinct logits (a permutation of 0..5000 scaled): with ties the chain may order equal
        // tokens differently, which changes which of them a draw names, not the distribution.
        let logits: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 5000) as f32 / 500.0)
            .collect();
        let k = 40;
        let best = candidates(&logits, Some(k)).data;
        assert_eq!(best.len(), k);
        let floor = best.iter().map(|c| c.logit()).fold(f32::INFINITY, f32::min);
        assert_eq!(logits.iter().filter(|&&l| l >= floor).count(), k);
        assert!(best.iter().all(|c| logits[c.id().0 as usize] == c.logit()));
        // The same seeded chain over the k best and over every token draws the same tokens.
        let p = Sampling {
            temperature: 0.8,
            top_k: k as i32,
            top_p: 0.9,
            seed: 11,
            ..Sampling::greedy()
        };
        assert_eq!(top_k_first(&p), Some(k));
        let (mut cut, mut whole) = (SeqSampler::new(&p, 5000, 64), SeqSampler::new(&p, 5000, 64));
        let draw = |s: &mut SeqSampler, k: Option<usize>| {
            let SeqSampler::Chain(chain) = s else {
                panic!("a sampled request runs a chain")
            };
            let mut c = candidates(&logits, k);
            chain.head.apply(&mut c);
            chain.tail.apply(&mut c);
            let t = c.selected_token().expect("a token");
            chain.head.accept(t);
            chain.tail.accept(t);
            t.0
        };
        for _ in 0..50 {
            assert_eq!(draw(&mut cut, Some(k)), draw(&mut whole, None));
        }
        // Bias or penalties run before top-k: no cut then.
        let biased = Sampling {
            logit_bias: vec![(3, 5.0)],
            ..p
        };
        assert_eq!(top_k_first(&biased), None);
    }

    #[test]
    fn a_truncation_makes_the_penalties_forget_the_samples_it_drops() {
        // Positive logits, token 0 best: a repetition penalty of 2 halves a repeated token's, so
        // with a window of two samples greedy cycles through tokens 0, 1, 2.
        let logits = [10.0f32, 9.0, 8.0, 1.0];
        let p = Sampling {
            repetition_penalty: 2.0,
            penalty_last_n: 2,
            ..Sampling::greedy()
        };
        let mut s = SeqSampler::new(&p, 4, 64);
        let sample =
            |s: &mut SeqSampler, after| s.sample(&logits, after, &p, None).expect("sampled").token;
        let first: Vec<i32> = (10..16).map(|pos| sample(&mut s, pos)).collect();
        assert_eq!(first, [0, 1, 2, 0, 1, 2]);
        // Keep the tokens before position 13: the samples after 10, 11 and 12 stay (their window,
        // 1 and 2, penalised), so the sample after 13 is again what it was the first time.
        s.forget_after(13);
        assert_eq!(sample(&mut s, 13), first[3]);
        s.forget_after(11);
        assert_eq!(sample(&mut s, 11), first[1]);
        // Keeping everything forgets nothing.
        s.forget_after(12);
        assert_eq!(sample(&mut s, 12), first[2]);
    }

    #[test]
    fn a_window_of_minus_one_penalises_the_whole_context() {
        // -1 is "the whole context" (gantry_engine.h), not "off": every sample so far stays
        // penalised, so greedy takes each token once, best first, then the least penalised.
        let logits = [10.0f32, 9.0, 8.0, 1.0];
        let p = Sampling {
            repetition_penalty: 2.0,
            penalty_last_n: -1,
            ..Sampling::greedy()
        };
        let mut s = SeqSampler::new(&p, 4, 64);
        let got: Vec<i32> = (0..4)
            .map(|pos| s.sample(&logits, pos, &p, None).expect("sampled").token)
            .collect();
        // 10, 9, 8 halve to 5, 4.5, 4 once sampled; token 3's 1.0 is never best.
        assert_eq!(got, [0, 1, 2, 0]);
    }

    #[test]
    fn a_mask_keeps_only_the_allowed_logits() {
        let raw = [1.0f32, 5.0, 2.0, 4.0, 3.0];
        // Tokens 0, 2 and 4 allowed: the best allowed one wins, the others are -inf.
        let m = apply_mask(&raw, &[0b10101]).expect("some allowed");
        assert_eq!(argmax(&m), 4);
        assert_eq!(m[1], f32::NEG_INFINITY);
        assert_eq!(m[3], f32::NEG_INFINITY);
        // The logprobs of a masked distribution sum to 1 over the allowed tokens.
        let p: f32 = [0, 2, 4].iter().map(|&t| logprobs(&m, t, 0).0.exp()).sum();
        assert!((p - 1.0).abs() < 1e-5);
        // Bits past the vocabulary count for nothing; no allowed token is an error.
        assert!(apply_mask(&raw, &[0, 1]).is_err());
        assert!(apply_mask(&raw, &[]).is_err());
    }

    #[test]
    fn argmax_prefers_the_lowest_index_on_ties() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn logprobs_are_a_normalised_log_softmax_with_sorted_alternatives() {
        let logits = [1.0f32, 2.0, 3.0, 0.5];
        let (lp, top) = logprobs(&logits, 2, 2);
        let total: f32 = logits.iter().map(|l| (l - 3.0).exp()).sum();
        assert!((lp - (-(total.ln()))).abs() < 1e-5);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!(top[0].1 > top[1].1);
        let p: f32 = logits
            .iter()
            .enumerate()
            .map(|(i, _)| logprobs(&logits, i as i32, 0).0.exp())
            .sum();
        assert!((p - 1.0).abs() < 1e-5);
    }
}
