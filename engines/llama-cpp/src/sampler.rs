//! llama.cpp engine, sampling step: turns one sequence's logits into its next token (+ logprobs).
//!
//! Greedy requests without penalties or biases take a plain argmax over the
//! logits, which skips building llama.cpp's 'candidates' array of the whole
//! vocabulary on every token. Everything else runs a per-sequence llama.cpp
//! sampler chain built on the sequence's first sample and kept until release,
//! so penalties see the sequence's own history and the seeded RNG its own stream.

use gantry_engine_abi::{SampledToken, Sampling};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
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

    pub(crate) fn sample(
        &mut self,
        ctx: &LlamaContext<'_>,
        idx: i32,
        p: &Sampling,
    ) -> SampledToken {
        let logits = ctx.get_logits_ith(idx);
        let token = match self {
            SeqSampler::Argmax => argmax(logits),
            // `sample` also accepts the token into the chain (penalty history).
            SeqSampler::Chain(s) => s.sample(ctx, idx).0,
        };
        let (logprob, top) = if p.want_logprob || p.top_logprobs > 0 {
            logprobs(logits, token, p.top_logprobs as usize)
        } else {
            (f32::NAN, Vec::new())
        };
        SampledToken {
            token,
            logprob,
            top,
        }
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
