//! Node, speech recognition's answer (after the scheduler's tokens, before the HTTP reply of
//! `/v1/audio/transcriptions`): each window's tokens read into segments by Whisper's timestamp
//! tokens, and where the next window starts (`read_window`, openai-whisper's long-form rule);
//! the segments written as OpenAI's `verbose_json` (with openai-whisper's `compression_ratio`),
//! `srt` or `vtt`.
//!
//! A window decoded with timestamps reads `<|0.00|> text <|2.40|><|2.40|> text <|5.00|>`.
//! Times are the window's start plus the token's (0.02 s steps), never past the audio's end.

use serde_json::{Value, json};

pub mod fallback;
mod words;
pub use words::Word;

/// One sampled token as the route collected it.
pub struct Token {
    pub id: i32,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// When it starts in the window's audio (seconds), for a window decoded with word times.
    pub time: Option<f32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    pub start: f64,
    pub end: f64,
    pub text: String,
    pub tokens: Vec<i32>,
    pub avg_logprob: f32,
    /// Each text token's bytes and log-probability (`include[]=logprobs`).
    pub logprobs: Vec<TokenLogprob>,
    /// Its words and their times, for a window decoded with word times.
    pub words: Vec<Word>,
    /// The probability that its window holds no speech (openai-whisper's `no_speech_prob`),
    /// when it was asked for.
    pub no_speech_prob: Option<f32>,
    /// The temperature its window was decoded at (`fallback.rs`).
    pub temperature: f32,
}

/// A text token as `include[]=logprobs` reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

impl TokenLogprob {
    /// The text tokens of `tokens` (special tokens, which have no bytes, left out).
    pub fn of<'a>(tokens: impl IntoIterator<Item = &'a Token>) -> Vec<TokenLogprob> {
        tokens
            .into_iter()
            .filter(|t| !t.bytes.is_empty())
            .map(|t| TokenLogprob {
                bytes: t.bytes.clone(),
                logprob: t.logprob,
            })
            .collect()
    }
}

/// OpenAI's `logprobs` of a transcription: `token` (the token's text; a token that ends inside
/// a UTF-8 character shows the replacement character, its `bytes` are exact), `logprob`,
/// `bytes`.
pub fn logprobs_json<'a>(items: impl IntoIterator<Item = &'a TokenLogprob>) -> Value {
    items
        .into_iter()
        .map(|t| {
            json!({
                "token": String::from_utf8_lossy(&t.bytes),
                "logprob": t.logprob,
                "bytes": t.bytes,
            })
        })
        .collect()
}

/// What a window's tokens say: its segments, and how far the next window starts after this
/// one's start (samples).
pub struct Read {
    pub segments: Vec<Segment>,
    pub advance: usize,
}

