//! A request's grammar while it generates (scheduler step, before and after each sampling): the
//! llguidance matcher behind the scheduler's `Grammar` trait — the allowed-token mask for the
//! next token, then the sampled token consumed.

use std::time::Instant;

use llguidance::Matcher;

use super::FractionBound;

/// One request's grammar state: the scheduler asks it for the next mask and tells it each
/// sampled token.
pub struct Constraint {
    matcher: Matcher,
    /// A strict schema's bound on a number's fraction digits (`digits.rs`).
    bound: Option<FractionBound>,
    mask: Vec<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    pub(super) fn new(matcher: Matcher, bound: Option<FractionBound>) -> Self {
        Self {
            matcher,
            bound,
            mask: Vec::new(),
        }
    }
}

impl gantry_scheduler::Grammar for Constraint {
    /// Compute the tokens allowed next (only the end-of-generation tokens once the grammar is
    /// complete); returns the time it took.
    fn compute_mask(&mut self) -> Result<f64, String> {
        let t = Instant::now();
        let vob = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("grammar: {e}"))?;
        self.mask.clear();
        self.mask.extend_from_slice(vob.as_slice());
        if let Some(bound) = &mut self.bound {
            bound.restrict(&mut self.mask);
        }
        if self.mask.iter().all(|&w| w == 0) {
            return Err("grammar: no token can continue the output".into());
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// The mask from the last [`compute_mask`](Self::compute_mask).
    fn mask(&self) -> &[u32] {
        &self.mask
    }

    /// Advance past a sampled (non end-of-generation) token.
    fn consume(&mut self, token: i32) -> Result<(), String> {
        self.matcher
            .consume_token(token as u32)
            .map_err(|e| format!("grammar: {e}"))?;
        if let Some(bound) = &mut self.bound {
            bound.consume(token as u32);
        }
        Ok(())
    }

    /// Whether the grammar is complete: nothing but the end of generation may follow.
    fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
