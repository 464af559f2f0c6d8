//! Native engine, after the forward pass: one sequence's logits into its next token.
//!
//! The order is llama.cpp's (so both engines treat a request alike): allowed-token mask, logit
//! bias, penalties over the tokens this sequence generated, then either argmax or top-k → top-p →
//! min-p → temperature → a draw from the sequence's own seeded generator. Log-probabilities are
//! those of the model's distribution after the mask (what the request may sample), before bias,
//! penalties and temperature. A draft verification (ABI 1.5) samples several rows of one
//! sequence in one step, in order, each recording its token before the next; a truncation
//! forgets the samples taken after the positions it drops ([`SeqSampler::forget`]).

use gantry_engine_abi::{EngineError, SampledToken, Sampling};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Per-sequence sampling state, made on the first sample and kept until release.
pub struct SeqSampler {
    rng: StdRng,
    /// Tokens sampled so far, for the penalties.
    generated: Vec<i32>,
}

impl SeqSampler {
    pub fn new(p: &Sampling) -> Self {
        Self {
            rng: StdRng::seed_from_u64(p.seed),
            generated: Vec::new(),
        }
    }

    /// Tokens sampled so far (a device sampler's penalties read them).
    pub fn generated(&self) -> &[i32] {
        &self.generated
    }

    /// A token a device sampler drew for this sequence; the count of tokens is its next
    /// draw's counter.
    pub fn record(&mut self, token: i32) {
        self.generated.push(token);
    }

    /// Forget the last `n` samples (ABI 1.5 `seq_truncate` dropped the positions they were
    /// taken after): the penalties no longer see them, and a device sampler's draw counter
    /// steps back with them. The host generator's stream goes on where it was.
    pub fn forget(&mut self, n: usize) {
        let keep = self.generated.len().saturating_sub(n);
        self.generated.truncate(keep);
    }

    /// Sample from `logits` (modified in place).
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        p: &Sampling,
        allowed: Option<&[u32]>,
    ) -> Result<SampledToken, EngineError> {
        if let Some(mask) = allowed {
            apply_mask(logits, mask)?;
        }
        let want_lp = p.want_logprob || p.top_logprobs > 0;
        // The distribution logprobs describe: after the mask, before everything else.
        let lse = if want_lp { log_sum_exp(logits) } else { 0.0 };
        let top = if p.top_logprobs > 0 {
            top_n(logits, p.top_logprobs as usize)
                .into_iter()
                .map(|(t, l)| (t, l - lse))
                .collect()
        } else {
            Vec::new()
        };
        let raw_of = |logits: &[f32], t: i32| logits[t as usize] - lse;
        // Logprob of the sampled token needs the unmodified logit: keep what we need.
        let snapshot = want_lp.then(|| logits.to_vec());

        for &(t, b) in &p.logit_bias {
            if let Some(l) = usize::try_from(t).ok().and_then(|t| logits.get_mut(t)) {
                *l += b;
            }
        }
        if p.has_penalties() {
            self.penalize(logits, p);
        }
        let token = if p.is_greedy() {
            argmax(logits)
        } else {
            self.draw(logits, p)?
        };
        self.generated.push(token);
        let logprob = match &snapshot {
            Some(s) => raw_of(s, token),
            None => f32::NAN,
        };
        Ok(SampledToken {
            token,
            logprob,
            top,
        })
    }

    /// llama.cpp's penalties: repetition divides a positive logit (multiplies a negative one);
    /// frequency subtracts per occurrence, presence once, over the last `penalty_last_n`
    /// generated tokens (-1: all of them, 0: none).
    fn penalize(&self, logits: &mut [f32], p: &Sampling) {
        let n = match p.penalty_last_n {
            0 => return,
            n if n < 0 => self.generated.len(),
            n => (n as usize).min(self.generated.len()),
        };
        let mut counts: std::collections::HashMap<i32, u32> = Default::default();
        for &t in &self.generated[self.generated.len() - n..] {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            let Some(l) = usize::try_from(t).ok().and_then(|t| logits.get_mut(t)) else {
                continue;
            };
            if p.repetition_penalty != 1.0 {
                if *l > 0.0 {
                    *l /= p.repetition_penalty;
                } else {
                    *l *= p.repetition_penalty;
                }
            }
            *l -= c as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }

    fn draw(&mut self, logits: &[f32], p: &Sampling) -> Result<i32, EngineError> {
        // Candidates sorted by logit, best first (only the finite ones: masked tokens are out).
        let mut cand: Vec<(i32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as i32, l))
            .collect();
        if cand.is_empty() {
            return Err(EngineError::internal("no token has a finite logit"));
        }
        let k = if p.top_k > 0 {
            (p.top_k as usize).min(cand.len())
        } else {
            cand.len()
        };
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            cand.truncate(k);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        // top-p and min-p on the untempered distribution (llama.cpp's chain order).
        let max = cand[0].1;
        let probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                cum += pr / total;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            // probs[0] is the largest: keep tokens at least min_p times as likely.
            let floor = p.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
        }
        cand.truncate(keep.max(1));
        let t = p.temperature.max(1e-6);
        let weights: Vec<f64> = cand
            .iter()
            .map(|c| f64::from((c.1 - max) / t).exp())
            .collect();
        let sum: f64 = weights.iter().sum();
        let mut r = self.rng.random::<f64>() * sum;
        for (c, w) in cand.iter().zip(&weights) {
            if r < *w {
                return Ok(c.0);
            }
            r -= w;
        }
        Ok(cand[cand.len() - 1].0)
    }
}

