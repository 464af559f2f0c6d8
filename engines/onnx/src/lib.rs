//! ONNX engine plugin (engine layer, below the engine host): runs ONNX graphs through ONNX
//! Runtime, written against `gantry-engine-abi` alone. Today it serves text-to-speech voices
//! (Piper, `PiperVoice`).
//!
//! Load: ONNX Runtime's shared library is found and opened once per process ([`libs`]), as is
//! espeak-ng ([`espeak`]); the voice's config gives its phoneme table, rate and speakers
//! ([`piper`]); one ONNX Runtime session holds the graph, on CPU with the engine's threads, or
//! with the CUDA execution provider on a CUDA engine where ONNX Runtime was built with it.
//!
//! Speech (ABI 1.10): `speech_open` checks the voice, phonemises the whole text and keeps its
//! sentences as id lists; each `speech_next` runs the graph on the next sentence, so a piece
//! is one sentence of audio and the host can stream it while the next is made.
#![allow(unsafe_code)] // An engine crate: it opens ONNX Runtime and espeak-ng. Each block has a SAFETY note.

pub mod espeak;
pub mod libs;
pub mod piper;

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    Backend, EngineConfig, EngineError, Format, LogLevel, ModelDescriptor, ModelInfo, SampledToken,
    SpeechPiece, SpeechRequest, Status, StepEntry, ffi,
};
use ort::session::Session;

use crate::piper::VoiceConfig;

/// The longest text one speech takes, in bytes (the node's own limit is lower).
pub const MAX_TEXT_BYTES: usize = 64 * 1024;

/// Open ONNX Runtime once per process (`ort` keeps one global API table) and its environment.
fn runtime() -> Result<&'static ort::environment::Environment, EngineError> {
    static INIT: std::sync::OnceLock<Result<ort::environment::Environment, String>> =
        std::sync::OnceLock::new();
    INIT.get_or_init(|| {
        let lib = libs::find(
            libs::ORT_ENV,
            &["libonnxruntime.so", "libonnxruntime.so.1"],
            "ONNX Runtime's library",
        )?;
        let builder = ort::init_from(&lib)
            .map_err(|e| format!("cannot open ONNX Runtime {}: {e}", lib.display()))?;
        builder
            .with_name("gantry")
            .build()
            .map_err(|e| format!("ONNX Runtime {}: {e}", lib.display()))
    })
    .as_ref()
    .map_err(|e| EngineError::new(Status::LoadFailed, e.clone()))
}

/// Open espeak-ng once per process.
fn init_espeak() -> Result<(), EngineError> {
    let lib = libs::find(
        libs::ESPEAK_ENV,
        &["libespeak-ng.so.1", "libespeak-ng.so"],
        "espeak-ng's library",
    );
    let data = libs::find(
        libs::ESPEAK_DATA_ENV,
        &["espeak-ng-data"],
        "espeak-ng's data",
    );
    let (lib, data) = lib
        .and_then(|l| data.map(|d| (l, d)))
        .map_err(|e| EngineError::new(Status::LoadFailed, e))?;
    espeak::init(&lib, &data).map_err(|e| EngineError::new(Status::LoadFailed, e))
}

pub struct OnnxEngine {
    config: EngineConfig,
    log: HostLog,
}

impl Engine for OnnxEngine {
    type Model = OnnxModel;
    const ID: &'static str = "onnx";
    const VERSION: &'static str = "0.1.0";
    const BACKEND: Backend = Backend::Cpu;
    const DESCRIPTION: &'static str =
        "ONNX Runtime: text-to-speech voices (Piper) with espeak-ng phonemes";

    fn build_info() -> String {
        format!(
            "ONNX Runtime opened at run time ({} or beside the plugin); espeak-ng likewise",
            libs::ORT_ENV
        )
    }

    fn create(config: EngineConfig, log: HostLog) -> Result<Self, EngineError> {
        Ok(OnnxEngine { config, log })
    }

    fn load_model(&self, desc: &ModelDescriptor) -> Result<OnnxModel, EngineError> {
        if desc.format != Format::Onnx {
            return Err(EngineError::unsupported(format!(
                "the onnx engine loads onnx models, not {}",
                desc.format
            )));
        }
        let graph = &desc.primary_file;
        let voice = VoiceConfig::read(&piper_config_path(graph))
            .map_err(|e| EngineError::new(Status::ModelCorrupt, e))?;
        let env = runtime()?;
        init_espeak()?;
        // Phonemise once now: a voice espeak-ng lacks fails the load, not the first request.
        espeak::phonemize(&voice.espeak_voice, "a")
            .map_err(|e| EngineError::new(Status::LoadFailed, e))?;
        let threads = self.config.n_threads.max(1) as usize;
        let ort_err = |e: ort::Error| {
            EngineError::new(
                Status::LoadFailed,
                format!("ONNX Runtime cannot load {}: {e}", graph.display()),
            )
        };
        let mut builder = Session::builder(env)
            .map_err(ort_err)?
            .with_intra_threads(threads)
            .map_err(|e| ort_err(e.into()))?
            .with_inter_threads(1)
            .map_err(|e| ort_err(e.into()))?;
        if self.config.backend == Backend::Cuda {
            builder = builder
                .with_execution_providers([ort::ep::CUDA::default()
                    .with_device_id(self.config.device_ids.first().copied().unwrap_or(0))
                    .build()])
                .map_err(|e| ort_err(e.into()))?;
        }
        let session = builder.commit_from_file(graph).map_err(ort_err)?;
        let bytes = std::fs::metadata(graph).map_or(0, |m| m.len());
        self.log.log(
            LogLevel::Info,
            &format!(
                "loaded voice {} ({} Hz, speakers {:?}, {threads} threads)",
                graph.display(),
                voice.sample_rate,
                voice.speakers
            ),
        );
        Ok(OnnxModel {
            info: ModelInfo {
                architecture: PIPER_ARCHITECTURE.into(),
                context_length: MAX_TEXT_BYTES as u32,
                trained_context_length: MAX_TEXT_BYTES as u32,
                max_sequences: 1,
                // The graph's weights, and about as much again for ONNX Runtime's arenas.
                bytes_used: bytes.saturating_mul(2),
                modalities: ffi::GANTRY_MODALITY_SPEECH,
                audio_sample_rate: voice.sample_rate,
                voices: voice.speakers.clone(),
                ..ModelInfo::default()
            },
            voice,
            session: Mutex::new(session),
            speeches: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        })
    }
}

