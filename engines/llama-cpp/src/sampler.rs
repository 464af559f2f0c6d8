//! llama.cpp engine, sampling step: turns one sequence's logits into its next token (+ logprobs).
//!
//! Greedy requests without penalties or biases take a plain argmax over the
//! logits, which skips building llama.cpp's 'candidates' array of the whole
//! vocabulary on every token. Everything else runs a per-sequence llama.cpp
//! sampler chain built on the sequence's first sample and kept until release,
//! so penalties see the sequence's own history and the seeded RNG its own stream.

use gantry_engine_abi::{EngineError, SampledToken, Sampling};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;

pub(crate) enum SeqSampler {
    Argmax,
    Chain(LlamaSampler),
}

// SAFETY: a llama_sampler is plain heap state with no thread affinity; it is
// only touched while the model's exec mutex is held.
unsafe impl Send for SeqSampler {}

impl SeqSampler {
    pub(crate) fn new(p: &Sampling, n_vocab: i32) -> Self {
        if p.is_greedy() && !p.has_penalties() && p.logit_bias.is_empty() {
            return SeqSampler::Argmax;
        }
        let mut chain = Vec::new();
        if !p.logit_bias.is_empty() {
            let biases: Vec<LlamaLogitBias> = p
                .logit_bias
                .iter()
                .map(|&(t, b)| LlamaLogitBias::new(LlamaToken(t), b))
                .collect();
            chain.push(LlamaSampler::logit_bias(n_vocab, &biases));
        }
        if p.has_penalties() {
            chain.push(LlamaSampler::penalties(
                n_vocab,
                p.penalty_last_n,
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            ));
        }
        if p.is_greedy() {
            chain.push(LlamaSampler::greedy());
        } else {
            if p.top_k > 0 {
                chain.push(LlamaSampler::top_k(p.top_k));
            }
            if p.top_p < 1.0 {
                chain.push(LlamaSampler::top_p(p.top_p, 1));
            }
            if p.min_p > 0.0 {
                chain.push(LlamaSampler::min_p(p.min_p, 1));
            }
            chain.push(LlamaSampler::temp(p.temperature));
            // llama.cpp seeds its RNG with 32 bits; fold the 64-bit seed.
            chain.push(LlamaSampler::dist((p.seed ^ (p.seed >> 32)) as u32));
        }
        SeqSampler::Chain(LlamaSampler::chain_simple(chain))
    }

    /// Sample the next token at batch position `idx`. With an allowed-token mask (ABI 1.2),
    /// disallowed tokens leave the distribution before the chain runs: biases, penalties,
    /// top-k/p, temperature and the reported logprobs all see only the allowed tokens.
    pub(crate) fn sample(
        &mut self,
        ctx: &LlamaContext<'_>,
        idx: i32,
        p: &Sampling,
        allowed: Option<&[u32]>,
    ) -> Result<SampledToken, EngineError> {
        let raw = ctx.get_logits_ith(idx);
        let masked;
        let logits = match allowed {
            None => raw,
            Some(mask) => {
                masked = apply_mask(raw, mask)?;
                &masked[..]
            }
        };
        let token = match (self, allowed) {
            (SeqSampler::Argmax, _) => argmax(logits),
            // `sample` also accepts the token into the chain (penalty history).
            (SeqSampler::Chain(s), None) => s.sample(ctx, idx).0,
            (SeqSampler::Chain(s), Some(_)) => {
                // Only the allowed tokens become candidates: a disallowed token's probability
                // is 0, so leaving it out changes nothing but the work.
                let mut cands = LlamaTokenDataArray::from_iter(
                    logits
                        .iter()
                        .enumerate()
                        .filter(|(_, l)| l.is_finite())
                        .map(|(t, &l)| LlamaTokenData::new(LlamaToken(t as i32), l, 0.0)),
                    false,
                );
                s.apply(&mut cands);
                let t = cands.selected_token().ok_or_else(|| {
                    EngineError::internal("the sampler chain selected no allowed token")
                })?;
                s.accept(t);
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
