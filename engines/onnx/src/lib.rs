//! ONNX engine plugin (engine layer, below the engine host): runs ONNX graphs through ONNX
//! Runtime, written against `gantry-engine-abi` alone. It serves text-to-speech voices of two
//! families: Piper (`PiperVoice`) and Hibari, a Kokoro-distilled model (`HibariVoice`).
//!
//! Load: ONNX Runtime's shared library is found and opened once per process ([`libs`]), as is
//! espeak-ng ([`espeak`]); the files beside the graph say which family it is and give its
//! phoneme table, rate and speakers ([`piper`], [`hibari`]); one ONNX Runtime session holds
//! the graph, on CPU with the engine's threads, or with the CUDA execution provider on a CUDA
//! engine where ONNX Runtime was built with it.
//!
//! Speech (ABI 1.10): `speech_open` checks the voice, phonemises the whole text and keeps its
//! sentences as id lists; each `speech_next` runs the graph on the next sentence (and, for a
//! Hibari voice, the [`vocoder`] on its output, with the session free again), so a piece is
//! one sentence of audio and the host can stream it while the next is made.
#![allow(unsafe_code)] // An engine crate: it opens ONNX Runtime and espeak-ng. Each block has a SAFETY note.

pub mod espeak;
pub mod hibari;
pub mod libs;
pub mod misaki;
pub mod piper;
pub mod vocoder;

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    Backend, EngineConfig, EngineError, Format, LogLevel, ModelDescriptor, ModelInfo, SampledToken,
    SpeechPiece, SpeechRequest, Status, StepEntry, ffi,
};
use ort::session::Session;
use rand::SeedableRng;

