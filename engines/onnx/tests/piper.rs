//! The ONNX plugin on a real Piper voice (en_US joe medium, from the test packages): load, the
//! voice's facts, speech cut into sentence pieces, pace, and refusals. Audio against ONNX
//! Runtime's Python reference and the Whisper round trip are checked end to end through the
//! node (tests/python/test_speech.py).

mod common;

use common::{env_path, speak};
use gantry_engine_abi::sdk::Model;
use gantry_engine_abi::{SpeechRequest, Status, ffi};
use gantry_engine_onnx::OnnxModel;

fn load() -> OnnxModel {
    let dir = env_path("GANTRY_PIPER_VOICE_DIR");
    common::load("joe", &dir.join("en_US-joe-medium.onnx"))
}

#[test]
fn a_piper_voice_speaks_sentence_by_sentence() {
    let m = load();
    let info = m.info();
    assert_eq!(info.architecture, "PiperVoice");
    assert_eq!(info.modalities, ffi::GANTRY_MODALITY_SPEECH);
    assert_eq!(info.audio_sample_rate, 22_050);
    assert_eq!(info.voices, ["joe"]);

    let text = "The quick brown fox jumps over the lazy dog. It was not amused! Was it?";
    let pieces = speak(&m, text, Some("joe"), 1.0);
    assert_eq!(pieces.len(), 3, "one piece per sentence");
    for p in &pieces {
        let secs = p.len() as f32 / 22_050.0;
        // "Was it?" is about half a second; the voice samples its durations (noise on), so
        // it runs from about 0.45 s.
        assert!((0.3..6.0).contains(&secs), "a sentence of {secs} s");
        let peak = p.iter().fold(0f32, |a, x| a.max(x.abs()));
        assert!((peak - 1.0).abs() < 1e-6, "peak-normalised, got {peak}");
    }
    // About 2.5 words per second, give or take: the whole text is 15 words.
    let total: usize = pieces.iter().map(Vec::len).sum();
    let secs = total as f32 / 22_050.0;
    assert!((3.0..10.0).contains(&secs), "{secs} s for 15 words");

    // speed 2 about halves the duration (the length scale; pauses and the sampled durations vary).
    let fast: usize = speak(&m, text, None, 2.0).iter().map(Vec::len).sum();
    let ratio = fast as f32 / total as f32;
    assert!(
        (0.4..0.75).contains(&ratio),
        "speed 2 gave {ratio} of the length"
    );
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let m = load();
    let err = |text: &str, voice: Option<&str>, speed: f32| {
        m.speech_open(&SpeechRequest { text, voice, speed })
            .expect_err("refused")
    };
    let e = err("Hello.", Some("alloy"), 1.0);
    assert_eq!(e.status, Status::Unsupported);
    assert!(
        e.message.contains("\"alloy\"") && e.message.contains("joe"),
        "{e}"
    );
    let e = err("   ", None, 1.0);
    assert!(e.message.contains("empty"), "{e}");
    let e = err("Hello.", None, 9.0);
    assert!(e.message.contains("[0.25, 4]"), "{e}");
    let e = err("...", None, 1.0);
    assert!(e.message.contains("nothing to speak"), "{e}");
    let e = m.speech_next(12345).expect_err("no such speech");
    assert!(e.message.contains("12345"), "{e}");
    // Nothing above disturbed the model.
    assert_eq!(speak(&m, "Still here.", None, 1.0).len(), 1);
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
