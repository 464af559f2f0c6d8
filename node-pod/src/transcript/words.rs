//! Node, speech recognition's word timestamps (after the scheduler's tokens and their times,
//! ABI 1.11 `seq_token_times`; before `verbose_json`): a segment's text tokens grouped into
//! words as openai-whisper groups them (a word starts at a token that starts with a space or
//! is punctuation), punctuation merged into the word it belongs to, and each word timed from
//! its tokens: it starts where its first token starts and ends where the token after its last
//! one starts.

use super::Token;

/// One word of a transcript and when it is spoken (seconds from the audio's start).
#[derive(Clone, Debug, PartialEq)]
pub struct Word {
    pub word: String,
    pub start: f64,
    pub end: f64,
}

/// Opening punctuation, joined to the word after it (openai-whisper's `prepend_punctuations`).
const PREPENDED: &str = "\"'“¿([{-";
/// Closing punctuation, joined to the word before it (its `append_punctuations`).
const APPENDED: &str = "\"'.。,，!！?？:：”)]}、";
/// Python's `string.punctuation`, which openai-whisper tests a token's text against as a
/// substring.
const PUNCTUATION: &str = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";

/// A word while it is built: its text and the indices (in the window) of its first token and
/// of the token after its last.
struct Span {
    text: String,
    first: usize,
    after: usize,
}

/// The words of the text tokens `text` (indices into the window's `tokens`, in order), timed
/// by the tokens' times (seconds from the window's start, `offset` in the audio); `tail` is
/// the time after the window's last token. Words are kept within `[from, to]`, the segment.
pub fn words(
    tokens: &[Token],
    text: &[usize],
    tail: Option<f32>,
    offset: f64,
    (from, to): (f64, f64),
) -> Vec<Word> {
    // Tokens joined until their bytes are whole characters.
    let mut units: Vec<Span> = Vec::new();
    let mut bytes = Vec::new();
    let mut first = None;
    for &i in text {
        first.get_or_insert(i);
        bytes.extend_from_slice(&tokens[i].bytes);
        // Whole characters, or bytes that can never become one (a character left unfinished
        // and another begun): the unit ends here either way.
        let done = match std::str::from_utf8(&bytes) {
            Ok(_) => true,
            Err(e) => e.error_len().is_some(),
        };
        if done {
            units.push(Span {
                text: String::from_utf8_lossy(&bytes).into_owned(),
                first: first.take().unwrap_or(i),
                after: i + 1,
            });
            bytes.clear();
        }
    }
    if let (false, Some(f)) = (bytes.is_empty(), first) {
        units.push(Span {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            first: f,
            after: text.last().map_or(f + 1, |&l| l + 1),
        });
    }
    let mut spans: Vec<Span> = Vec::new();
    for u in units {
        let starts = u.text.starts_with(' ') || PUNCTUATION.contains(u.text.trim());
        match spans.last_mut() {
            Some(w) if !starts => {
                w.text.push_str(&u.text);
                w.after = u.after;
            }
            _ => spans.push(u),
        }
    }
    let time = |i: usize| {
        tokens
            .get(i)
            .map_or(tail, |t| t.time)
            .map(|t| offset + f64::from(t))
    };
    let to = to.max(from);
    let mut out: Vec<Word> = spans
        .iter()
        .map(|s| {
            let start = time(s.first).unwrap_or(from).clamp(from, to);
            let end = time(s.after).unwrap_or(to).clamp(start, to);
            Word {
                word: s.text.clone(),
                start,
                end,
            }
        })
        .collect();
    merge_punctuation(&mut out);
    out.retain(|w| !w.word.trim().is_empty());
    for w in &mut out {
        w.word = w.word.trim().to_string();
    }
    out
}

