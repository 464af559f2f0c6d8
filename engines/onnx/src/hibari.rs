//! A Hibari voice (speech request → audio): a Kokoro-distilled model whose graph predicts
//! spectra that [`crate::vocoder`] turns into 24 kHz audio (the PyPI package `hibari-tts`).
//!
//! Files: the graph (`hibari.onnx`, or a downloaded voice such as `bf_emma.int8.onnx`),
//! `vocab.json` (phoneme → id) and `voices.json` (the package's registry: name, accent and file
//! of each voice) beside it. The registry entry whose `file` is the graph names the voice and
//! says whether it is British; an optional `noise_scale` in that entry scales the noise branch
//! (1 when absent, 0 makes the audio a function of the phonemes alone).
//!
//! Text → ids: espeak-ng phonemes, tied, clause by clause ([`crate::espeak`]), in misaki's
//! alphabet ([`crate::misaki`]), with each clause's punctuation; clauses joined into sentences
//! of at most [`MAX_PHONEMES`] phonemes (a longer sentence is cut at its clauses, a longer
//! clause at its words); each sentence as `0, ids…, 0`, phonemes outside the vocabulary
//! skipped. Text may carry its own pronunciation in misaki's markup, `[Kokoro](/kˈOkəɹO/)`:
//! the phonemes between the slashes are spoken as written.
//!
//! Ids → audio: the graph's `ids` and `speed`, its six outputs to the vocoder. The noise is
//! drawn from a generator seeded by the text, so the same text gives the same audio.

use std::collections::HashMap;
use std::path::Path;

use gantry_engine_abi::EngineError;
use ort::session::Session;
use ort::value::Tensor;

use crate::{espeak, misaki, vocoder};

/// The architecture a Hibari voice reports (the name the manifest lists).
pub const ARCHITECTURE: &str = "HibariVoice";
/// The most phonemes the graph is given at once (the package's own limit).
pub const MAX_PHONEMES: usize = 400;
/// The graph's inputs and outputs, checked at load.
pub const INPUTS: [&str; 2] = ["ids", "speed"];
pub const OUTPUTS: [&str; 6] = ["lh", "theta", "ln", "lr", "phi", "f0"];

const REGISTRY: &str = "voices.json";
const VOCAB: &str = "vocab.json";

/// A Hibari voice's facts.
#[derive(Clone, Debug, PartialEq)]
pub struct HibariVoice {
    pub name: String,
    pub british: bool,
    /// espeak-ng voice of the phonemes (`en-us` or `en-gb`).
    pub espeak_voice: String,
    pub noise_scale: f32,
    vocab: HashMap<char, i64>,
}

fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: not JSON: {e}", path.display()))
}

/// The registry entry naming `graph`, if a Hibari registry lies beside it.
fn registry_entry(graph: &Path) -> Option<(String, serde_json::Value)> {
    let file = graph.file_name()?.to_str()?;
    let registry = read_json(&graph.with_file_name(REGISTRY)).ok()?;
    registry.as_object()?.iter().find_map(|(name, v)| {
        (v.get("file").and_then(|f| f.as_str()) == Some(file)).then(|| (name.clone(), v.clone()))
    })
}

impl HibariVoice {
    /// The voice whose graph is `graph`, or `None` when no `voices.json` beside it lists it
    /// (then it is not a Hibari voice).
    pub fn find(graph: &Path) -> Option<Result<HibariVoice, String>> {
        registry_entry(graph).map(|(name, entry)| Self::from_entry(graph, name, &entry))
    }

    /// The voice whose graph is `graph`; refused when no registry lists it.
    pub fn read(graph: &Path) -> Result<HibariVoice, String> {
        Self::find(graph).unwrap_or_else(|| {
            Err(format!(
                "{} does not list {}",
                graph.with_file_name(REGISTRY).display(),
                graph.display()
            ))
        })
    }

    fn from_entry(
        graph: &Path,
        name: String,
        entry: &serde_json::Value,
    ) -> Result<HibariVoice, String> {
        let british = entry
            .get("british")
            .map(|b| {
                b.as_bool()
                    .ok_or_else(|| format!("`{name}.british` in {REGISTRY} is not a boolean"))
            })
            .transpose()?
            .unwrap_or(false);
        let noise_scale = match entry.get("noise_scale") {
            None => 1.0,
            Some(x) => x
                .as_f64()
                .filter(|x| (0.0..=4.0).contains(x))
                .ok_or_else(|| {
                    format!("`{name}.noise_scale` in {REGISTRY} must be a number within [0, 4]")
                })? as f32,
        };
        let vocab_path = graph.with_file_name(VOCAB);
        let map = read_json(&vocab_path)?;
        let map = map
            .as_object()
            .ok_or_else(|| format!("{}: not an object", vocab_path.display()))?;
        let mut vocab = HashMap::new();
        for (k, id) in map {
            let mut chars = k.chars();
            let (Some(c), None) = (chars.next(), chars.next()) else {
                return Err(format!(
                    "{}: key {k:?} is not one code point",
                    vocab_path.display()
                ));
            };
            let id = id
                .as_i64()
                .ok_or_else(|| format!("{}: {k:?} is not an integer", vocab_path.display()))?;
            vocab.insert(c, id);
        }
        Ok(HibariVoice {
            name,
            british,
            espeak_voice: if british { "en-gb" } else { "en-us" }.into(),
            noise_scale,
            vocab,
        })
    }

