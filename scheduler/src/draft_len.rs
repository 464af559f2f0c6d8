//! Speculative decoding's draft lengths (scheduler, between the prompt lookup and the engine
//! step): how many of its drafted tokens each sequence verifies this step.
//!
//! A longer draft pays only where it is likely to be kept and the engine verifies it cheaply,
//! and neither is a constant. How often drafts are kept changes from request to request (text
//! that copies its input, then text that does not) and within one; what a step of n tokens
//! costs depends on the engine and the machine: llama.cpp's CPU kernels take four columns at a
//! time, so on this project's 2-core test machine a step of 4 tokens costs 2.1 decodes, one of
//! 5 costs 3.3 and one of 8 costs 3.1, while the native engine's CPU step of 8 costs little more
//! than one of 1. So the scheduler learns both as it runs:
//!
//! - [`Acceptance`]: per sequence, how often a drafted token is kept, as the rate of a
//!   geometric run (each drafted token kept with probability `a` once the ones before it were),
//!   at each depth of the draft, from the counts of its verifications, forgotten a little every
//!   step so that it follows the text; a sequence starts from its model's rate, and one that
//!   stopped verifying probes now and then (less often while its probes fail).
//! - [`StepCosts`]: per step size (tokens the step carries), the wall time of the steps that fed
//!   no prompt, a moving average; a size not measured lately is estimated optimistically from a
//!   smaller one, so that it gets tried and measured.
//!
//! [`choose`] then picks the drafts' lengths that maximise expected tokens per second of the
//! step: `(decoding sequences + Σ expected kept) / cost(step tokens)`, where `k` drafted
//! tokens at rate `a` keep `a + a² + … + aᵏ` on average. The marginal gain of a sequence's
//! next drafted token only falls (`aᵏ⁺¹ < aᵏ`), so adding the best next token one at a time
//! and keeping the best rate seen finds the best lengths for every step size. No draft at all
//! is one of the candidates: a sequence whose drafts are rarely kept decodes plainly.

/// Step sizes measured; a larger step is estimated from the largest measured one.
const MAX_STEP_TOKENS: usize = 64;
/// A measured size unobserved for this many steps is measured again (the context grows, the
/// machine's load changes).
const STALE_STEPS: u64 = 512;
/// Weight of a new step time in its size's average.
const COST_WEIGHT: f64 = 0.2;
/// An unmeasured size is assumed to cost this much more per token than the measured size below
/// it (optimistic, so that it is tried once and measured).
const UNMEASURED_PER_TOKEN: f64 = 0.1;
/// A sequence's counts are multiplied by this every step it decodes: they weigh the last few
/// dozen verifications, and a sequence that stopped drafting drifts back to its model's rate.
const FORGET: f64 = 0.97;
/// The model's rate, as a prior, weighs as much as this many verified tokens of a sequence.
const PRIOR_WEIGHT: f64 = 2.0;
/// The model's counts forget more slowly: they describe its traffic, not one text.
const MODEL_FORGET: f64 = 0.995;
/// A model's rate before its first verification.
const FIRST_RATE: f64 = 0.6;
/// A sequence that verified nothing for this many steps probes: its rates count as at least
/// [`PROBE_RATE`] for one step. Without it a sequence whose rates fell below what pays would
/// never verify again, and never learn that its text turned to copying.
const PROBE_AFTER: u32 = 8;
/// A probe that keeps nothing doubles the wait for the next one, up to this.
const PROBE_AFTER_MAX: u32 = 128;
const PROBE_RATE: f64 = 0.8;

/// Drafted tokens a sequence may verify in one step, at most (`draftTokens` is 1-16).
pub const MAX_DEPTH: usize = 16;

/// How often one sequence's (or one model's) drafted tokens are kept, by their depth in the
/// draft: text with structure (a list rewritten with other bullets) keeps the first tokens of
/// a draft and loses the rest at the same place every time.
#[derive(Clone, Debug, PartialEq)]
pub struct Acceptance {
    /// Drafted tokens kept at each depth (weighted by age).
    kept: [f64; MAX_DEPTH],
    /// Drafted tokens verified at each depth: kept, or the first rejected of their draft
    /// (the tokens after a rejection are not tried).
    tried: [f64; MAX_DEPTH],
    /// Steps since its last verification, and the number after which it probes.
    quiet: u32,
    probe_after: u32,
}

impl Acceptance {
    /// No verification yet: the rates are the prior's.
    pub const NONE: Acceptance = Acceptance {
        kept: [0.0; MAX_DEPTH],
        tried: [0.0; MAX_DEPTH],
        quiet: 0,
        probe_after: PROBE_AFTER,
    };

    /// The chance that a drafted token is kept once those before it were, all depths pooled,
    /// drawn towards `prior` while the counts are few.
    pub fn rate(&self, prior: f64) -> f64 {
        let kept: f64 = self.kept.iter().sum();
        let tried: f64 = self.tried.iter().sum();
        (kept + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)
    }

