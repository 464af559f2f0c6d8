//! Node, speech recognition, between a window's decode and its segments: openai-whisper's
//! (and faster-whisper's) temperature fallback and silence skip, as OpenAI's API describes
//! `temperature = 0` ("the model will use log probability to automatically increase the
//! temperature until certain thresholds are hit").
//!
//! A window is decoded greedily first. Its answer is decoded again at the next temperature of
//! [`TEMPERATURES`] when its text repeats itself (compression ratio above 2.4) or the model
//! doubts it (average log-probability below -1), unless it is silence: a no-speech probability
//! above 0.6 with an average log-probability below -1. Above zero, [`BEST_OF`] samples are
//! drawn and the one with the highest log-probability per token kept. The last temperature's
//! answer stands whatever it scores (openai-whisper's rule; faster-whisper keeps the best of
//! the failed answers instead). A window whose final answer is silence gives no segment, and
//! the next window starts after it.
//!
//! The log-probabilities are openai-whisper's: every sampled token's, the end of text's
//! included (the scheduler reports it for audio jobs, `GenEvent::StopLogprob`).

use super::{Token, compression_ratio};

/// The temperatures tried in turn when the request's is 0 (openai-whisper's and
/// faster-whisper's defaults).
pub const TEMPERATURES: [f32; 6] = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0];
/// Samples drawn at a temperature above zero (their `best_of`).
pub const BEST_OF: usize = 5;
const COMPRESSION_RATIO_THRESHOLD: f64 = 2.4;
const LOGPROB_THRESHOLD: f32 = -1.0;
const NO_SPEECH_THRESHOLD: f32 = 0.6;

/// One decode of a window: its sampled tokens (text and timestamps, the end of text left
/// out), the time after its last token (word times), its no-speech probability, and the
/// temperature it was sampled at.
pub struct Attempt {
    pub tokens: Vec<Token>,
    pub tail: Option<f32>,
    pub no_speech: Option<f32>,
    /// The end of text's log-probability, when the decode ended on it.
    pub stop_logprob: Option<f32>,
    pub temperature: f32,
}

impl Attempt {
    /// openai-whisper's `avg_logprob` of a decode: the sampled tokens' log-probabilities, the
    /// end of text's included, over their count plus one (the end of text).
    pub fn avg_logprob(&self) -> f32 {
        self.sum_logprob() / (self.tokens.len() + 1) as f32
    }

    /// openai-whisper's `sum_logprobs`: every sampled token's, the end of text's included.
    fn sum_logprob(&self) -> f32 {
        self.tokens.iter().map(|t| t.logprob).sum::<f32>() + self.stop_logprob.unwrap_or(0.0)
    }

    /// The text of its text tokens (timestamps and special tokens have no bytes).
    pub fn text(&self) -> String {
        let bytes: Vec<u8> = self
            .tokens
            .iter()
            .flat_map(|t| t.bytes.iter().copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether the next temperature should be tried: a poor answer that is not silence.
    pub fn needs_fallback(&self) -> bool {
        let poor = compression_ratio(&self.text()) > COMPRESSION_RATIO_THRESHOLD
            || self.avg_logprob() < LOGPROB_THRESHOLD;
        poor && !self.is_silence()
    }

    /// Whether the window is silence: no segment comes of it.
    pub fn is_silence(&self) -> bool {
        self.no_speech.is_some_and(|p| p > NO_SPEECH_THRESHOLD)
            && self.avg_logprob() < LOGPROB_THRESHOLD
    }
}

/// The best of several samples at one temperature: the highest log-probability per token
/// (openai-whisper's ranking without a length penalty, where a sample that ends at once
/// divides by a length of 0 and ranks last); `None` for none.
pub fn best(samples: Vec<Attempt>) -> Option<Attempt> {
    let score = |a: &Attempt| match a.tokens.len() {
        0 => f32::NEG_INFINITY,
        n => a.sum_logprob() / n as f32,
    };
    samples
        .into_iter()
        .max_by(|a, b| score(a).total_cmp(&score(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(words: &[(&str, f32)], no_speech: Option<f32>) -> Attempt {
        Attempt {
            tokens: words
                .iter()
                .map(|&(w, lp)| Token {
                    id: 1,
                    bytes: w.as_bytes().to_vec(),
                    logprob: lp,
                    time: None,
                })
                .collect(),
            tail: None,
            no_speech,
            stop_logprob: None,
            temperature: 0.0,
        }
    }

    #[test]
    fn a_confident_varied_answer_stands() {
        let a = attempt(
            &[
                (" And so", -0.1),
                (" my fellow", -0.2),
                (" Americans", -0.1),
            ],
            Some(0.02),
        );
        assert!((a.avg_logprob() - (-0.1)).abs() < 1e-6);
        assert!(!a.needs_fallback());
        assert!(!a.is_silence());
    }

    #[test]
    fn a_repeating_or_doubtful_answer_is_tried_again_unless_it_is_silence() {
        let repeats: Vec<(&str, f32)> = std::iter::repeat_n((" the the the", -0.05), 40).collect();
        let a = attempt(&repeats, Some(0.1));
        assert!(compression_ratio(&a.text()) > 2.4);
        assert!(a.needs_fallback());
        let doubtful = attempt(&[(" mumble", -2.5), (" words", -1.5)], Some(0.3));
        assert!(doubtful.needs_fallback());
        assert!(!doubtful.is_silence());
        // Repeating itself confidently where the model hears no speech: tried again (only
        // silence, no speech and doubt together, is spared).
        let looping: Vec<(&str, f32)> = std::iter::repeat_n((" you you you", -0.01), 40).collect();
        assert!(attempt(&looping, Some(0.9)).needs_fallback());
        // The model heard no speech: no retry, and the doubtful text is dropped as silence.
        let silent = attempt(&[(" you", -2.5)], Some(0.95));
        assert!(!silent.needs_fallback());
        assert!(silent.is_silence());
        // No speech but a confident word (tiny.en's " You" on silence, -0.97 by faster-whisper):
        // kept, as faster-whisper keeps it.
        let kept = attempt(&[(" You", -1.9)], Some(0.95));
        assert!(!kept.is_silence());
    }

    #[test]
    fn the_best_sample_has_the_highest_log_probability_per_token() {
        let short = attempt(&[(" a", -0.9)], None);
        let long = attempt(&[(" a", -0.5), (" b", -0.5), (" c", -0.5)], None);
        let worst = attempt(&[(" x", -3.0)], None);
        let empty = attempt(&[], None);
        let b = best(vec![short, empty, long, worst]).expect("one");
        assert_eq!(b.tokens.len(), 3);
        // A sample that ended at once is the last choice, not a perfect score.
        let b = best(vec![attempt(&[], None), attempt(&[(" x", -3.0)], None)]).expect("one");
        assert_eq!(b.tokens.len(), 1);
        assert!(best(Vec::new()).is_none());
    }
}
