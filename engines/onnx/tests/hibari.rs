//! The ONNX plugin on a real Hibari voice ("heart", the Kokoro-distilled model in the PyPI
//! package `hibari-tts`): load, the voice's facts, the phonemes its text becomes, speech cut
//! into sentence pieces, pace, the same audio for the same text, and refusals. The audio
//! against the package's own Python pipeline and the Whisper round trip are checked end to end
//! through the node (tests/python/test_speech.py).

mod common;

use common::{env_path, speak};
use gantry_engine_onnx::OnnxModel;

fn load() -> OnnxModel {
    common::load("heart", &env_path("GANTRY_HIBARI_DIR").join("hibari.onnx"))
}

#[test]
fn a_hibari_voice_speaks_sentence_by_sentence() {
    let m = load();
    let (pieces, _) =
        common::speaks_three_sentences(&m, ("HibariVoice", 24_000, "heart"), 0.4..0.7);
    for p in &pieces {
        let peak = p.iter().fold(0f32, |a, x| a.max(x.abs()));
        assert!(
            (0.05..=1.0).contains(&peak),
            "audible and in range, peak {peak}"
        );
    }
    // The noise is seeded by the text: the same text, the same audio.
    assert_eq!(speak(&m, common::THREE, None, 1.0), pieces);
}

#[test]
fn text_becomes_misaki_phonemes() {
    let m = load();
    let ps = |t: &str| {
        m.sentence_phonemes(t)
            .expect("a Hibari voice")
            .expect("phonemes")
    };
    // espeak-ng's reading in the voice's alphabet; the voice's own phonemiser writes
    // "həlˈO, wˈɜɹld!" and "hˌW ɑɹ ju tədˈA?".
    assert_eq!(
        ps("Hello, world! How are you today?"),
        ["həlˈO, wˈɜɹld!", "hˌW ɑɹ ju tədˈA?"]
    );
    // Markup speaks its phonemes as written, in the sentence around it.
    assert_eq!(ps("Say [Kokoro](/kˈOkəɹO/) twice."), ["sˈA kˈOkəɹO twˈIs."]);
    let ids = m.sentence_ids("Hello.").expect("ids");
    assert_eq!(ids.len(), 1);
    assert_eq!(
        (ids[0][0], *ids[0].last().expect("ids")),
        (0, 0),
        "padded with 0"
    );
    // h ə l ˈ O . in the voice's vocab.json.
    assert_eq!(ids[0], [0, 50, 83, 54, 156, 31, 4, 0]);
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    common::refuses_bad_requests(&load(), "joe", "heart");
}

#[test]
fn a_sentence_longer_than_the_graph_takes_is_cut_at_its_clauses() {
    let m = load();
    let long = "It is a truth universally acknowledged, that a single man in possession of a good \
                fortune, must be in want of a wife, however little known the feelings or views of \
                such a man may be on his first entering a neighbourhood, this truth is so well \
                fixed in the minds of the surrounding families, that he is considered the rightful \
                property of some one or other of their daughters, and so on and so forth until the \
                end of the chapter.";
    let ps = m
        .sentence_phonemes(long)
        .expect("a Hibari voice")
        .expect("phonemes");
    assert!(ps.len() >= 2, "{ps:?}");
    assert!(ps.iter().all(|p| p.chars().count() <= 400), "{ps:?}");
    // Cut at clauses: every piece but the last ends with the comma that ended its clause.
    assert!(
        ps[..ps.len() - 1].iter().all(|p| p.ends_with(',')),
        "{ps:?}"
    );
    let pieces = common::speak(&m, long, None, 1.0);
    assert_eq!(pieces.len(), ps.len());
    let secs = pieces.iter().map(Vec::len).sum::<usize>() as f32 / 24_000.0;
    assert!((15.0..50.0).contains(&secs), "{secs} s for 82 words");
}