    /// One sentence's phonemes as the graph's ids, padded with 0 at both ends.
    pub fn ids(&self, phonemes: &str) -> Vec<i64> {
        let mut out = Vec::with_capacity(phonemes.len() + 2);
        out.push(0);
        out.extend(phonemes.chars().filter_map(|c| self.vocab.get(&c).copied()));
        out.push(0);
        out
    }

    /// The phonemes of `text`, one string per piece the graph takes at once.
    pub fn sentences(&self, text: &str) -> Result<Vec<String>, String> {
        let mut clauses: Vec<(String, bool)> = Vec::new();
        for piece in pieces(text) {
            match piece {
                Piece::Text(t) => {
                    for c in espeak::phonemize(&self.espeak_voice, t, true)? {
                        let mut p = misaki::from_espeak(
                            &crate::piper::strip_language_flags(&c.phonemes),
                            self.british,
                        );
                        if let Some(t) = c.terminator {
                            p.push(t);
                        }
                        clauses.push((p, matches!(c.terminator, Some('.' | '?' | '!'))));
                    }
                }
                Piece::Phonemes(p) => {
                    let p = p.trim().to_string();
                    let ends = p.ends_with(['.', '?', '!']);
                    clauses.push((p, ends));
                }
            }
        }
        Ok(group(clauses))
    }
}

/// Clauses (with whether each ends a sentence) joined into sentences, each cut to
/// [`MAX_PHONEMES`].
fn group(clauses: Vec<(String, bool)>) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let push = |out: &mut Vec<String>, s: &mut String| {
        let t = s.trim();
        if t.chars().any(char::is_alphabetic) {
            out.push(t.to_string());
        }
        s.clear();
    };
    for (clause, ends) in clauses {
        let clause = clause.trim();
        if clause.is_empty() {
            continue;
        }
        if !cur.is_empty() && cur.chars().count() + 1 + clause.chars().count() > MAX_PHONEMES {
            push(&mut out, &mut cur);
        }
        if clause.chars().count() > MAX_PHONEMES {
            // One clause too long for the graph: cut at its words.
            for word in clause.split(' ') {
                if !cur.is_empty() && cur.chars().count() + 1 + word.chars().count() > MAX_PHONEMES
                {
                    push(&mut out, &mut cur);
                }
                if !cur.is_empty() {
                    cur.push(' ');
                }
                cur.extend(word.chars().take(MAX_PHONEMES));
            }
        } else {
            if !cur.is_empty() {
                cur.push(' ');
            }
            cur.push_str(clause);
        }
        if ends {
            push(&mut out, &mut cur);
        }
    }
    push(&mut out, &mut cur);
    out
}

/// A run of the input: text to phonemise, or phonemes given in markup.
#[derive(Debug, PartialEq)]
enum Piece<'a> {
    Text(&'a str),
    Phonemes(&'a str),
}

/// `text` cut at misaki's pronunciation markup, `[word](/phonemes/)`; anything else, a lone
/// bracket included, is text.
fn pieces(text: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut from = 0;
    while let Some(open) = text[from..].find('[').map(|i| from + i) {
        let markup = text[open..].find("](/").and_then(|close| {
            let body = open + close + 3;
            text[body..]
                .find("/)")
                .map(|end| (open + close, body, body + end, body + end + 2))
        });
        match markup {
            Some((word_end, body, end, after))
                if !text[open + 1..word_end].contains(['[', ']']) =>
            {
                if open > start {
                    out.push(Piece::Text(&text[start..open]));
                }
                out.push(Piece::Phonemes(&text[body..end]));
                start = after;
                from = after;
            }
            _ => from = open + 1,
        }
    }
    if start < text.len() {
        out.push(Piece::Text(&text[start..]));
    }
    out.retain(|p| !matches!(p, Piece::Text(t) if t.trim().is_empty()));
    out
}

/// A seed for the noise of a speech: FNV-1a of its text (fixed across builds and platforms,
/// unlike the standard library's hasher).
pub fn seed(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Check that `session` has a Hibari voice's inputs and outputs.
pub fn check_graph(session: &Session) -> Result<(), String> {
    let has = |list: &[ort::value::Outlet], name: &str| list.iter().any(|o| o.name() == name);
    let missing: Vec<&str> = INPUTS
        .iter()
        .filter(|n| !has(session.inputs(), n))
        .chain(OUTPUTS.iter().filter(|n| !has(session.outputs(), n)))
        .copied()
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the graph lacks what a Hibari voice has: {}",
            missing.join(", ")
        ))
    }
}