/// The architecture a Piper voice reports (the name the manifest lists).
const PIPER_ARCHITECTURE: &str = "PiperVoice";

/// `<graph>.json`, a Piper voice's config.
fn piper_config_path(graph: &std::path::Path) -> std::path::PathBuf {
    let mut name = graph.as_os_str().to_owned();
    name.push(".json");
    name.into()
}

/// A speech in progress: its sentences still to synthesize.
struct Speech {
    sentences: VecDeque<Vec<i64>>,
    scales: [f32; 3],
    speaker: Option<i64>,
}

pub struct OnnxModel {
    info: ModelInfo,
    voice: VoiceConfig,
    session: Mutex<Session>,
    speeches: Mutex<HashMap<u64, Speech>>,
    next_id: AtomicU64,
}

impl OnnxModel {
    /// The phoneme ids of each sentence of `text`, as the voice speaks it.
    pub fn sentence_ids(&self, text: &str) -> Result<Vec<Vec<i64>>, EngineError> {
        let clauses =
            espeak::phonemize(&self.voice.espeak_voice, text).map_err(EngineError::internal)?;
        Ok(piper::sentences(&clauses)
            .iter()
            .map(|s| self.voice.ids(s))
            .collect())
    }
}

fn no_text_model<T>() -> Result<T, EngineError> {
    Err(EngineError::unsupported(
        "a speech model has no tokens: it takes text through speech_open",
    ))
}

impl Model for OnnxModel {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }
    fn tokenize(&self, _: &[u8], _: bool, _: bool) -> Result<Vec<i32>, EngineError> {
        no_text_model()
    }
    fn detokenize(&self, _: &[i32], _: bool) -> Result<Vec<u8>, EngineError> {
        no_text_model()
    }
    fn seq_open(&self) -> Result<u64, EngineError> {
        no_text_model()
    }
    fn seq_release(&self, _: u64) {}
    fn step(&self, _: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError> {
        no_text_model()
    }
    fn embed(&self, _: &[i32]) -> Result<Vec<f32>, EngineError> {
        no_text_model()
    }

    fn speech_open(&self, req: &SpeechRequest<'_>) -> Result<u64, EngineError> {
        let speaker = match req.voice {
            None => 0,
            Some(v) => self
                .voice
                .speakers
                .iter()
                .position(|s| s == v)
                .ok_or_else(|| {
                    EngineError::unsupported(format!(
                        "voice {v:?} is not one of this model's voices ({})",
                        self.voice.speakers.join(", ")
                    ))
                })?,
        };
        if req.text.trim().is_empty() {
            return Err(EngineError::unsupported("the text is empty"));
        }
        if req.text.len() > MAX_TEXT_BYTES {
            return Err(EngineError::unsupported(format!(
                "the text is {} bytes, more than the {MAX_TEXT_BYTES} one speech takes",
                req.text.len()
            )));
        }
        if !(0.25..=4.0).contains(&req.speed) {
            return Err(EngineError::unsupported(format!(
                "speed must be within [0.25, 4], got {}",
                req.speed
            )));
        }
        let sentences: VecDeque<Vec<i64>> = self.sentence_ids(req.text)?.into();
        if sentences.is_empty() {
            return Err(EngineError::unsupported(
                "the text has nothing to speak (no words espeak-ng can pronounce)",
            ));
        }
        let v = &self.voice;
        let speech = Speech {
            sentences,
            scales: [v.noise_scale, v.length_scale / req.speed, v.noise_w],
            speaker: v.multi_speaker.then_some(speaker as i64),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.speeches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, speech);
        Ok(id)
    }

    fn speech_next(&self, speech: u64) -> Result<SpeechPiece, EngineError> {
        let (ids, scales, speaker, done) = {
            let mut all = self.speeches.lock().unwrap_or_else(|p| p.into_inner());
            let s = all.get_mut(&speech).ok_or_else(|| {
                EngineError::internal(format!("speech_next: no open speech {speech}"))
            })?;
            let Some(ids) = s.sentences.pop_front() else {
                return Ok(SpeechPiece {
                    samples: Vec::new(),
                    done: true,
                });
            };
            (ids, s.scales, s.speaker, s.sentences.is_empty())
        };
        let mut session = self.session.lock().unwrap_or_else(|p| p.into_inner());
        let samples = piper::synthesize(&mut session, &ids, scales, speaker)?;
        Ok(SpeechPiece { samples, done })
    }

    fn speech_close(&self, speech: u64) {
        self.speeches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&speech);
    }
}

gantry_engine_abi::declare_engine!(OnnxEngine);
