//! Native engine, Whisper's decoding rules (inside `step`, between the decoder's logits and the
//! sampler): what the released models are decoded with, as openai-whisper and transformers'
//! `generate` apply them, read from the checkpoint's `generation_config.json` (or
//! `config.json`).
//!
//! - `suppress_tokens`: never sampled (non-speech symbols, the task and language markers);
//! - `begin_suppress_tokens`: not as the first sampled token (a blank, end of text);
//! - timestamps, when the decoder prompt lacks `<|notimestamps|>`: the first token is a
//!   timestamp no later than `max_initial_timestamp_index` (1 s); timestamps come in pairs
//!   (a segment's end and the next one's start) except right before the end of text; they never
//!   go back; `<|notimestamps|>` itself is never sampled; and when the timestamps together are
//!   likelier than any single text token, a timestamp is what comes next.
//!
//! The prompt is recognised in the sequence's own tokens: everything after its last
//! `<|startoftranscript|>` and the special tokens that follow it (language, task,
//! `<|notimestamps|>`) was sampled. A sequence without `<|startoftranscript|>` is left alone.
//!
//! Language detection: on a multilingual model, the token right after a bare
//! `<|startoftranscript|>` is its language, as openai-whisper's `detect_language` reads it:
//! every token but the language tokens is masked there (a transcription's prompt names its
//! language itself, so this only shapes a prompt that stops at the start token).

use serde_json::Value;

/// The rules of one checkpoint.
#[derive(Clone, Debug, Default)]
pub struct Rules {
    suppress: Vec<usize>,
    begin_suppress: Vec<usize>,
    sot: Option<i32>,
    eos: i32,
    /// `<|notimestamps|>`; timestamps are the ids after it (0.02 s apart).
    no_timestamps: Option<i32>,
    /// The latest first timestamp, in 0.02 s steps.
    max_initial: usize,
    /// The language tokens of a multilingual model (empty for an English-only one).
    languages: Vec<usize>,
}

/// The vocabulary of every released English-only Whisper (`tiny.en` to `medium.en`); the
/// multilingual ones have one or two tokens more.
const ENGLISH_ONLY_VOCAB: usize = 51_864;

fn ids(v: Option<&Value>, vocab: usize) -> Vec<usize> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|i| i as usize)
                .filter(|&i| i < vocab)
                .collect()
        })
        .unwrap_or_default()
}

impl Rules {
    /// From `generation_config.json` (`generation`, where the checkpoint has one) over
    /// `config.json`; `no_timestamps` is the tokenizer's `<|notimestamps|>` when neither says.
    ///
    /// `languages`: the tokenizer's language tokens (`<|en|>`, `<|haw|>`, ...), kept when the
    /// model is multilingual: `is_multilingual` where the generation config says, else unless
    /// the vocabulary is the 51,864 tokens of every released English-only Whisper.
    pub fn parse(
        config: &Value,
        generation: Option<&Value>,
        (vocab, eos): (usize, i32),
        no_timestamps: Option<i32>,
        languages: Vec<usize>,
    ) -> Self {
        let get = |k: &str| generation.and_then(|g| g.get(k)).or_else(|| config.get(k));
        let id = |k: &str| get(k).and_then(Value::as_i64).map(|i| i as i32);
        let multilingual = generation
            .and_then(|g| g.get("is_multilingual"))
            .and_then(Value::as_bool)
            .unwrap_or(vocab != ENGLISH_ONLY_VOCAB);
        Self {
            languages: match multilingual {
                true => languages.into_iter().filter(|&i| i < vocab).collect(),
                false => Vec::new(),
            },
            suppress: ids(get("suppress_tokens"), vocab),
            begin_suppress: ids(get("begin_suppress_tokens"), vocab),
            sot: id("decoder_start_token_id"),
            eos,
            no_timestamps: id("no_timestamps_token_id").or(no_timestamps),
            // openai-whisper's default, 1 s, where the checkpoint does not say.
            max_initial: get("max_initial_timestamp_index")
                .and_then(Value::as_u64)
                .map_or(50, |i| i as usize),
        }
    }

    /// `<|notimestamps|>`, when the model has it.
    pub fn no_timestamps(&self) -> Option<i32> {
        self.no_timestamps
    }

    /// The time a timestamp token stands for (seconds from the window's start), `None` for
    /// every other token.
    pub fn timestamp(&self, token: i32) -> Option<f32> {
        let first = self.no_timestamps? + 1;
        (token >= first).then(|| (token - first) as f32 * 0.02)
    }

