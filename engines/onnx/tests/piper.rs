//! The ONNX plugin on a real Piper voice (en_US joe medium, from the test packages): load, the
//! voice's facts, speech cut into sentence pieces, pace, and refusals. Audio against ONNX
//! Runtime's Python reference and the Whisper round trip are checked end to end through the
//! node (tests/python/test_speech.py).

mod common;

use common::env_path;
use gantry_engine_onnx::OnnxModel;

fn load() -> OnnxModel {
    let dir = env_path("GANTRY_PIPER_VOICE_DIR");
    common::load("joe", &dir.join("en_US-joe-medium.onnx"))
}

#[test]
fn a_piper_voice_speaks_sentence_by_sentence() {
    let m = load();
    let (pieces, _) = common::speaks_three_sentences(&m, ("PiperVoice", 22_050, "joe"), 0.4..0.75);
    for p in &pieces {
        let peak = p.iter().fold(0f32, |a, x| a.max(x.abs()));
        assert!((peak - 1.0).abs() < 1e-6, "peak-normalised, got {peak}");
    }
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    common::refuses_bad_requests(&load(), "alloy", "joe");
}

#[test]
fn phoneme_ids_follow_the_voice_table() {
    let m = load();
    let ids = m.sentence_ids("Hello, world. Bye").expect("ids");
    assert_eq!(ids.len(), 2, "{ids:?}");
    for s in &ids {
        assert_eq!(&s[..2], &[1, 0], "^ then _");
        assert_eq!(s.last(), Some(&2), "$ last");
        // Every other id is the pad.
        assert!(
            s[1..s.len() - 1].iter().step_by(2).all(|&i| i == 0),
            "{s:?}"
        );
    }
    // The comma stays in the first sentence (id 8), followed by a space (3).
    assert!(ids[0].windows(3).any(|w| w == [8, 0, 3]), "{:?}", ids[0]);
}
