//! What the ONNX plugin's integration tests share: the run-time libraries from the test
//! packages (scripts/setup.sh exports their paths), loading a voice, and a whole speech.

use std::path::{Path, PathBuf};

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    Backend, EngineConfig, Format, ModelDescriptor, SpeechRequest, Status, ffi,
};
use gantry_engine_onnx::{OnnxEngine, OnnxModel};

pub fn env_path(var: &str) -> PathBuf {
    let p = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!("{var} is not set: run scripts/setup.sh (scripts/test.sh exports it)")
    });
    assert!(p.exists(), "{var}={} does not exist", p.display());
    p
}

/// Load the voice whose graph is `graph`, on the CPU with 2 threads.
pub fn load(id: &str, graph: &Path) -> OnnxModel {
    for var in [
        "GANTRY_ONNXRUNTIME_LIB",
        "GANTRY_ESPEAK_LIB",
        "GANTRY_ESPEAK_DATA",
    ] {
        env_path(var);
    }
    let engine = OnnxEngine::create(
        EngineConfig {
            backend: Backend::Cpu,
            n_threads: 2,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )
    .expect("create");
    engine
        .load_model(&ModelDescriptor::new(id, graph, Format::Onnx))
        .expect("load the voice")
}

/// Every piece of one speech, in order.
pub fn speak(m: &OnnxModel, text: &str, voice: Option<&str>, speed: f32) -> Vec<Vec<f32>> {
    let id = m
        .speech_open(&SpeechRequest { text, voice, speed })
        .expect("open");
    let mut pieces = Vec::new();
    loop {
        let p = m.speech_next(id).expect("next");
        pieces.push(p.samples);
        if p.done {
            break;
        }
    }
    m.speech_close(id);
    pieces
}

/// Three sentences of 15 words (one a two-word question).
pub const THREE: &str = "The quick brown fox jumps over the lazy dog. It was not amused! Was it?";

/// The voice's facts (a speech model of `architecture` at `rate` Hz with the one voice
/// `voice`), then [`THREE`] spoken with it: one piece per sentence, each 0.3 to 6 s, about 2.5
/// words a second in all, and `speed` 2 about halving it (between `fast` of the length). The
/// pieces at speed 1 and their seconds.
pub fn speaks_three_sentences(
    m: &OnnxModel,
    (architecture, rate, voice): (&str, u32, &str),
    fast: std::ops::Range<f32>,
) -> (Vec<Vec<f32>>, f32) {
    let info = m.info();
    assert_eq!(info.architecture, architecture);
    assert_eq!(info.modalities, ffi::GANTRY_MODALITY_SPEECH);
    assert_eq!(info.audio_sample_rate, rate);
    assert_eq!(info.voices, [voice]);
    let secs =
        |pieces: &[Vec<f32>]| pieces.iter().map(Vec::len).sum::<usize>() as f32 / rate as f32;
    let pieces = speak(m, THREE, Some(voice), 1.0);
    assert_eq!(pieces.len(), 3, "one piece per sentence");
    for p in &pieces {
        // "Was it?" is about half a second.
        let s = secs(std::slice::from_ref(p));
        assert!((0.3..6.0).contains(&s), "a sentence of {s} s");
    }
    let total = secs(&pieces);
    assert!((3.0..10.0).contains(&total), "{total} s for 15 words");
    // Pauses and (with noise) the sampled durations vary: about half, not exactly.
    let ratio = secs(&speak(m, THREE, None, 2.0)) / total;
    assert!(fast.contains(&ratio), "speed 2 gave {ratio} of the length");
    (pieces, total)
}

/// An unknown voice (`other`; the message lists `own`), empty text, a speed out of range, text
/// with nothing to pronounce and an unknown speech are each refused with the reason, and the
/// model speaks after them.
pub fn refuses_bad_requests(m: &OnnxModel, other: &str, own: &str) {
    let err = |text: &str, voice: Option<&str>, speed: f32| {
        m.speech_open(&SpeechRequest { text, voice, speed })
            .expect_err("refused")
    };
    let e = err("Hello.", Some(other), 1.0);
    assert_eq!(e.status, Status::Unsupported);
    assert!(
        e.message.contains(&format!("{other:?}")) && e.message.contains(own),
        "{e}"
    );
    for (text, speed, why) in [
        ("   ", 1.0, "empty"),
        ("Hello.", 9.0, "[0.25, 4]"),
        ("Hello.", 0.1, "[0.25, 4]"),
        ("...", 1.0, "nothing to speak"),
    ] {
        let e = err(text, None, speed);
        assert!(e.message.contains(why), "{text:?} at {speed}: {e}");
    }
    let e = m.speech_next(12345).expect_err("no such speech");
    assert!(e.message.contains("12345"), "{e}");
    // Nothing above disturbed the model.
    assert_eq!(speak(m, "Still here.", None, 1.0).len(), 1);
}