    /// Where the sampled tokens of `history` begin, and whether they carry timestamps; `None`
    /// for a sequence without a Whisper prompt.
    fn sampled_from(&self, history: &[i32]) -> Option<(usize, bool)> {
        let sot = self.sot?;
        let start = history.iter().rposition(|&t| t == sot)?;
        let first_ts = self.no_timestamps.map_or(i32::MAX, |n| n + 1);
        let mut begin = start + 1;
        let mut timestamps = self.no_timestamps.is_some();
        while let Some(&t) = history.get(begin) {
            if t <= self.eos || t >= first_ts {
                break;
            }
            if Some(t) == self.no_timestamps {
                timestamps = false;
            }
            begin += 1;
        }
        Some((begin, timestamps))
    }

    /// Whether `text` is a language token's: `<|` two or three lower-case letters `|>`.
    pub fn is_language_token(text: &[u8]) -> bool {
        text.len() >= 6
            && text.len() <= 7
            && text.starts_with(b"<|")
            && text.ends_with(b"|>")
            && text[2..text.len() - 2].iter().all(u8::is_ascii_lowercase)
    }

    /// The logits of the token after `history`, changed in place by the rules.
    pub fn apply(&self, history: &[i32], logits: &mut [f32]) {
        if !self.languages.is_empty() && self.sot.is_some_and(|s| history.last() == Some(&s)) {
            // Language detection: only a language token may follow a bare start token.
            let keep: Vec<f32> = self.languages.iter().map(|&i| logits[i]).collect();
            logits.fill(f32::NEG_INFINITY);
            for (&i, v) in self.languages.iter().zip(keep) {
                logits[i] = v;
            }
            return;
        }
        let Some((begin, timestamps)) = self.sampled_from(history) else {
            return;
        };
        let sampled = &history[begin..];
        for &i in &self.suppress {
            logits[i] = f32::NEG_INFINITY;
        }
        if sampled.is_empty() {
            for &i in &self.begin_suppress {
                logits[i] = f32::NEG_INFINITY;
            }
        }
        let Some(no_ts) = self.no_timestamps.filter(|_| timestamps) else {
            return;
        };
        let first = (no_ts + 1) as usize;
        if first >= logits.len() {
            return;
        }
        let is_ts = |t: i32| t as usize >= first;
        logits[no_ts as usize] = f32::NEG_INFINITY;
        let n = sampled.len();
        let last = n >= 1 && is_ts(sampled[n - 1]);
        let penultimate = n < 2 || is_ts(sampled[n - 2]);
        if last {
            if penultimate {
                // A pair closed: text (or the end) comes next.
                logits[first..].fill(f32::NEG_INFINITY);
            } else {
                // A segment's end: its pair or the end of text, no text.
                logits[..self.eos as usize].fill(f32::NEG_INFINITY);
            }
        }
        if let Some(&t) = sampled.iter().rev().find(|&&t| is_ts(t)) {
            // Never back in time; a closed pair's time is not repeated.
            let floor = (if last && !penultimate { t } else { t + 1 } as usize).min(logits.len());
            logits[first..floor].fill(f32::NEG_INFINITY);
        }
        if n == 0 {
            logits[..first].fill(f32::NEG_INFINITY);
            let end = (first + self.max_initial + 1).min(logits.len());
            logits[end..].fill(f32::NEG_INFINITY);
        }
        // The timestamps' probability together against the likeliest text token's.
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return;
        }
        let sum = |xs: &[f32]| xs.iter().map(|&x| f64::from(x - max).exp()).sum::<f64>();
        let ts_mass = sum(&logits[first..]);
        let text_max = logits[..first]
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        if ts_mass > f64::from(text_max - max).exp() {
            logits[..first].fill(f32::NEG_INFINITY);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    // A toy vocabulary: 0..10 text, 10 end of text, 11 start, 12 language, 13 notimestamps,
    // 14.. timestamps (0.00, 0.02, ...).
    const EOS: i32 = 10;
    const SOT: i32 = 11;
    const NO_TS: i32 = 13;
    const VOCAB: usize = 24;

    fn rules() -> Rules {
        let config = json!({"decoder_start_token_id": SOT, "suppress_tokens": [3, SOT, 12],
            "begin_suppress_tokens": [0, EOS]});
        let generation = json!({"no_timestamps_token_id": NO_TS, "max_initial_timestamp_index": 2,
            "is_multilingual": false});
        Rules::parse(&config, Some(&generation), (VOCAB, EOS), None, vec![12])
    }

    fn allowed(r: &Rules, history: &[i32], logits: &[f32]) -> Vec<usize> {
        let mut l = logits.to_vec();
        r.apply(history, &mut l);
        (0..VOCAB).filter(|&i| l[i] > f32::NEG_INFINITY).collect()
    }

    #[test]
    fn without_timestamps_only_the_suppressions() {
        let r = rules();
        let flat = vec![0.0; VOCAB];
        let prompt = [SOT, 12, NO_TS];
        let first = allowed(&r, &prompt, &flat);
        assert!(!first.contains(&3) && !first.contains(&0) && !first.contains(&(EOS as usize)));
        assert!(first.contains(&1) && first.contains(&20));
        let later = allowed(&r, &[SOT, 12, NO_TS, 5], &flat);
        assert!(!later.contains(&3) && later.contains(&0) && later.contains(&(EOS as usize)));
        // No Whisper prompt: nothing changes.
        assert_eq!(allowed(&r, &[1, 2], &flat).len(), VOCAB);
    }

    #[test]
    fn timestamps_open_close_pair_and_never_go_back() {
        let r = rules();
        let flat = vec![0.0; VOCAB];
        // First: a timestamp up to the initial limit (14, 15, 16).
        assert_eq!(allowed(&r, &[SOT, 12], &flat), vec![14, 15, 16]);
        // After the opening timestamp: text (or the end), no second timestamp.
        let after_open = allowed(&r, &[SOT, 12, 15], &flat);
        assert!(after_open.contains(&5) && !after_open.contains(&3));
        assert!(after_open.iter().all(|&i| i < NO_TS as usize));
        // Inside a segment: text, or a closing time at or after its start.
        // (text likelier than the timestamps together, so the last rule keeps it).
        let mut textish = flat.clone();
        textish[..EOS as usize].fill(5.0);
        let inside = allowed(&r, &[SOT, 12, 15, 5], &textish);
        assert!(inside.contains(&5) && !inside.contains(&14) && !inside.contains(&15));
        assert!(inside.contains(&16) && !inside.contains(&(NO_TS as usize)));
        // After text then a closing timestamp: the next segment's start at or after it, or end.
        textish[EOS as usize] = 5.0;
        let after_close = allowed(&r, &[SOT, 12, 15, 5, 17], &textish);
        assert_eq!(after_close, vec![EOS as usize, 17, 18, 19, 20, 21, 22, 23]);
        // After a pair: text only (no third timestamp), never earlier.
        let after_pair = allowed(&r, &[SOT, 12, 15, 5, 17, 17], &flat);
        assert!(after_pair.iter().all(|&i| i < 14) && after_pair.contains(&5));
    }

    #[test]
    fn timestamps_win_when_likelier_together() {
        let r = rules();
        // Text token 5 at logit 1, each of ten timestamps at 0: e^0 × 10 > e^1.
        let mut logits = vec![-30.0; VOCAB];
        logits[5] = 1.0;
        logits[14..].fill(0.0);
        let got = allowed(&r, &[SOT, 12, 14, 4], &logits);
        assert!(got.iter().all(|&i| i >= 14), "{got:?}");
        // Text token 5 at logit 4: text stays possible.
        logits[5] = 4.0;
        assert!(allowed(&r, &[SOT, 12, 14, 4], &logits).contains(&5));
    }

    #[test]
    fn a_bare_start_token_is_followed_by_a_language_on_a_multilingual_model() {
        let config = json!({"decoder_start_token_id": SOT, "suppress_tokens": [3]});
        let generation = json!({"no_timestamps_token_id": NO_TS});
        // 12 and 9 are languages here; the model is multilingual by its vocabulary.
        let r = Rules::parse(&config, Some(&generation), (VOCAB, EOS), None, vec![12, 9]);
        let flat = vec![0.0; VOCAB];
        assert_eq!(allowed(&r, &[SOT], &flat), vec![9, 12]);
        // With the language given, the transcription's rules as usual.
        assert!(allowed(&r, &[SOT, 12, NO_TS], &flat).contains(&5));
        // English-only (as the generation config says): no detection.
        let en = json!({"no_timestamps_token_id": NO_TS, "is_multilingual": false});
        let r = Rules::parse(&config, Some(&en), (VOCAB, EOS), None, vec![12, 9]);
        assert_eq!(allowed(&r, &[SOT], &flat), (14..24).collect::<Vec<_>>());
        assert!(Rules::is_language_token(b"<|en|>") && Rules::is_language_token(b"<|haw|>"));
        assert!(
            !Rules::is_language_token(b"<|0.00|>") && !Rules::is_language_token(b"<|nocaptions|>")
        );
    }
}