/// A window's tokens read as openai-whisper reads them. `first_timestamp` is the id of
/// `<|0.00|>` (the token after `<|notimestamps|>`), `None` when the model has none; the window
/// starts at `start` seconds and holds `len` samples at `rate`; `end` is the audio's end;
/// `tail` is the time after the last token (where the text ends), when tokens have times.
///
/// Two timestamps in a row cut segments. When the tokens end with a lone timestamp, every
/// segment is complete and the next window starts after this one; otherwise the text after the
/// last cut is unfinished (speech running past the window), is dropped, and the next window
/// starts at the last cut, so that text is decoded whole. Without a cut, the whole window is
/// one segment, up to its last timestamp if it has one.
///
/// When the tokens have times (word timestamps asked for), the window's words are timed and
/// adjusted together ([`words::window_words`]) and each segment's bounds move to its words';
/// `last_speech` is where the speech before this window ended, and afterwards where this
/// window's did.
pub fn read_window(
    (tokens, tail): (&[Token], Option<f32>),
    first_timestamp: Option<i32>,
    start: f64,
    (len, rate): (usize, u32),
    end: f64,
    last_speech: &mut f64,
) -> Read {
    let pos = |id: i32| first_timestamp.filter(|&f| id >= f).map(|f| id - f);
    let at = |p: i32| (start + f64::from(p) * 0.02).min(end);
    let is_ts = |t: &Token| pos(t.id).is_some();
    let n = tokens.len();
    let single_ending = n >= 2 && !is_ts(&tokens[n - 2]) && is_ts(&tokens[n - 1]);
    let mut cuts: Vec<usize> = (1..n)
        .filter(|&i| is_ts(&tokens[i - 1]) && is_ts(&tokens[i]))
        .collect();
    // Each segment's tokens and bounds.
    let mut parts: Vec<(std::ops::Range<usize>, f64, f64)> = Vec::new();
    let mut advance = if cuts.is_empty() {
        let stop = match tokens.iter().rev().find_map(|t| pos(t.id)) {
            Some(p) if p > 0 => at(p),
            _ => (start + len as f64 / f64::from(rate)).min(end),
        };
        parts.push((0..n, start, stop));
        len
    } else {
        if single_ending {
            cuts.push(n);
        }
        let mut last = 0;
        for &cut in &cuts {
            let slice = &tokens[last..cut];
            let from = pos(slice[0].id).map_or(start, at);
            let to = pos(slice[slice.len() - 1].id).map_or(from, at);
            parts.push((last..cut, from, to));
            last = cut;
        }
        if single_ending {
            len
        } else {
            // From the window's start to the last cut's time, in samples.
            let p = pos(tokens[last - 1].id).unwrap_or(0);
            ((f64::from(p) * 0.02 * f64::from(rate)).round() as usize).clamp(1, len)
        }
    };
    let mut bounds: Vec<words::WindowSegment> = parts
        .iter()
        .map(|(range, from, to)| words::WindowSegment {
            text: range.clone().filter(|&i| !is_ts(&tokens[i])).collect(),
            from: *from,
            to: *to,
        })
        .collect();
    let timed = tokens.iter().any(|t| t.time.is_some());
    let mut words = if timed {
        words::window_words(tokens, &mut bounds, tail, start, last_speech)
    } else {
        Vec::new()
    };
    words.resize(parts.len(), Vec::new());
    // With word times, a window whose text runs on past its last timestamp is read again from
    // where its last word ends (the last segment's end when no word has a time), on the
    // 10 ms grid, as openai-whisper does.
    if timed && !single_ending {
        let last_end = words
            .iter()
            .rev()
            .find_map(|w| w.last().map(|w| w.end))
            .or_else(|| bounds.last().map(|b| b.to));
        if let Some(e) = last_end.filter(|&e| e > start) {
            let at = (e * 100.0).round() / 100.0;
            advance = (((at - start) * f64::from(rate)).round() as usize).clamp(1, len);
        }
    }
    let segments = parts
        .into_iter()
        .zip(bounds)
        .zip(words)
        .filter_map(|(((range, _, _), b), words)| {
            segment(&tokens[range], b.from, b.to, words, &is_ts)
        })
        .collect();
    Read { segments, advance }
}

/// The segment of the text of `tokens`, from `from` to `to`, with its `words`; `None` when the
/// text is blank.
fn segment(
    tokens: &[Token],
    from: f64,
    to: f64,
    words: Vec<Word>,
    is_ts: &impl Fn(&Token) -> bool,
) -> Option<Segment> {
    let text: Vec<&Token> = tokens.iter().filter(|t| !is_ts(t)).collect();
    let bytes: Vec<u8> = text.iter().flat_map(|t| t.bytes.iter().copied()).collect();
    let s = String::from_utf8_lossy(&bytes).to_string();
    (!s.trim().is_empty()).then(|| Segment {
        start: from,
        end: to.max(from),
        text: s,
        tokens: text.iter().map(|t| t.id).collect(),
        avg_logprob: text.iter().map(|t| t.logprob).sum::<f32>() / text.len() as f32,
        logprobs: TokenLogprob::of(text.iter().copied()),
        words,
        no_speech_prob: None,
        temperature: 0.0,
    })
}

/// `hh:mm:ss,mmm` (SubRip, `sep` `,`) or `hh:mm:ss.mmm` (WebVTT, `sep` `.`).
fn clock(secs: f64, sep: char) -> String {
    let ms = (secs * 1000.0).round() as u64;
    format!(
        "{:02}:{:02}:{:02}{sep}{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

/// One subtitle cue: its times (`sep` as [`clock`] takes it) and its text.
fn cue(s: &Segment, sep: char) -> String {
    format!(
        "{} --> {}\n{}\n\n",
        clock(s.start, sep),
        clock(s.end, sep),
        s.text.trim()
    )
}

/// SubRip: numbered cues.
pub fn srt<'a>(segs: impl Iterator<Item = &'a Segment>) -> String {
    segs.enumerate()
        .map(|(i, s)| format!("{}\n{}", i + 1, cue(s, ',')))
        .collect()
}

/// WebVTT: the header, then the cues.
pub fn vtt<'a>(segs: impl Iterator<Item = &'a Segment>) -> String {
    let cues: String = segs.map(|s| cue(s, '.')).collect();
    format!("WEBVTT\n\n{cues}")
}

