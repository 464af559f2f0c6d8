//! Output text (scheduler, after the engine step, before SSE): incremental UTF-8 and stop sequences.
//!
//! Tokens arrive one at a time as raw bytes. [`Utf8Stream`] only ever
//! releases whole UTF-8 characters, so a multi-byte character split across
//! tokens never straddles two SSE events. [`StopMatcher`] holds back the
//! shortest tail that could still grow into a stop sequence, so stop strings
//! are matched across token boundaries and never emitted.

/// Accumulates bytes and releases the longest complete UTF-8 prefix.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add bytes; return the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes that can never be valid: replace them and go on.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// End of stream: whatever is left is invalid and becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Outcome of feeding text to a [`StopMatcher`].
#[derive(Debug, PartialEq, Eq)]
pub enum StopScan {
    /// Text safe to emit now (may be empty).
    Emit(String),
    /// A stop sequence matched: emit this text, then finish.
    Stopped(String),
}

/// Matches stop sequences across token boundaries.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopScan {
        if self.stops.is_empty() {
            return StopScan::Emit(text.to_string());
        }
        self.held.push_str(text);
        // The earliest match wins, as with llama-server and OpenAI.
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            return StopScan::Stopped(out);
        }
        let keep = self.longest_stop_prefix_suffix();
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopScan::Emit(out)
    }

    /// Release held text when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > best && self.held.ends_with(&s[..k]) {
                    best = k;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multibyte_character_split_across_tokens_comes_out_whole() {
        let mut u = Utf8Stream::default();
        let euro = "€".as_bytes(); // e2 82 ac
        assert_eq!(u.push(&euro[..1]), "");
        assert_eq!(u.push(&euro[1..2]), "");
        assert_eq!(u.push(&[euro[2], b'!']), "€!");
        assert_eq!(u.push(&[0xff, b'a']), "\u{fffd}a");
        assert_eq!(u.push(&[0xe2]), "");
        assert_eq!(u.finish(), "\u{fffd}");
    }

    #[test]
    fn stop_sequences_match_across_boundaries_and_are_not_emitted() {
        let mut m = StopMatcher::new(vec!["\n\nQ:".into(), "END".into()]);
        assert_eq!(m.push("Paris."), StopScan::Emit("Paris.".into()));
        assert_eq!(m.push("\n"), StopScan::Emit(String::new()));
        assert_eq!(m.push("\nQ"), StopScan::Emit(String::new()));
        assert_eq!(m.push(": next"), StopScan::Stopped(String::new()));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abcE"), StopScan::Emit("abc".into()));
        assert_eq!(m.push("x"), StopScan::Emit("Ex".into()));
        assert_eq!(m.push("yEN"), StopScan::Emit("y".into()));
        assert_eq!(m.finish(), "EN");
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("caf"), StopScan::Emit("caf".into()));
        assert_eq!(m.push("é"), StopScan::Emit(String::new()));
        assert_eq!(m.push("!tail"), StopScan::Stopped(String::new()));
    }

    #[test]
    fn the_earliest_stop_wins() {
        let mut m = StopMatcher::new(vec!["c".into(), "ab".into()]);
        assert_eq!(m.push("xabc"), StopScan::Stopped("x".into()));
    }
}