    /// The rate at each depth, each drawn towards the pooled rate ([`Self::rate`]): a depth
    /// never tried has the pooled rate, so a sequence whose drafts are kept tries longer ones.
    pub fn rates(&self, prior: f64) -> [f64; MAX_DEPTH] {
        let pooled = self.rate(prior);
        std::array::from_fn(|d| {
            (self.kept[d] + PRIOR_WEIGHT * pooled) / (self.tried[d] + PRIOR_WEIGHT)
        })
    }

    /// The rates this step's choice uses: [`Self::rates`], raised to [`PROBE_RATE`] when the
    /// sequence is due to probe.
    pub fn rates_now(&self, prior: f64) -> [f64; MAX_DEPTH] {
        let rates = self.rates(prior);
        if self.quiet < self.probe_after {
            return rates;
        }
        rates.map(|r| r.max(PROBE_RATE))
    }

    /// A model's rate: its sequences' verifications pooled, from [`FIRST_RATE`] before any.
    pub fn model_rate(&self) -> f64 {
        self.rate(FIRST_RATE)
    }

    /// A verification of `drafted` tokens kept the first `kept` (after the step's
    /// [`Self::forget`]).
    pub fn verified(&mut self, drafted: usize, kept: usize) {
        if self.quiet > self.probe_after {
            // It was a probe (due when the step was planned, one step ago).
            self.probe_after = if kept == 0 {
                (self.probe_after * 2).min(PROBE_AFTER_MAX)
            } else {
                PROBE_AFTER
            };
        }
        self.quiet = 0;
        for d in 0..kept.min(MAX_DEPTH) {
            self.kept[d] += 1.0;
            self.tried[d] += 1.0;
        }
        if kept < drafted.min(MAX_DEPTH) {
            self.tried[kept] += 1.0;
        }
    }

    fn scale(&mut self, by: f64) {
        for c in self.kept.iter_mut().chain(self.tried.iter_mut()) {
            *c *= by;
        }
    }

    /// One step of the sequence (drafted or not) went by.
    pub fn forget(&mut self) {
        self.scale(FORGET);
        self.quiet = self.quiet.saturating_add(1);
    }

    /// The model's counts take one verification, forgetting a little of the older ones.
    pub fn model_verified(&mut self, drafted: usize, kept: usize) {
        self.scale(MODEL_FORGET);
        self.verified(drafted, kept);
    }
}

/// What a step costs by the tokens it carries, learnt from the steps that fed no prompt.
#[derive(Clone, Debug)]
pub struct StepCosts {
    /// Average seconds of a step of `i` tokens (index 0 unused), NaN until measured.
    secs: Vec<f64>,
    /// The step count when each size was last measured.
    seen: Vec<u64>,
    /// Whether each size ran once: its first step is not measured (an engine allocates for a
    /// new batch shape the first time, llama.cpp reserves a graph).
    ran: Vec<bool>,
    steps: u64,
}

impl Default for StepCosts {
    fn default() -> Self {
        StepCosts {
            secs: vec![f64::NAN; MAX_STEP_TOKENS + 1],
            seen: vec![0; MAX_STEP_TOKENS + 1],
            ran: vec![false; MAX_STEP_TOKENS + 1],
            steps: 0,
        }
    }
}

impl StepCosts {
    /// A step of `tokens` tokens (no prompt among them) took `secs`.
    pub fn observe(&mut self, tokens: usize, secs: f64) {
        self.steps += 1;
        if tokens == 0 || tokens > MAX_STEP_TOKENS || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        if !std::mem::replace(&mut self.ran[tokens], true) {
            return;
        }
        let old = self.secs[tokens];
        self.secs[tokens] = if self.fresh(tokens) {
            // One stalled step (the machine's other work) moves the average by a bounded step.
            old + COST_WEIGHT * (secs.min(2.0 * old) - old)
        } else {
            secs
        };
        self.seen[tokens] = self.steps;
    }

    fn fresh(&self, tokens: usize) -> bool {
        self.secs[tokens].is_finite() && self.steps - self.seen[tokens] <= STALE_STEPS
    }

    /// The expected seconds of a step of `tokens` tokens: its measured average, or else the
    /// largest smaller measured size's plus a little per token; in arbitrary units (1 per
    /// token-free step) before anything was measured. Only ratios matter to [`choose`].
    pub fn estimate(&self, tokens: usize) -> f64 {
        let tokens = tokens.max(1);
        let capped = tokens.min(MAX_STEP_TOKENS);
        if tokens == capped && self.fresh(tokens) {
            return self.secs[tokens];
        }
        let (base, at) = (1..=capped)
            .rev()
            .find(|&n| self.fresh(n))
            .map_or((1.0, 1), |n| (self.secs[n], n));
        base * (1.0 + UNMEASURED_PER_TOKEN * (tokens - at) as f64)
    }