use crate::hibari::HibariVoice;
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
        "ONNX Runtime: text-to-speech voices (Piper, Hibari) with espeak-ng phonemes";

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
        let voice = match HibariVoice::find(graph) {
            Some(hibari) => hibari.map(Voice::Hibari),
            None => VoiceConfig::read(&piper_config_path(graph)).map(Voice::Piper),
        }
        .map_err(|e| EngineError::new(Status::ModelCorrupt, e))?;
        let env = runtime()?;
        init_espeak()?;
        // Phonemise once now: a voice espeak-ng lacks fails the load, not the first request.
        espeak::phonemize(voice.espeak_voice(), "a", false)
            .map_err(|e| EngineError::new(Status::LoadFailed, e))?;
        let threads = desc.threads_in(&self.config).max(1) as usize;
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
        if matches!(voice, Voice::Hibari(_)) {
            hibari::check_graph(&session).map_err(|e| {
                EngineError::new(Status::ModelCorrupt, format!("{}: {e}", graph.display()))
            })?;
        }
        let bytes = std::fs::metadata(graph).map_or(0, |m| m.len());
        self.log.log(
            LogLevel::Info,
            &format!(
                "loaded {} voice {} ({} Hz, speakers {:?}, {threads} threads)",
                voice.architecture(),
                graph.display(),
                voice.sample_rate(),
                voice.speakers()
            ),
        );
        Ok(OnnxModel {
            info: ModelInfo {
                architecture: voice.architecture().into(),
                context_length: MAX_TEXT_BYTES as u32,
                trained_context_length: MAX_TEXT_BYTES as u32,
                max_sequences: 1,
                // The graph's weights, and about as much again for ONNX Runtime's arenas.
                bytes_used: bytes.saturating_mul(2),
                modalities: ffi::GANTRY_MODALITY_SPEECH,
                audio_sample_rate: voice.sample_rate(),
                voices: voice.speakers(),
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

/// The voice a graph speaks with.
enum Voice {
    Piper(VoiceConfig),
    Hibari(HibariVoice),
}

impl Voice {
    fn architecture(&self) -> &'static str {
        match self {
            Voice::Piper(_) => PIPER_ARCHITECTURE,
            Voice::Hibari(_) => hibari::ARCHITECTURE,
        }
    }
    fn espeak_voice(&self) -> &str {
        match self {
            Voice::Piper(v) => &v.espeak_voice,
            Voice::Hibari(v) => &v.espeak_voice,
        }
    }
    fn sample_rate(&self) -> u32 {
        match self {
            Voice::Piper(v) => v.sample_rate,
            Voice::Hibari(_) => vocoder::SAMPLE_RATE,
        }
    }
    fn speakers(&self) -> Vec<String> {
        match self {
            Voice::Piper(v) => v.speakers.clone(),
            Voice::Hibari(v) => vec![v.name.clone()],
        }
    }
}

/// A speech in progress: its sentences still to synthesize.
struct Speech {
    sentences: VecDeque<Vec<i64>>,
    /// Sentences already taken.
    taken: u64,
    how: How,
}

/// How a speech's sentences become audio.
#[derive(Clone, Copy)]
enum How {
    Piper {
        scales: [f32; 3],
        speaker: Option<i64>,
    },
    Hibari {
        speed: f32,
        noise_scale: f32,
        /// The text's seed; sentence `i` draws its noise from `seed + i`.
        seed: u64,
    },
}

pub struct OnnxModel {
    info: ModelInfo,
    voice: Voice,
    session: Mutex<Session>,
    speeches: Mutex<HashMap<u64, Speech>>,
    next_id: AtomicU64,
}

impl OnnxModel {
    /// The phoneme ids of each sentence of `text`, as the voice speaks it.
    pub fn sentence_ids(&self, text: &str) -> Result<Vec<Vec<i64>>, EngineError> {
        Ok(match &self.voice {
            Voice::Piper(v) => {
                let clauses = espeak::phonemize(&v.espeak_voice, text, false)
                    .map_err(EngineError::internal)?;
                piper::sentences(&clauses)
                    .iter()
                    .map(|s| v.ids(s))
                    .collect()
            }
            Voice::Hibari(v) => v
                .sentences(text)
                .map_err(EngineError::internal)?
                .iter()
                .map(|s| v.ids(s))
                .collect(),
        })
    }

    /// The phonemes of each sentence of `text`, as the graph takes them (a Hibari voice's:
    /// misaki's alphabet), or `None` for a Piper voice.
    pub fn sentence_phonemes(&self, text: &str) -> Option<Result<Vec<String>, String>> {
        match &self.voice {
            Voice::Piper(_) => None,
            Voice::Hibari(v) => Some(v.sentences(text)),
        }
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
        let speakers = self.voice.speakers();
        let speaker = match req.voice {
            None => 0,
            Some(v) => speakers.iter().position(|s| s == v).ok_or_else(|| {
                EngineError::unsupported(format!(
                    "voice {v:?} is not one of this model's voices ({})",
                    speakers.join(", ")
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
        let how = match &self.voice {
            Voice::Piper(v) => How::Piper {
                scales: [v.noise_scale, v.length_scale / req.speed, v.noise_w],
                speaker: v.multi_speaker.then_some(speaker as i64),
            },
            Voice::Hibari(v) => How::Hibari {
                speed: req.speed,
                noise_scale: v.noise_scale,
                seed: hibari::seed(req.text),
            },
        };
        let speech = Speech {
            sentences,
            taken: 0,
            how,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.speeches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, speech);
        Ok(id)
    }

    fn speech_next(&self, speech: u64) -> Result<SpeechPiece, EngineError> {
        let (ids, how, index, done) = {
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
            s.taken += 1;
            (ids, s.how, s.taken - 1, s.sentences.is_empty())
        };
        let samples = match how {
            How::Piper { scales, speaker } => {
                let mut session = self.session.lock().unwrap_or_else(|p| p.into_inner());
                piper::synthesize(&mut session, &ids, scales, speaker)?
            }
            How::Hibari {
                speed,
                noise_scale,
                seed,
            } => {
                let out = {
                    let mut session = self.session.lock().unwrap_or_else(|p| p.into_inner());
                    hibari::run_graph(&mut session, &ids, speed)?
                };
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed.wrapping_add(index));
                out.audio(noise_scale, &mut rng)
            }
        };
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
