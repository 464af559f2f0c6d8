//! Speculative decoding's two pure parts (scheduler, around the engine step): proposing a
//! draft by prompt lookup before the step, and reading the verification after it.
//!
//! Prompt lookup (the n-gram drafting of vLLM's `[ngram]` and llama.cpp's lookup decoding):
//! the last `n` tokens of what the sequence holds (prompt, then generated text) are looked up
//! earlier in it, longest `n` first; the tokens that followed the latest earlier occurrence are
//! the draft. No second model runs, and text that copies its input (rewrites, extraction,
//! code edits) is drafted well.
//!
//! Verification samples after every drafted token with the request's own sampler (ABI 1.5
//! `GANTRY_STEP_SAMPLE_ALL`). A draft token is kept while it equals what was sampled at its
//! position; the first sample that differs is kept in its place and ends the run. For greedy
//! requests that is the plain greedy text. For sampling it is the speculative sampling rule
//! with a draft distribution that puts all its mass on the drafted token: the draft `d` is
//! accepted with probability `p(d)`, and a rejection's replacement is drawn from `p` without
//! `d`, renormalised, which is exactly a sample from `p` that came out different from `d`. So
//! the output follows the model's distribution with or without drafts.

/// Prompt-lookup settings of one model's scheduler; `draft_tokens == 0` turns drafting off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    /// Most drafted tokens per sequence and step.
    pub draft_tokens: usize,
    /// Shortest tail looked up.
    pub ngram_min: usize,
    /// Longest tail looked up (tried first).
    pub ngram_max: usize,
    /// No drafts while more sequences than this decode in a step.
    pub max_batch: usize,
    /// Each prompt-lookup draft's length chosen per step from its sequence's acceptance rate
    /// and the measured step costs (`draft_len.rs`), `draft_tokens` at most; else always
    /// `draft_tokens` where the lookup finds that many.
    pub adaptive: bool,
}

impl Speculation {
    pub const OFF: Speculation = Speculation {
        draft_tokens: 0,
        ngram_min: 1,
        ngram_max: 1,
        max_batch: 0,
        adaptive: false,
    };

    pub fn enabled(&self) -> bool {
        self.draft_tokens > 0 && self.max_batch > 0
    }
}

/// The draft for a sequence holding `context` (prompt, then every generated token, the
/// pending one last): at most `max` tokens that followed the latest earlier occurrence of its
/// longest tail of `ngram_min..=ngram_max` tokens that occurred before. Empty when none did.
///
/// Where the tail occurred twice or more, the draft stops at the first token where the two
/// latest occurrences went on differently: text that followed the same words with two
/// different tokens (a counter, a list of months, a changed name) is a guess there, and a
/// draft rejected at its first token costs a verification for nothing. Copied text, which
/// occurred once, is drafted whole.
pub fn prompt_lookup(context: &[i32], ngram_min: usize, ngram_max: usize, max: usize) -> &[i32] {
    let len = context.len();
    if max == 0 || ngram_min == 0 {
        return &[];
    }
    for n in (ngram_min..=ngram_max.min(len.saturating_sub(1))).rev() {
        let tail = &context[len - n..];
        // Latest occurrence first: it is the most likely to go on as the text does now.
        // `start + n < len` keeps the tail itself out and leaves at least one token to draft.
        let mut found = (0..len - n)
            .rev()
            .filter(|&start| &context[start..start + n] == tail);
        if let Some(start) = found.next() {
            let from = start + n;
            let draft = &context[from..(from + max).min(len)];
            let Some(before) = found.next() else {
                return draft;
            };
            let other = &context[before + n..];
            let agreed = draft.iter().zip(other).take_while(|(a, b)| a == b).count();
            // The earlier continuation may end first (it runs into the tail): agreeing up to
            // there is agreeing.
            return if agreed < draft.len().min(other.len()) {
                &draft[..agreed]
            } else {
                draft
            };
        }
    }
    &[]
}

/// How many of `draft` the verification kept: the leading drafted tokens equal to the token
/// sampled just before them (`sampled[i]` is the sample after the entry's `i`-th token, so it
/// is compared with `draft[i]`). The output of the step is `sampled[..=kept]`.
pub fn accepted(draft: &[i32], sampled: &[i32]) -> usize {
    draft
        .iter()
        .zip(sampled)
        .take_while(|(d, s)| d == s)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_tail_that_occurred_before_proposes_what_followed_it() {
        // "a b c d e ... a b c" → the tail "a b c" occurred at 0; "d e" followed.
        let ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3];
        assert_eq!(prompt_lookup(&ctx, 1, 3, 4), &[4, 5, 9, 1]);
        assert_eq!(prompt_lookup(&ctx, 1, 3, 2), &[4, 5]);
    }

    #[test]
    fn the_latest_earlier_occurrence_drafts_as_far_as_the_one_before_agrees() {
        // "7 8" occurs at 0 (then 1 5) and at 3 (then 1 6): "1" is drafted, not what differs.
        let ctx = [7, 8, 1, 5, 7, 8, 1, 6, 7, 8];
        assert_eq!(prompt_lookup(&ctx, 2, 2, 3), &[1]);
        // Followed two ways from its first token: nothing is drafted.
        let ctx = [7, 8, 1, 7, 8, 2, 7, 8];
        assert!(prompt_lookup(&ctx, 2, 2, 1).is_empty());
        // The same continuation twice: drafted whole, also where the earlier one ends first.
        let ctx = [7, 8, 1, 2, 3, 7, 8, 1, 2, 3, 7, 8];
        assert_eq!(prompt_lookup(&ctx, 2, 2, 4), &[1, 2, 3, 7]);
        let ctx = [4, 4, 4, 4];
        assert_eq!(prompt_lookup(&ctx, 2, 2, 4), &[4]);
    }

    #[test]
    fn a_shorter_tail_is_tried_when_the_longer_one_never_occurred() {
        let ctx = [5, 6, 7, 1, 9, 9, 7];
        // "9 9 7" and "9 7" never occurred before; "7" did, followed by "1 9".
        assert_eq!(prompt_lookup(&ctx, 1, 3, 2), &[1, 9]);
        assert!(prompt_lookup(&ctx, 2, 3, 2).is_empty());
    }

    #[test]
    fn a_draft_never_runs_past_the_end_and_nothing_comes_from_nothing() {
        // The tail "3 4" occurred at 2 and was followed by the last token only.
        let ctx = [1, 2, 3, 4, 3, 4];
        assert_eq!(prompt_lookup(&ctx, 2, 2, 8), &[3, 4]);
        assert!(prompt_lookup(&[], 1, 4, 8).is_empty());
        assert!(prompt_lookup(&[1], 1, 4, 8).is_empty());
        assert!(prompt_lookup(&[1, 2, 3], 1, 4, 8).is_empty(), "no repeat");
        assert!(prompt_lookup(&[1, 1, 1], 1, 4, 0).is_empty(), "max 0");
    }

    #[test]
    fn verification_keeps_drafted_tokens_up_to_the_first_difference() {
        assert_eq!(accepted(&[4, 5, 6], &[4, 5, 6, 7]), 3, "all kept");
        assert_eq!(accepted(&[4, 5, 6], &[4, 9, 6, 7]), 1);
        assert_eq!(accepted(&[4, 5, 6], &[8, 5, 6, 7]), 0);
        assert_eq!(accepted(&[], &[8]), 0);
    }
}