/// openai-whisper's `merge_punctuations`: an opening mark (a word of its own after a space)
/// joins the word after it, which keeps its times; a closing mark joins the word before it
/// unless that word ends in a space, and the word keeps its times.
fn merge_punctuation(words: &mut [Word]) {
    if words.len() < 2 {
        return;
    }
    let mut j = words.len() - 1;
    for i in (0..words.len() - 1).rev() {
        let prev = &words[i].word;
        if prev.starts_with(' ') && !prev.trim().is_empty() && PREPENDED.contains(prev.trim()) {
            let joined = format!("{}{}", words[i].word, words[j].word);
            words[j].word = joined;
            words[i].word.clear();
        } else {
            j = i;
        }
    }
    let mut i = 0;
    for j in 1..words.len() {
        let follow = &words[j].word;
        if !words[i].word.ends_with(' ') && !follow.is_empty() && APPENDED.contains(follow.as_str())
        {
            let joined = format!("{}{}", words[i].word, words[j].word);
            words[i].word = joined;
            words[j].word.clear();
        } else {
            i = j;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(text: &str, time: f32) -> Token {
        Token {
            id: 1,
            bytes: text.as_bytes().to_vec(),
            logprob: -0.1,
            time: Some(time),
        }
    }

    #[test]
    fn tokens_become_words_with_their_punctuation_and_times() {
        // " And so, my" "fellow" split as " fell" "ow"; "(" opens, "." closes.
        let t = vec![
            tok(" And", 0.0),
            tok(" so", 0.4),
            tok(",", 0.6),
            tok(" my", 0.7),
            tok(" fell", 1.0),
            tok("ow", 1.2),
            tok(" (", 1.5),
            tok("Americans", 1.6),
            tok(")", 2.2),
            tok(".", 2.3),
        ];
        let idx: Vec<usize> = (0..t.len()).collect();
        let w = words(&t, &idx, Some(2.5), 10.0, (10.0, 13.0));
        let got: Vec<(&str, f64, f64)> = w
            .iter()
            .map(|w| (w.word.as_str(), w.start, w.end))
            .collect();
        let want = [
            ("And", 10.0, 10.4),
            ("so,", 10.4, 10.6),
            ("my", 10.7, 11.0),
            ("fellow", 11.0, 11.5),
            ("(Americans).", 11.5, 12.2),
        ];
        for ((gw, gs, ge), (ww, ws, we)) in got.iter().zip(want) {
            assert_eq!(*gw, ww, "{got:?}");
            assert!((gs - ws).abs() < 1e-6 && (ge - we).abs() < 1e-6, "{got:?}");
        }
        assert_eq!(got.len(), want.len(), "{got:?}");
    }

    #[test]
    fn a_character_split_over_tokens_is_one_unit_and_times_stay_in_the_segment() {
        let e = "é".as_bytes();
        let mut t = vec![tok(" caf", 0.0), tok("", 0.3), tok(" ok", 9.0)];
        t[1].bytes = e[..1].to_vec();
        t.insert(
            2,
            Token {
                id: 2,
                bytes: e[1..].to_vec(),
                logprob: -0.1,
                time: Some(0.5),
            },
        );
        let idx: Vec<usize> = (0..t.len()).collect();
        let w = words(&t, &idx, None, 0.0, (0.0, 5.0));
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(w[0].word, "café");
        assert_eq!(
            (w[1].start, w[1].end),
            (5.0, 5.0),
            "clamped to the segment: {w:?}"
        );
    }

    #[test]
    fn bytes_that_never_make_a_character_end_their_unit_and_the_words_go_on() {
        // A three-byte character begun, then a two-byte one begun: no character ever forms.
        let mut t = vec![tok(" a", 0.0), tok("", 0.2), tok("", 0.3), tok(" b", 0.6)];
        t[1].bytes = vec![0xE4];
        t[2].bytes = vec![0xC3];
        let idx: Vec<usize> = (0..t.len()).collect();
        let w = words(&t, &idx, Some(0.9), 0.0, (0.0, 1.0));
        let got: Vec<&str> = w.iter().map(|w| w.word.as_str()).collect();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].starts_with('a') && got[1] == "b", "{got:?}");
        assert!(
            (w[1].start - 0.6).abs() < 1e-6 && (w[1].end - 0.9).abs() < 1e-6,
            "{w:?}"
        );
    }
}
