//! Constrained decoding, right after the grammar's mask (scheduler step): the bound on the
//! digits after a number's decimal point that a strict schema asks for
//! (`ConstraintRequest::fraction_digits`).
//!
//! JSON Schema has no way to bound them (`multipleOf` still admits trailing zeros) and
//! llguidance's number grammar admits a fraction of any length, so a small model can spend its
//! whole budget on one number. The bound works on the mask instead: while the output is in a
//! number's fraction with `k` digits, no token may start with more than `limit - k` digits.
//! It applies only to JSON outputs, where a `.` outside a string is always a decimal point.

use std::sync::Arc;

use llguidance::toktrie::TokEnv;

/// The tokens whose text starts with ASCII digits, and how many digits: built once per
/// vocabulary (a few thousand tokens at most, so a restricted step walks only these).
#[derive(Debug)]
pub struct DigitTokens(Vec<(u32, u8)>);

impl DigitTokens {
    /// From every token's bytes, indexed by token id.
    pub fn new(words: &[Vec<u8>]) -> Self {
        let lead = |w: &Vec<u8>| w.iter().take_while(|b| b.is_ascii_digit()).count();
        Self(
            words
                .iter()
                .enumerate()
                .filter_map(|(t, w)| match lead(w) {
                    0 => None,
                    n => Some((t as u32, n.min(u8::MAX as usize) as u8)),
                })
                .collect(),
        )
    }
}

/// Where a JSON output stands for the bound: inside a string (just after a backslash or not),
/// or in a number's fraction with this many digits so far.
#[derive(Debug, Default)]
struct Lexer {
    in_string: bool,
    escaped: bool,
    fraction: Option<u32>,
}

impl Lexer {
    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            self.fraction = match (b, self.fraction) {
                (b'0'..=b'9', Some(k)) => Some(k + 1),
                (b'.', _) => Some(0),
                _ => None,
            };
            self.in_string = b == b'"';
        }
    }
}

/// One request's bound on fraction digits: the limit, the vocabulary's digit tokens and the
/// token texts (to follow the output).
pub struct FractionBound {
    limit: u32,
    tokens: Arc<DigitTokens>,
    env: TokEnv,
    lexer: Lexer,
    cleared: Vec<u32>,
}

impl FractionBound {
    pub fn new(limit: u32, tokens: Arc<DigitTokens>, env: TokEnv) -> Self {
        Self {
            limit,
            tokens,
            env,
            lexer: Lexer::default(),
            cleared: Vec::new(),
        }
    }

    /// Clear from `mask` (one bit per token, llguidance's layout) every token that would take
    /// the fraction past the limit. Where that leaves nothing, the grammar itself needs more
    /// digits (a `minimum` finer than the limit), and the digits stay allowed.
    pub fn restrict(&mut self, mask: &mut [u32]) {
        restrict(
            &self.lexer,
            self.limit,
            &self.tokens,
            mask,
            &mut self.cleared,
        );
    }

    /// Follow the output past a sampled token.
    pub fn consume(&mut self, token: u32) {
        self.lexer.feed(self.env.tok_trie().token(token));
    }
}

fn restrict(
    lexer: &Lexer,
    limit: u32,
    tokens: &DigitTokens,
    mask: &mut [u32],
    cleared: &mut Vec<u32>,
) {
    let Some(k) = lexer.fraction else {
        return;
    };
    let room = limit.saturating_sub(k);
    cleared.clear();
    for &(t, lead) in &tokens.0 {
        if u32::from(lead) <= room {
            continue;
        }
        let bit = 1u32 << (t % 32);
        if let Some(word) = mask.get_mut((t / 32) as usize)
            && *word & bit != 0
        {
            *word &= !bit;
            cleared.push(t);
        }
    }
    if !cleared.is_empty() && mask.iter().all(|&w| w == 0) {
        for &t in cleared.iter() {
            mask[(t / 32) as usize] |= 1 << (t % 32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lexed(text: &str) -> Lexer {
        let mut l = Lexer::default();
        l.feed(text.as_bytes());
        l
    }

    #[test]
    fn the_lexer_counts_fraction_digits_outside_strings_only() {
        assert_eq!(lexed(r#"{"x": 1.25"#).fraction, Some(2));
        assert_eq!(lexed(r#"{"x": 1."#).fraction, Some(0));
        assert_eq!(lexed(r#"{"x": 1.25, "#).fraction, None);
        assert_eq!(lexed(r#"{"x": 125"#).fraction, None, "an integer part");
        assert_eq!(lexed(r#"{"v": "1.2345"#).fraction, None, "in a string");
        assert_eq!(
            lexed(r#"{"v": "a\"1.23"#).fraction,
            None,
            "an escaped quote"
        );
        assert_eq!(
            lexed(r#"{"v": "a\\", "x": 0.5"#).fraction,
            Some(1),
            "an escaped backslash"
        );
        let mut l = lexed(r#"{"x": 3.1"#);
        l.feed(b"41");
        assert_eq!(l.fraction, Some(3), "across tokens");
    }

    fn mask_of(tokens: &[u32]) -> Vec<u32> {
        let mut m = vec![0u32; 2];
        for &t in tokens {
            m[(t / 32) as usize] |= 1 << (t % 32);
        }
        m
    }

    fn allowed(mask: &[u32]) -> Vec<u32> {
        (0..64)
            .filter(|t| mask[(t / 32) as usize] & (1 << (t % 32)) != 0)
            .collect()
    }

    #[test]
    fn tokens_that_would_pass_the_limit_are_cleared() {
        // Token 1 "7", token 2 "42", token 3 "123,", token 40 "}", token 41 ", ".
        let mut words = vec![Vec::new(); 64];
        words[1] = b"7".to_vec();
        words[2] = b"42".to_vec();
        words[3] = b"123,".to_vec();
        words[40] = b"}".to_vec();
        words[41] = b", ".to_vec();
        let tokens = DigitTokens::new(&words);
        assert_eq!(tokens.0, vec![(1, 1), (2, 2), (3, 3)]);
        let all = [1, 2, 3, 40, 41];
        let mut cleared = Vec::new();
        let check = |text: &str, cleared: &mut Vec<u32>| {
            let mut m = mask_of(&all);
            restrict(&lexed(text), 4, &tokens, &mut m, cleared);
            allowed(&m)
        };
        assert_eq!(check(r#"{"x": 1"#, &mut cleared), all, "not in a fraction");
        assert_eq!(check(r#"{"x": 1."#, &mut cleared), all, "room for 4");
        assert_eq!(check(r#"{"x": 1.5"#, &mut cleared), all, "room for 3");
        assert_eq!(check(r#"{"x": 1.55"#, &mut cleared), vec![1, 2, 40, 41]);
        assert_eq!(check(r#"{"x": 1.555"#, &mut cleared), vec![1, 40, 41]);
        assert_eq!(check(r#"{"x": 1.5555"#, &mut cleared), vec![40, 41]);
        assert_eq!(
            check(r#"{"x": 1.55555"#, &mut cleared),
            vec![40, 41],
            "past it"
        );
        // Where only digits may follow, the grammar needs them: kept.
        let mut m = mask_of(&[1, 2]);
        restrict(&lexed(r#"{"x": 1.5555"#), 4, &tokens, &mut m, &mut cleared);
        assert_eq!(allowed(&m), vec![1, 2]);
    }
}