/// The graph's six outputs for one sentence, owned (so the session is free while the
/// vocoder runs).
pub struct GraphOut {
    frames: usize,
    parts: [Vec<f32>; 6],
}

/// Run the graph on one sentence's ids.
pub fn run_graph(session: &mut Session, ids: &[i64], speed: f32) -> Result<GraphOut, EngineError> {
    let ort_err = |e: ort::Error| EngineError::internal(format!("ONNX Runtime: {e}"));
    let input = Tensor::from_array(([1usize, ids.len()], ids.to_vec())).map_err(ort_err)?;
    let speed = Tensor::from_array(([1usize], vec![speed])).map_err(ort_err)?;
    let outputs = session
        .run(ort::inputs!["ids" => input, "speed" => speed])
        .map_err(ort_err)?;
    let f0 = outputs["f0"]
        .try_extract_tensor::<f32>()
        .map_err(ort_err)?
        .1;
    let frames = f0.len();
    let mut parts: [Vec<f32>; 6] = Default::default();
    for (part, name) in parts.iter_mut().zip(OUTPUTS) {
        let (_, data) = outputs[name].try_extract_tensor::<f32>().map_err(ort_err)?;
        let want = if name == "f0" {
            frames
        } else {
            vocoder::BINS * frames
        };
        if data.len() != want {
            return Err(EngineError::internal(format!(
                "the graph's {name} has {} values, not {want}",
                data.len()
            )));
        }
        *part = data.to_vec();
    }
    Ok(GraphOut { frames, parts })
}

impl GraphOut {
    /// The sentence's audio.
    pub fn audio(&self, noise_scale: f32, rng: &mut impl rand::Rng) -> Vec<f32> {
        let [lh, theta, ln, lr, phi, f0] = &self.parts;
        vocoder::synthesize(
            &vocoder::Frames {
                frames: self.frames,
                lh,
                theta,
                ln,
                lr,
                phi,
                f0,
            },
            noise_scale,
            rng,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_gives_phonemes_and_the_rest_is_text() {
        assert_eq!(
            pieces("Say [Kokoro](/kˈOkəɹO/) twice. [x] and [a](b) stay."),
            [
                Piece::Text("Say "),
                Piece::Phonemes("kˈOkəɹO"),
                Piece::Text(" twice. [x] and [a](b) stay."),
            ]
        );
        assert_eq!(
            pieces("[a](/ə./) [b](/bˈi?/)"),
            [Piece::Phonemes("ə."), Piece::Phonemes("bˈi?")]
        );
        assert_eq!(pieces("[unclosed](/abc"), [Piece::Text("[unclosed](/abc")]);
    }

    #[test]
    fn clauses_become_sentences_within_the_limit() {
        let c = |s: &str, end| (s.to_string(), end);
        assert_eq!(
            group(vec![
                c("həlˈO,", false),
                c("wˈɜɹld!", true),
                c("", false),
                c("hˌW ɑɹ ju?", true),
                c(".", true),
            ]),
            ["həlˈO, wˈɜɹld!", "hˌW ɑɹ ju?"]
        );
        // A clause of 599 phonemes is cut at a word; the next clause fits beside its rest.
        let long = vec![c(&"ə ".repeat(300), false), c(&"b".repeat(150), true)];
        let out = group(long);
        assert!(
            out.iter().all(|s| s.chars().count() <= MAX_PHONEMES),
            "{out:?}"
        );
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out.join(" ").matches('ə').count(), 300);
        assert!(out[1].ends_with(&"b".repeat(150)));
    }

    #[test]
    fn the_seed_is_fnv_1a() {
        assert_eq!(seed(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(seed("a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(seed("Hello."), seed("Hello!"));
    }

    #[test]
    fn the_registry_names_the_voice_and_its_accent() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join(REGISTRY),
            r#"{"heart": {"file": "hibari.onnx", "british": false},
                "emma": {"file": "bf_emma.int8.onnx", "british": true, "noise_scale": 0}}"#,
        )
        .expect("write");
        std::fs::write(dir.path().join(VOCAB), r#"{";": 1, "ə": 83, "b": 44}"#).expect("write");
        let heart = HibariVoice::read(&dir.path().join("hibari.onnx")).expect("heart");
        assert_eq!(
            (
                heart.name.as_str(),
                heart.british,
                heart.espeak_voice.as_str()
            ),
            ("heart", false, "en-us")
        );
        assert_eq!(heart.noise_scale, 1.0);
        assert_eq!(heart.ids("əxb;"), [0, 83, 44, 1, 0]);
        let emma = HibariVoice::read(&dir.path().join("bf_emma.int8.onnx")).expect("emma");
        assert_eq!((emma.british, emma.noise_scale), (true, 0.0));
        assert!(HibariVoice::find(&dir.path().join("other.onnx")).is_none());
        let e = HibariVoice::read(&dir.path().join("other.onnx")).expect_err("unlisted");
        assert!(e.contains("does not list"), "{e}");
    }
}
