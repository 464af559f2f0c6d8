//! Node, speech recognition's word timestamps (after the scheduler's tokens and their times,
//! ABI 1.11 `seq_token_times`; before `verbose_json`): a segment's text tokens grouped into
//! words as openai-whisper groups them (a word starts at a token that starts with a space or
//! is punctuation), each word timed from its tokens (it starts where its first token starts
//! and ends where the token after its last one starts), then the window's words adjusted as
//! openai-whisper's `add_word_timestamps` adjusts them ([`window_words`]): overlong words at
//! sentence marks and after pauses cut to twice the median word, the segment's own bounds
//! preferred where its first or last word runs far past them, and punctuation merged into the
//! word it belongs to.

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

/// Sentence marks: a word that is one of these, or follows one, may not run longer than twice
/// the median word.
const SENTENCE_ENDS: [&str; 6] = [".", "。", "!", "！", "?", "？"];
/// The median word's duration counts as at most this (seconds).
const MEDIAN_CAP: f64 = 0.7;

/// One window's segments for [`window_words`]: each segment's text tokens (indices into the
/// window's tokens, in order) and its bounds (seconds in the audio), which the words may move.
pub struct WindowSegment {
    pub text: Vec<usize>,
    pub from: f64,
    pub to: f64,
}

/// The words of each segment of one window (the window's `tokens`, timed from its start,
/// `offset` in the audio; `tail` the time after its last token), adjusted as openai-whisper
/// adjusts them; each segment's bounds move to its words' unless a word runs far past them.
/// `last_speech` is where the speech before this window ended (0 at the audio's start), and
/// where this window's ends afterwards.
pub fn window_words(
    tokens: &[Token],
    segments: &mut [WindowSegment],
    tail: Option<f32>,
    offset: f64,
    last_speech: &mut f64,
) -> Vec<Vec<Word>> {
    let mut all: Vec<Vec<Word>> = segments
        .iter()
        .map(|s| aligned(tokens, &s.text, tail, offset, (s.from, s.to)))
        .collect();
    let mut durations: Vec<f64> = all
        .iter()
        .flatten()
        .map(|w| w.end - w.start)
        .filter(|&d| d != 0.0)
        .collect();
    let median = median(&mut durations).min(MEDIAN_CAP);
    let max = 2.0 * median;
    if !durations.is_empty() {
        // Across the window, as one list: a word at a sentence mark ends by `max`; a word
        // after one starts no earlier than `max` before its end.
        let mut flat: Vec<&mut Word> = all.iter_mut().flatten().collect();
        for i in 1..flat.len() {
            if flat[i].end - flat[i].start > max {
                if SENTENCE_ENDS.contains(&flat[i].word.as_str()) {
                    flat[i].end = flat[i].start + max;
                } else if SENTENCE_ENDS.contains(&flat[i - 1].word.as_str()) {
                    flat[i].start = flat[i].end - max;
                }
            }
        }
    }
    for (seg, words) in segments.iter_mut().zip(&mut all) {
        merge_punctuation(words);
        words.retain(|w| !w.word.trim().is_empty());
        for w in words.iter_mut() {
            w.word = w.word.trim().to_string();
        }
        let Some(first) = words.first() else {
            continue;
        };
        // After a pause, the first word (and the second) may not stretch back into it.
        let second = words.get(1);
        if first.end - *last_speech > 4.0 * median
            && (first.end - first.start > max
                || second.is_some_and(|s| s.end - first.start > 2.0 * max))
        {
            if words.len() > 1 && words[1].end - words[1].start > max {
                let boundary = (words[1].end / 2.0).max(words[1].end - max);
                words[0].end = boundary;
                words[1].start = boundary;
            }
            words[0].start = (words[0].end - max).max(0.0);
        }
        // The segment's start, where the first word starts half a second or more before it.
        let w = &mut words[0];
        if seg.from < w.end && seg.from - 0.5 > w.start {
            w.start = (w.end - median).min(seg.from).max(0.0);
        } else {
            seg.from = w.start;
        }
        // The segment's end, where the last word ends half a second or more after it.
        let w = words.last_mut().expect("not empty");
        if seg.to > w.start && seg.to + 0.5 < w.end {
            w.end = (w.start + median).max(seg.to);
        } else {
            seg.to = w.end;
        }
        *last_speech = seg.to;
    }
    all
}