/// Set every token outside `mask` to -inf; an error when the mask allows none.
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) -> Result<(), EngineError> {
    let mut any = false;
    for (t, l) in logits.iter_mut().enumerate() {
        let ok = mask.get(t / 32).is_some_and(|w| w & (1 << (t % 32)) != 0);
        if ok {
            any = true;
        } else {
            *l = f32::NEG_INFINITY;
        }
    }
    if any {
        Ok(())
    } else {
        Err(EngineError::internal(
            "the allowed-token mask allows no token of the vocabulary",
        ))
    }
}

/// Index of the largest logit; the lowest index wins a tie.
pub fn argmax(logits: &[f32]) -> i32 {
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

pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    max + sum.ln() as f32
}

/// The `n` largest logits, best first (ties: lower id first).
pub fn top_n(logits: &[f32], n: usize) -> Vec<(i32, f32)> {
    let mut top: Vec<(i32, f32)> = Vec::with_capacity(n + 1);
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_finite() {
            continue;
        }
        if top.len() < n || l > top[top.len() - 1].1 {
            let pos = top.partition_point(|&(_, v)| v >= l);
            top.insert(pos, (i as i32, l));
            top.truncate(n);
        }
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling() -> Sampling {
        Sampling::greedy()
    }

    #[test]
    fn greedy_takes_the_best_allowed_token_and_reports_its_logprob() {
        let mut s = SeqSampler::new(&sampling());
        let mut logits = vec![1.0, 5.0, 2.0, 4.0];
        let p = Sampling {
            want_logprob: true,
            top_logprobs: 2,
            ..sampling()
        };
        let r = s.sample(&mut logits, &p, Some(&[0b1101])).expect("sample");
        assert_eq!(r.token, 3);
        let z: f32 = [1.0f32, 2.0, 4.0].iter().map(|l| l.exp()).sum();
        assert!((r.logprob - (4.0 - z.ln())).abs() < 1e-5);
        assert_eq!(r.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![3, 2]);
    }

    #[test]
    fn bias_and_penalties_change_the_choice() {
        let mut s = SeqSampler::new(&sampling());
        let p = Sampling {
            logit_bias: vec![(0, 10.0)],
            ..sampling()
        };
        assert_eq!(s.sample(&mut [1.0, 2.0], &p, None).expect("s").token, 0);
        // Token 0 was generated: a presence penalty now pushes it below token 1.
        let p = Sampling {
            presence_penalty: 2.0,
            ..sampling()
        };
        assert_eq!(s.sample(&mut [2.5, 2.0], &p, None).expect("s").token, 1);
    }

    #[test]
    fn forgotten_samples_no_longer_count_for_the_penalties() {
        let mut s = SeqSampler::new(&sampling());
        let p = Sampling {
            presence_penalty: 2.0,
            ..sampling()
        };
        assert_eq!(s.sample(&mut [2.5, 2.0], &p, None).expect("s").token, 0);
        assert_eq!(s.sample(&mut [2.0, 2.5], &p, None).expect("s").token, 1);
        s.forget(1);
        assert_eq!(s.generated(), &[0]);
        // Token 1 is forgotten: only token 0 is penalized.
        assert_eq!(s.sample(&mut [2.5, 1.0], &p, None).expect("s").token, 1);
        s.forget(5);
        assert!(s.generated().is_empty());
    }

    #[test]
    fn a_seed_fixes_the_draws_and_top_k_one_is_greedy() {
        let p = Sampling {
            temperature: 1.0,
            seed: 7,
            ..sampling()
        };
        let logits = vec![0.0f32; 50];
        let draw = |p: &Sampling| {
            let mut s = SeqSampler::new(p);
            (0..10)
                .map(|_| s.sample(&mut logits.clone(), p, None).expect("s").token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        assert_ne!(
            draw(&p),
            draw(&Sampling {
                seed: 8,
                ..p.clone()
            })
        );
        let mut s = SeqSampler::new(&p);
        let k1 = Sampling { top_k: 1, ..p };
        assert_eq!(
            s.sample(&mut [0.0, 3.0, 1.0], &k1, None).expect("s").token,
            1
        );
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        let p = Sampling {
            temperature: 1.0,
            min_p: 0.5,
            ..sampling()
        };
        // Only token 2 is at least half as likely as the best.
        let mut s = SeqSampler::new(&p);
        for _ in 0..20 {
            let t = s.sample(&mut [0.0, -5.0, 10.0], &p, None).expect("s").token;
            assert_eq!(t, 2);
        }
        let p = Sampling {
            temperature: 1.0,
            top_p: 0.5,
            ..sampling()
        };
        let mut s = SeqSampler::new(&p);
        for _ in 0..20 {
            assert_eq!(
                s.sample(&mut [3.0, 0.0, 0.0], &p, None).expect("s").token,
                0
            );
        }
    }
}