/// `verbose_json`'s `segments`. `seek` is the window's start in mel frames (10 ms), as
/// openai-whisper reports it.
pub fn verbose(segs: &[(usize, Segment)]) -> Vec<Value> {
    segs.iter()
        .enumerate()
        .map(|(i, (seek, s))| {
            // openai-whisper rates the text of the window a segment came from.
            let window: String = segs
                .iter()
                .filter(|(k, _)| k == seek)
                .map(|(_, s)| s.text.as_str())
                .collect();
            let mut v = json!({
                "id": i, "seek": seek, "start": s.start, "end": s.end, "text": s.text,
                "tokens": s.tokens, "temperature": thousandths(f64::from(s.temperature)),
                "avg_logprob": s.avg_logprob,
                "compression_ratio": compression_ratio(&window),
            });
            if let Some(p) = s.no_speech_prob {
                v["no_speech_prob"] = p.into();
            }
            v
        })
        .collect()
}

/// `verbose_json`'s `words`: every segment's words with their start and end.
pub fn words_json<'a>(segs: impl Iterator<Item = &'a Segment>) -> Value {
    segs.flat_map(|s| &s.words)
        .map(|w| json!({"word": w.word, "start": thousandths(w.start), "end": thousandths(w.end)}))
        .collect()
}

/// To three decimals: seconds to the millisecond (the times are 20 ms steps), a temperature
/// sampled at in f32 back to the decimal asked for; this drops float noise.
fn thousandths(secs: f64) -> f64 {
    (secs * 1000.0).round() / 1000.0
}

