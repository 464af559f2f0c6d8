//! A Piper voice (speech request → audio): its config (`<voice>.onnx.json`), text to phoneme
//! ids sentence by sentence as Piper does it, and one ONNX Runtime run per sentence.
//!
//! Text → ids: espeak-ng phonemes per clause ([`crate::espeak`]), language-switch flags
//! `(en)` dropped, the clause's punctuation kept (followed by a space after `,` `:` `;`),
//! clauses joined into sentences, each sentence's phonemes decomposed (NFD) into code points
//! and mapped through the voice's `phoneme_id_map` as `^ _ p _ p _ … $` (unknown phonemes are
//! skipped). Ids → audio: the graph's `input`, `input_lengths`, `scales` (noise, length,
//! noise width) and, for a multi-speaker voice, `sid`; the output is peak-normalised per
//! sentence and clipped to [-1, 1], as Piper's own synthesis does.

use std::collections::HashMap;
use std::path::Path;

use gantry_engine_abi::EngineError;
use ort::session::Session;
use ort::value::Tensor;
use unicode_normalization::UnicodeNormalization;

/// What a voice's config says.
#[derive(Clone, Debug, PartialEq)]
pub struct VoiceConfig {
    pub sample_rate: u32,
    /// espeak-ng voice of the phonemes (`en-us`).
    pub espeak_voice: String,
    pub noise_scale: f32,
    pub length_scale: f32,
    pub noise_w: f32,
    pub phoneme_ids: HashMap<char, Vec<i64>>,
    /// Speaker names in id order; one name (the dataset's) for a single-speaker voice.
    pub speakers: Vec<String>,
    /// The graph takes a speaker id (`sid`).
    pub multi_speaker: bool,
}

fn field<'a>(v: &'a serde_json::Value, path: &[&str]) -> Option<&'a serde_json::Value> {
    path.iter().try_fold(v, |v, k| v.get(k))
}

