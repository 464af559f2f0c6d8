//! What the ONNX plugin's integration tests share: the run-time libraries from the test
//! packages (scripts/setup.sh exports their paths), loading a voice, and a whole speech.

use std::path::{Path, PathBuf};

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{Backend, EngineConfig, Format, ModelDescriptor, SpeechRequest};
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
        .load_model(&ModelDescriptor {
            model_id: id.into(),
            model_dir: graph.parent().expect("a directory").to_path_buf(),
            primary_file: graph.to_path_buf(),
            format: Format::Onnx,
            quantization: None,
            mmproj: None,
            context_length: 0,
            max_sequences: 0,
            device_ids: Vec::new(),
        })
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
