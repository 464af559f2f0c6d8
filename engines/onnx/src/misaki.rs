//! espeak-ng's IPA in the alphabet of Kokoro-family voices (speech request → phonemes, inside
//! `speech_open` for a Hibari voice). Those voices were trained on misaki's phonemes: one
//! letter per diphthong and affricate (`A` = eɪ, `I` = aɪ, `W` = aʊ, `Y` = ɔɪ, `O` = oʊ in
//! American English, `Q` = əʊ in British, `ʤ`, `ʧ`), `ᵊ` for a syllabic consonant's schwa,
//! `T` for the American flap, and no length marks in American English. espeak-ng is asked to
//! tie the letters of one phoneme with `^` ([`crate::espeak::TIE`]), so `a^ɪ` (one diphthong)
//! and `aɪ` (two vowels) stay apart, and each tied phoneme maps as a whole.

/// Tied phonemes and single letters, whatever the accent: longest first.
const COMMON: &[(&str, &str)] = &[
    ("a^ɪ", "I"),
    ("a^ʊ", "W"),
    ("e^ɪ", "A"),
    ("ɔ^ɪ", "Y"),
    ("d^ʒ", "ʤ"),
    ("t^ʃ", "ʧ"),
    ("ə^l", "ᵊl"),
    // Syllabic n (n + U+0329) and the glottal stop before it ("button").
    ("ʔn\u{329}", "tᵊn"),
    ("n\u{329}", "ᵊn"),
    ("r", "ɹ"),
    ("x", "k"),
    ("ç", "k"),
    ("ɬ", "l"),
    ("ʔ", "t"),
    ("ʲ", ""),
    ("ᵻ", "ɪ"),
];

/// American English: `O`, r-coloured vowels spelled out, the flap, no length.
const AMERICAN: &[(&str, &str)] = &[
    ("o^ʊ", "O"),
    ("ə^ʊ", "O"),
    ("ɜːɹ", "ɜɹ"),
    ("ɜː", "ɜɹ"),
    ("ɚ", "əɹ"),
    ("ɾ", "T"),
    ("ː", ""),
];

/// British English: `Q`, centring diphthongs as misaki writes them, lengths kept.
const BRITISH: &[(&str, &str)] = &[
    ("ə^ʊ", "Q"),
    ("o^ʊ", "Q"),
    ("e^ə", "ɛː"),
    ("ɪ^ə", "ɪə"),
    ("ʊ^ə", "ʊə"),
    ("ɾ", "t"),
];

/// One clause of espeak-ng IPA (tied with `^`) in misaki's alphabet.
pub fn from_espeak(ipa: &str, british: bool) -> String {
    let accent = if british { BRITISH } else { AMERICAN };
    let mut out = String::with_capacity(ipa.len());
    let mut rest = ipa;
    'next: while let Some(c) = rest.chars().next() {
        for table in [accent, COMMON] {
            for (from, to) in table {
                if let Some(after) = rest.strip_prefix(from) {
                    out.push_str(to);
                    rest = after;
                    continue 'next;
                }
            }
        }
        // A tie left over joins letters that are each fine alone (`ɑː^ɹ`).
        if c != '^' {
            out.push(c);
        }
        rest = &rest[c.len_utf8()..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::from_espeak;

    #[test]
    fn american_english_as_kokoro_voices_read_it() {
        // espeak-ng 1.52 en-us, tied, and what the voice's own phonemiser writes for the
        // same words (stress placement aside).
        for (ipa, want) in [
            (
                "ðə kwˈɪk bɹˈa^ʊn fˈɑːks d^ʒˈʌmps ˌo^ʊvɚ ðə lˈe^ɪzi dˈɑːɡ",
                "ðə kwˈɪk bɹˈWn fˈɑks ʤˈʌmps ˌOvəɹ ðə lˈAzi dˈɑɡ",
            ),
            (
                "həlˈo^ʊ wˈɜːld hˌa^ʊ ɑː^ɹ juː tədˈe^ɪ",
                "həlˈO wˈɜɹld hˌW ɑɹ ju tədˈA",
            ),
            ("sˈɜːvɚz ðə mˈɑːdə^l", "sˈɜɹvəɹz ðə mˈɑdᵊl"),
            ("ðə mˈiːɾɪŋ stˈɑː^ɹts", "ðə mˈiTɪŋ stˈɑɹts"),
            ("ɛndpˈɔ^ɪnt wɪt^ʃˈɛvɚ", "ɛndpˈYnt wɪʧˈɛvəɹ"),
            ("bˈʌʔn\u{329}", "bˈʌtᵊn"),
            ("ɹᵻkwˈɛsts", "ɹɪkwˈɛsts"),
        ] {
            assert_eq!(from_espeak(ipa, false), want, "{ipa}");
        }
    }

    #[test]
    fn british_english_keeps_length_and_writes_q() {
        assert_eq!(
            from_espeak("həlˈə^ʊ wˈɜːld ðˈe^ə", true),
            "həlˈQ wˈɜːld ðˈɛː"
        );
    }
}