impl VoiceConfig {
    pub fn parse(bytes: &[u8]) -> Result<VoiceConfig, String> {
        let v: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
        let num = |path: &[&str], default: f64| -> Result<f64, String> {
            match field(&v, path) {
                None => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| format!("`{}` is not a number", path.join("."))),
            }
        };
        let sample_rate = num(&["audio", "sample_rate"], 0.0)? as u32;
        if !(8_000..=48_000).contains(&sample_rate) {
            return Err(format!(
                "`audio.sample_rate` must be within [8000, 48000], got {sample_rate}"
            ));
        }
        let phoneme_type = field(&v, &["phoneme_type"]).and_then(|t| t.as_str());
        if phoneme_type.is_some_and(|t| t != "espeak") {
            return Err(format!(
                "`phoneme_type` {:?} is not served (only espeak phonemes are)",
                phoneme_type.unwrap_or_default()
            ));
        }
        let espeak_voice = field(&v, &["espeak", "voice"])
            .and_then(|x| x.as_str())
            .ok_or("`espeak.voice` is missing")?
            .to_string();
        let map = field(&v, &["phoneme_id_map"])
            .and_then(|m| m.as_object())
            .ok_or("`phoneme_id_map` is missing")?;
        let mut phoneme_ids = HashMap::new();
        for (k, ids) in map {
            let mut chars = k.chars();
            let (Some(c), None) = (chars.next(), chars.next()) else {
                return Err(format!("`phoneme_id_map` key {k:?} is not one code point"));
            };
            let ids = ids
                .as_array()
                .ok_or_else(|| format!("`phoneme_id_map.{k}` is not a list"))?
                .iter()
                .map(|i| {
                    i.as_i64()
                        .ok_or_else(|| format!("`phoneme_id_map.{k}` holds a non-integer"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            phoneme_ids.insert(c, ids);
        }
        for special in ['^', '_', '$'] {
            if !phoneme_ids.contains_key(&special) {
                return Err(format!("`phoneme_id_map` has no {special:?}"));
            }
        }
        let num_speakers = num(&["num_speakers"], 1.0)? as usize;
        let multi_speaker = num_speakers > 1;
        let speakers = if multi_speaker {
            let map = field(&v, &["speaker_id_map"])
                .and_then(|m| m.as_object())
                .ok_or("`speaker_id_map` is missing for a multi-speaker voice")?;
            let mut by_id: Vec<(i64, String)> = map
                .iter()
                .filter_map(|(name, id)| id.as_i64().map(|id| (id, name.clone())))
                .collect();
            by_id.sort();
            by_id.into_iter().map(|(_, n)| n).collect()
        } else {
            let name = field(&v, &["dataset"])
                .and_then(|x| x.as_str())
                .filter(|s| !s.is_empty())
                .unwrap_or("default");
            vec![name.to_string()]
        };
        Ok(VoiceConfig {
            sample_rate,
            espeak_voice,
            noise_scale: num(&["inference", "noise_scale"], 0.667)? as f32,
            length_scale: num(&["inference", "length_scale"], 1.0)? as f32,
            noise_w: num(&["inference", "noise_w"], 0.8)? as f32,
            phoneme_ids,
            speakers,
            multi_speaker,
        })
    }

    pub fn read(path: &Path) -> Result<VoiceConfig, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// One sentence's phonemes as the graph's ids.
    pub fn ids(&self, phonemes: &str) -> Vec<i64> {
        let id = |c: char| self.phoneme_ids.get(&c).map(Vec::as_slice).unwrap_or(&[]);
        let mut out = Vec::with_capacity(2 * phonemes.len() + 3);
        out.extend_from_slice(id('^'));
        out.extend_from_slice(id('_'));
        for c in phonemes.nfd() {
            if let Some(ids) = self.phoneme_ids.get(&c) {
                out.extend_from_slice(ids);
                out.extend_from_slice(id('_'));
            }
        }
        out.extend_from_slice(id('$'));
        out
    }
}

/// Drop espeak-ng's language-switch flags: `(en)` … `(fr)` around foreign words.
pub(crate) fn strip_language_flags(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(open) = rest.find('(') {
        match rest[open..].find(')') {
            Some(close) if close > 1 => {
                out.push_str(&rest[..open]);
                rest = &rest[open + close + 1..];
            }
            _ => {
                out.push_str(&rest[..=open]);
                rest = &rest[open + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Clauses joined into sentences (Piper's grouping): each sentence's phoneme string.
pub fn sentences(clauses: &[crate::espeak::Clause]) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in clauses {
        cur.push_str(&strip_language_flags(&c.phonemes));
        if let Some(t) = c.terminator {
            cur.push(t);
            if matches!(t, ',' | ':' | ';') {
                cur.push(' ');
            }
        }
        if c.ends_sentence {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out.retain(|s| !s.trim().is_empty());
    out
}

/// Run the graph on one sentence's ids.
pub fn synthesize(
    session: &mut Session,
    ids: &[i64],
    scales: [f32; 3],
    speaker: Option<i64>,
) -> Result<Vec<f32>, EngineError> {
    let ort_err = |e: ort::Error| EngineError::internal(format!("ONNX Runtime: {e}"));
    let input = Tensor::from_array(([1usize, ids.len()], ids.to_vec())).map_err(ort_err)?;
    let lengths = Tensor::from_array(([1usize], vec![ids.len() as i64])).map_err(ort_err)?;
    let scales = Tensor::from_array(([3usize], scales.to_vec())).map_err(ort_err)?;
    let outputs = match speaker {
        Some(sid) => {
            let sid = Tensor::from_array(([1usize], vec![sid])).map_err(ort_err)?;
            session.run(ort::inputs![
                "input" => input,
                "input_lengths" => lengths,
                "scales" => scales,
                "sid" => sid,
            ])
        }
        None => session.run(ort::inputs![
            "input" => input,
            "input_lengths" => lengths,
            "scales" => scales,
        ]),
    }
    .map_err(ort_err)?;
    let (_, audio) = outputs[0].try_extract_tensor::<f32>().map_err(ort_err)?;
    Ok(normalise(audio))
}

/// Peak-normalised to 1 and clipped to [-1, 1] (Piper's `normalize_audio`); silence stays
/// silence.
pub fn normalise(audio: &[f32]) -> Vec<f32> {
    let peak = audio.iter().fold(0f32, |m, x| m.max(x.abs()));
    if peak < 1e-8 {
        return vec![0.0; audio.len()];
    }
    audio.iter().map(|x| (x / peak).clamp(-1.0, 1.0)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::espeak::Clause;

    fn config() -> VoiceConfig {
        VoiceConfig::parse(
            r#"{"audio": {"sample_rate": 22050}, "espeak": {"voice": "en-us"},
                "inference": {"noise_scale": 0.5, "length_scale": 1.1, "noise_w": 0.7},
                "phoneme_type": "espeak", "num_speakers": 1, "dataset": "joe",
                "phoneme_id_map": {"_": [0], "^": [1], "$": [2], " ": [3], ",": [8], ".": [10],
                                   "a": [14], "b": [15], "ˈ": [120], "\u0303": [141]}}"#
                .as_bytes(),
        )
        .expect("valid")
    }

    #[test]
    fn the_config_gives_rate_voice_scales_and_speakers() {
        let c = config();
        assert_eq!(c.sample_rate, 22050);
        assert_eq!(c.espeak_voice, "en-us");
        assert_eq!((c.noise_scale, c.length_scale, c.noise_w), (0.5, 1.1, 0.7));
        assert_eq!(c.speakers, ["joe"]);
        assert!(!c.multi_speaker);
        let e = VoiceConfig::parse(br#"{"audio": {"sample_rate": 22050}}"#).expect_err("refused");
        assert!(e.contains("espeak.voice"), "{e}");
        let e = VoiceConfig::parse(br#"{"audio": {"sample_rate": 1}}"#).expect_err("refused");
        assert!(e.contains("[8000, 48000]"), "{e}");
    }

    #[test]
    fn ids_pad_every_phoneme_and_decompose_accents() {
        let c = config();
        // "ã" decomposes into "a" + U+0303; "x" is unknown and skipped.
        assert_eq!(
            c.ids("ˈab ã.x"),
            [1, 0, 120, 0, 14, 0, 15, 0, 3, 0, 14, 0, 141, 0, 10, 0, 2]
        );
    }

    #[test]
    fn clauses_become_sentences_with_their_punctuation() {
        let cl = |p: &str, t: Option<char>, end: bool| Clause {
            phonemes: p.into(),
            terminator: t,
            ends_sentence: end,
        };
        let s = sentences(&[
            cl("həlˈoʊ", Some(','), false),
            cl("(en)wˈɜːld(fr)", Some('.'), true),
            cl("", None, false),
            cl("bˈaɪ", None, true),
        ]);
        assert_eq!(s, ["həlˈoʊ, wˈɜːld.", "bˈaɪ"]);
        assert_eq!(strip_language_flags("a(b"), "a(b");
    }

    #[test]
    fn audio_is_peak_normalised() {
        assert_eq!(normalise(&[0.25, -0.5]), [0.5, -1.0]);
        assert_eq!(normalise(&[0.0, 1e-9]), [0.0, 0.0]);
    }
}