/// numpy's median (the mean of the middle two for an even count); 0 for none.
fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// The words of the text tokens `text` (indices into the window's `tokens`, in order) as
/// aligned, punctuation still words of their own and spaces kept, timed by the tokens' times
/// (seconds from the window's start, `offset` in the audio); `tail` is the time after the
/// window's last token. A token without a time takes the segment's bound, `from` or `to`.
fn aligned(
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
    spans
        .iter()
        .map(|s| {
            let start = time(s.first).unwrap_or(from);
            let end = time(s.after).unwrap_or(to).max(start);
            Word {
                word: s.text.clone(),
                start,
                end,
            }
        })
        .collect()
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

    /// One segment's words, `tokens` all text, in a window at `offset`.
    fn one(
        t: &[Token],
        tail: Option<f32>,
        offset: f64,
        bounds: (f64, f64),
    ) -> (Vec<Word>, (f64, f64)) {
        let mut segs = [WindowSegment {
            text: (0..t.len()).collect(),
            from: bounds.0,
            to: bounds.1,
        }];
        let mut w = window_words(t, &mut segs, tail, offset, &mut 0.0);
        (w.remove(0), (segs[0].from, segs[0].to))
    }

    /// Within float rounding (token times are f32).
    fn near(got: &[f64], want: &[f64]) {
        assert!(
            got.len() == want.len() && got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6),
            "{got:?} vs {want:?}"
        );
    }

    fn close(got: &[Word], want: &[(&str, f64, f64)]) {
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (g, (w, s, e)) in got.iter().zip(want) {
            assert_eq!(g.word, *w, "{got:?}");
            assert!(
                (g.start - s).abs() < 1e-6 && (g.end - e).abs() < 1e-6,
                "{got:?}"
            );
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
        let (w, bounds) = one(&t, Some(2.5), 10.0, (10.0, 13.0));
        close(
            &w,
            &[
                ("And", 10.0, 10.4),
                ("so,", 10.4, 10.6),
                ("my", 10.7, 11.0),
                ("fellow", 11.0, 11.5),
                ("(Americans).", 11.5, 12.2),
            ],
        );
        // The segment ends with its last word (12.2 s), not at its timestamp (13 s).
        near(&[bounds.0, bounds.1], &[10.0, 12.2]);
    }

    #[test]
    fn a_long_word_after_a_sentence_mark_starts_twice_the_median_before_its_end() {
        // " Three" aligned from the end of "two." across a pause: median word 0.3 s.
        let t = vec![
            tok(" One", 0.0),
            tok(" two", 0.3),
            tok(".", 0.6),
            tok(" Three", 0.7),
            tok(" four", 3.3),
        ];
        let (w, _) = one(&t, Some(3.6), 0.0, (0.0, 3.6));
        close(
            &w,
            &[
                ("One", 0.0, 0.3),
                ("two.", 0.3, 0.6),
                ("Three", 2.7, 3.3),
                ("four", 3.3, 3.6),
            ],
        );
    }

    #[test]
    fn after_a_pause_the_first_word_does_not_stretch_back_into_it() {
        // Nothing spoken before; " Hi" aligned 4.6 s long, the others 0.3 s: it keeps twice
        // the median (0.6 s) before its end, and the segment starts there.
        let t = vec![tok(" Hi", 1.0), tok(" there", 5.6), tok(" friend", 5.9)];
        let mut segs = [WindowSegment {
            text: vec![0, 1, 2],
            from: 5.0,
            to: 8.0,
        }];
        let mut last = 0.0;
        let w = window_words(&t, &mut segs, Some(6.2), 0.0, &mut last);
        close(
            &w[0],
            &[("Hi", 5.0, 5.6), ("there", 5.6, 5.9), ("friend", 5.9, 6.2)],
        );
        near(&[segs[0].from, segs[0].to, last], &[5.0, 6.2, 6.2]);
    }

    #[test]
    fn the_segments_bounds_win_over_words_far_past_them() {
        // Speech just before (2.5 s): no pause. The first word starts 1 s before the
        // segment, the last ends 1 s after it: each is cut back to the bound, keeping at least
        // the median word (capped at 0.7 s).
        let t = vec![tok(" A", 2.0), tok(" b", 3.2), tok(" c", 3.5)];
        let mut segs = [WindowSegment {
            text: vec![0, 1, 2],
            from: 3.0,
            to: 4.0,
        }];
        let mut last = 2.5;
        let w = window_words(&t, &mut segs, Some(5.0), 0.0, &mut last);
        close(&w[0], &[("A", 2.5, 3.2), ("b", 3.2, 3.5), ("c", 3.5, 4.2)]);
        near(&[segs[0].from, segs[0].to, last], &[3.0, 4.0, 4.0]);
        assert_eq!(median(&mut [3.0, 1.0, 2.0, 10.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn a_character_split_over_tokens_is_one_unit() {
        let e = "é".as_bytes();
        let mut t = vec![tok(" caf", 0.0), tok("", 0.3), tok(" ok", 0.8)];
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
        let (w, _) = one(&t, Some(1.0), 0.0, (0.0, 1.0));
        close(&w, &[("café", 0.0, 0.8), ("ok", 0.8, 1.0)]);
    }

    #[test]
    fn bytes_that_never_make_a_character_end_their_unit_and_the_words_go_on() {
        // A three-byte character begun, then a two-byte one begun: no character ever forms.
        let mut t = vec![tok(" a", 0.0), tok("", 0.2), tok("", 0.3), tok(" b", 0.6)];
        t[1].bytes = vec![0xE4];
        t[2].bytes = vec![0xC3];
        let (w, _) = one(&t, Some(0.9), 0.0, (0.0, 1.0));
        let got: Vec<&str> = w.iter().map(|w| w.word.as_str()).collect();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].starts_with('a') && got[1] == "b", "{got:?}");
        assert!(
            (w[1].start - 0.6).abs() < 1e-6 && (w[1].end - 0.9).abs() < 1e-6,
            "{w:?}"
        );
    }
}