/// The text's bytes over its zlib-compressed bytes (level 6, zlib's default), as openai-whisper
/// computes it to catch a decoder that repeats itself (above 2.4 it retries). The deflate is
/// miniz_oxide's, whose output can differ from zlib's by a few bytes.
pub fn compression_ratio(text: &str) -> f64 {
    use std::io::Write;
    if text.is_empty() {
        return 0.0;
    }
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(6));
    let compressed = z
        .write_all(text.as_bytes())
        .and_then(|()| z.finish())
        .map_or(0, |c| c.len());
    if compressed == 0 {
        return 0.0;
    }
    text.len() as f64 / compressed as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_text_compresses_well() {
        let once = compression_ratio(" And so my fellow Americans, ask not.");
        let looped = compression_ratio(&" ask not".repeat(40));
        assert!(once < 1.2 && looped > 2.4, "{once} {looped}");
        assert_eq!(compression_ratio(""), 0.0);
    }

    const TS: i32 = 1000;
    const RATE: u32 = 16_000;
    const WINDOW: usize = 30 * 16_000;

    fn toks(ids: &[(i32, &str)]) -> Vec<Token> {
        ids.iter()
            .map(|&(id, s)| Token {
                id,
                bytes: s.as_bytes().to_vec(),
                logprob: -0.5,
                time: None,
            })
            .collect()
    }

    #[test]
    fn pairs_cut_segments_and_a_lone_last_timestamp_finishes_the_window() {
        // <|0.00|> Hello <|1.20|><|1.20|> world <|2.50|>, in a window starting at 30 s.
        let t = toks(&[
            (TS, ""),
            (5, " Hello"),
            (TS + 60, ""),
            (TS + 60, ""),
            (6, " world"),
            (TS + 125, ""),
        ]);
        let r = read_window((&t, None), Some(TS), 30.0, (WINDOW, RATE), 60.0, &mut 0.0);
        let s = &r.segments;
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].start, s[0].end, s[0].text.as_str()),
            (30.0, 31.2, " Hello")
        );
        assert_eq!(
            (s[1].start, s[1].end, s[1].text.as_str()),
            (31.2, 32.5, " world")
        );
        assert_eq!((s[1].tokens.clone(), r.advance), (vec![6], WINDOW));
        assert_eq!(
            srt(s.iter()),
            "1\n00:00:30,000 --> 00:00:31,200\nHello\n\n2\n00:00:31,200 --> 00:00:32,500\nworld\n\n"
        );
        assert!(vtt(s.iter()).starts_with("WEBVTT\n\n00:00:30.000 --> 00:00:31.200\nHello\n\n"));
    }

    #[test]
    fn unfinished_text_is_dropped_and_the_next_window_starts_at_the_last_cut() {
        // <|0.00|> one <|20.00|><|20.00|> two (cut off by the window's end)
        let t = toks(&[
            (TS, ""),
            (5, " one"),
            (TS + 1000, ""),
            (TS + 1000, ""),
            (6, " two"),
        ]);
        let r = read_window((&t, None), Some(TS), 0.0, (WINDOW, RATE), 45.0, &mut 0.0);
        assert_eq!(r.segments.len(), 1);
        assert_eq!((r.segments[0].end, r.advance), (20.0, 20 * 16_000));
    }

    #[test]
    fn with_word_times_an_unfinished_window_is_read_again_from_its_last_word() {
        // <|0.00|> one <|2.00|><|2.00|> two (cut off): the next window starts where "one"
        // ends (1.234 s on the 10 ms grid: 1.23 s), not at the cut (2 s).
        let mut t = toks(&[
            (TS, ""),
            (5, " one"),
            (TS + 100, ""),
            (TS + 100, ""),
            (6, " two"),
        ]);
        for (tok, time) in t.iter_mut().zip([0.0, 0.5, 1.234, 1.234, 1.5]) {
            tok.time = Some(time);
        }
        let mut last = 0.0;
        let r = read_window(
            (&t, Some(1.8)),
            Some(TS),
            0.0,
            (WINDOW, RATE),
            45.0,
            &mut last,
        );
        assert_eq!(r.segments.len(), 1);
        let w = &r.segments[0].words;
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(r.advance, (1.23 * f64::from(RATE)).round() as usize);
        // The segment took its word's bounds; the last speech is its end.
        assert!((r.segments[0].end - 1.234).abs() < 1e-6 && (last - 1.234).abs() < 1e-6);
    }

    #[test]
    fn without_a_cut_the_window_is_one_segment() {
        // Text after one timestamp: from the window's start to that time (openai-whisper's
        // reading); text after `<|0.00|>` alone: to the window's end, or the audio's.
        // A window of 7.5 s of audio.
        let short = |t: &[Token]| {
            let r = read_window(
                (t, None),
                Some(TS),
                0.0,
                (7 * 16_000 + 8000, RATE),
                100.0,
                &mut 0.0,
            );
            (r.segments[0].start, r.segments[0].end)
        };
        assert_eq!(
            short(&toks(&[(TS + 50, ""), (5, " cut"), (6, " off")])),
            (0.0, 1.0)
        );
        assert_eq!(
            short(&toks(&[(TS, ""), (5, " cut"), (6, " off")])),
            (0.0, 7.5)
        );
        // A text closed by one timestamp ends there.
        let t = toks(&[(5, " x"), (TS + 150, "")]);
        let r = read_window((&t, None), Some(TS), 30.0, (WINDOW, RATE), 100.0, &mut 0.0);
        assert_eq!(
            (r.segments[0].start, r.segments[0].end, r.advance),
            (30.0, 33.0, WINDOW)
        );
        // No timestamps at all (a model without them, or `<|notimestamps|>`).
        let plain = read_window(
            (&toks(&[(5, " no"), (6, " stamps")]), None),
            None,
            30.0,
            (WINDOW, RATE),
            41.0,
            &mut 0.0,
        );
        assert_eq!(
            (plain.segments[0].start, plain.segments[0].end),
            (30.0, 41.0)
        );
        // No text: no segment.
        let r = read_window(
            (&toks(&[(TS, ""), (TS + 5, "")]), None),
            Some(TS),
            0.0,
            (WINDOW, RATE),
            3.0,
            &mut 0.0,
        );
        assert!(r.segments.is_empty() && r.advance > 0);
        assert_eq!(clock(3723.4567, ','), "01:02:03,457");
    }
}