    /// The measured sizes and their average milliseconds (for logs and tests).
    pub fn measured(&self) -> Vec<(usize, f64)> {
        (1..=MAX_STEP_TOKENS)
            .filter(|&n| self.fresh(n))
            .map(|n| (n, self.secs[n] * 1e3))
            .collect()
    }
}

/// One drafting sequence's part in [`choose`]: its acceptance rate at each depth and the
/// drafted tokens available to it (the lookup's draft, already cut to what its limits allow).
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub rates: [f64; MAX_DEPTH],
    pub available: usize,
}

/// The number of drafted tokens each candidate verifies in a step that carries `base` tokens
/// without drafts (one per decoding sequence), maximising expected tokens per second of the
/// step (see the module header).
pub fn choose(base: usize, candidates: &[Candidate], costs: &StepCosts) -> Vec<usize> {
    let mut ks = vec![0usize; candidates.len()];
    let mut best = ks.clone();
    let mut expected = base as f64;
    let mut tokens = base;
    let mut best_rate = expected / costs.estimate(tokens);
    let rate = |i: usize, depth: usize| candidates[i].rates[depth].clamp(0.0, 1.0);
    // The probability that each candidate keeps its next drafted token and all before it.
    let mut next: Vec<f64> = (0..candidates.len()).map(|i| rate(i, 0)).collect();
    loop {
        let pick = (0..candidates.len())
            .filter(|&i| ks[i] < candidates[i].available.min(MAX_DEPTH))
            .max_by(|&a, &b| next[a].total_cmp(&next[b]));
        let Some(i) = pick else { break };
        ks[i] += 1;
        expected += next[i];
        if ks[i] < MAX_DEPTH {
            next[i] *= rate(i, ks[i]);
        }
        tokens += 1;
        let per_sec = expected / costs.estimate(tokens);
        if per_sec > best_rate {
            best_rate = per_sec;
            best.clone_from(&ks);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Step costs measured on the test machine for llama.cpp's CPU plugin (Gemma 3 270M
    /// Q4_K_M, 2 threads), in ms by tokens 1..=8.
    fn llama_cpu() -> StepCosts {
        let mut c = StepCosts::default();
        for (n, ms) in [15.0, 24.4, 29.5, 31.5, 50.3, 56.2, 52.0, 47.7]
            .iter()
            .enumerate()
        {
            c.observe(n + 1, 1.0); // the first step of a size is not measured
            c.observe(n + 1, ms / 1e3);
        }
        c
    }

    fn one(rate: f64, available: usize, costs: &StepCosts) -> usize {
        let rates = [rate; MAX_DEPTH];
        choose(1, &[Candidate { rates, available }], costs)[0]
    }

    #[test]
    fn the_length_follows_the_acceptance_rate_and_the_costs() {
        let c = llama_cpu();
        // Nearly always kept: the step of 8, which costs 3.2 decodes, gives 7.
        assert_eq!(one(0.97, 7, &c), 7);
        // Often kept: 4 tokens (2.1 decodes) beat 8 (3.2) and anything between.
        assert_eq!(one(0.75, 7, &c), 3);
        // Half kept: the expected gain does not pay for the longer step.
        assert_eq!(one(0.5, 7, &c), 0);
        // Only what the lookup found can be verified.
        assert_eq!(one(0.97, 2, &c), 2);
        assert_eq!(one(0.97, 0, &c), 0);
        // An engine whose longer steps cost little (the native CPU engine reads each weight
        // once per step) drafts all it has at a rate where llama.cpp's does not draft.
        let mut flat = StepCosts::default();
        for n in 1..=8 {
            flat.observe(n, 1.0);
            flat.observe(n, 0.030 + 0.0002 * n as f64);
        }
        assert_eq!(one(0.7, 7, &flat), 7);
        assert_eq!(one(0.7, 7, &c), 3);
    }

    #[test]
    fn two_sequences_share_the_step_by_their_rates() {
        let mut flat = StepCosts::default();
        for n in 1..=8 {
            flat.observe(n, 1.0);
            flat.observe(n, 0.030 + 0.004 * n as f64);
        }
        let ks = choose(
            2,
            &[
                Candidate {
                    rates: [0.9; MAX_DEPTH],
                    available: 5,
                },
                Candidate {
                    rates: [0.1; MAX_DEPTH],
                    available: 5,
                },
            ],
            &flat,
        );
        assert_eq!(ks[1], 0, "a rarely kept draft is left out: {ks:?}");
        assert!(ks[0] >= 3, "the likely one drafts: {ks:?}");
    }

    #[test]
    fn unmeasured_sizes_are_estimated_optimistically_and_stale_ones_measured_again() {
        let mut c = StepCosts::default();
        assert_eq!(c.estimate(1), 1.0, "nothing measured: arbitrary units");
        c.observe(1, 5.0);
        assert_eq!(c.estimate(1), 1.0, "a size's first step is not measured");
        c.observe(1, 0.010);
        assert!((c.estimate(1) - 0.010).abs() < 1e-12);
        // Size 4 unmeasured: from size 1, 10 % per extra token.
        assert!((c.estimate(4) - 0.013).abs() < 1e-12);
        c.observe(4, 1.0);
        c.observe(4, 0.020);
        assert!((c.estimate(4) - 0.020).abs() < 1e-12);
        // Averages move by a fifth of the difference; a stall counts as at most twice the average.
        c.observe(4, 1.0);
        assert!((c.estimate(4) - 0.024).abs() < 1e-12, "{}", c.estimate(4));
        assert_eq!(c.measured().len(), 2);
        // Beyond the table: from the largest measured size.
        assert!((c.estimate(100) - 0.024 * (1.0 + 0.1 * 96.0)).abs() < 1e-9);
        // Unobserved for long, size 4 is measured afresh.
        for _ in 0..=STALE_STEPS {
            c.observe(1, 0.010);
        }
        assert!((c.estimate(4) - 0.013).abs() < 1e-9);
        c.observe(4, 0.050);
        assert!((c.estimate(4) - 0.050).abs() < 1e-12);
    }

    #[test]
    fn a_sequence_rate_starts_at_the_model_rate_follows_its_drafts_and_drifts_back() {
        let model = 0.8;
        let mut a = Acceptance::NONE;
        assert!((a.rate(model) - model).abs() < 1e-12);
        assert_eq!(a.rates(model), [model; MAX_DEPTH]);
        for _ in 0..20 {
            a.forget();
            a.verified(3, 0);
        }
        let low = a.rate(model);
        assert!(low < 0.15, "every draft rejected: {low}");
        // Steps without drafts: back towards the model's rate, so it drafts again in time.
        for _ in 0..200 {
            a.forget();
        }
        assert!(a.rate(model) > 0.7, "{}", a.rate(model));
        // All kept: towards 1.
        for _ in 0..30 {
            a.forget();
            a.verified(3, 3);
        }
        assert!(a.rate(model) > 0.95, "{}", a.rate(model));
        let mut m = Acceptance::NONE;
        assert!((m.model_rate() - FIRST_RATE).abs() < 1e-12);
        for _ in 0..1000 {
            m.model_verified(4, 1);
        }
        // One kept per verification, every one ending in a rejection: a = 1/2.
        assert!((m.model_rate() - 0.5).abs() < 0.01, "{}", m.model_rate());
    }

    #[test]
    fn a_draft_that_fails_at_the_same_depth_every_time_is_cut_before_it() {
        // A list rewritten with other bullets: the first three drafted tokens are kept, the
        // fourth never.
        let mut a = Acceptance::NONE;
        for _ in 0..12 {
            a.forget();
            a.verified(7, 3);
        }
        let rates = a.rates(FIRST_RATE);
        assert!(rates[..3].iter().all(|&r| r > 0.85), "{rates:?}");
        assert!(rates[3] < 0.2, "{rates:?}");
        // Depths never tried take the pooled rate (3 kept of 4 tried).
        assert!((rates[6] - a.rate(FIRST_RATE)).abs() < 1e-12);
        let c = llama_cpu();
        let k = choose(
            1,
            &[Candidate {
                rates,
                available: 7,
            }],
            &c,
        )[0];
        assert_eq!(k, 3, "{rates:?}");
    }

    #[test]
    fn a_sequence_that_stopped_verifying_probes_less_often_while_probes_fail() {
        let c = llama_cpu();
        let mut a = Acceptance::NONE;
        for _ in 0..10 {
            a.forget();
            a.verified(3, 0);
        }
        let k = |a: &Acceptance| {
            choose(
                1,
                &[Candidate {
                    rates: a.rates_now(0.6),
                    available: 7,
                }],
                &c,
            )[0]
        };
        // Steps without drafts until the probe is due.
        let mut waited = 0;
        while k(&a) == 0 {
            a.forget();
            waited += 1;
            assert!(waited <= PROBE_AFTER, "no probe after {waited} steps");
        }
        assert_eq!(waited, PROBE_AFTER);
        // The probe verifies, keeps nothing: the next one waits twice as long.
        a.forget();
        a.verified(k(&a).max(1), 0);
        let mut waited = 0;
        while k(&a) == 0 {
            a.forget();
            waited += 1;
        }
        assert_eq!(waited, 2 * PROBE_AFTER);
        // A probe that keeps tokens resets the wait.
        a.forget();
        a.verified(3, 3);
        assert_eq!(a.probe_after, PROBE_AFTER);
    }
}
