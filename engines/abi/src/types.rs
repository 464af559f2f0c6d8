//! Engine ABI, safe side: the values the host and plugins exchange, free of raw pointers.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::ffi;

/// The ten status codes of the engine specification. Values are fixed forever.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Status {
    Ok = ffi::GANTRY_OK,
    OomVram = ffi::GANTRY_OOM_VRAM,
    OomRam = ffi::GANTRY_OOM_RAM,
    ModelCorrupt = ffi::GANTRY_MODEL_CORRUPT,
    Timeout = ffi::GANTRY_TIMEOUT,
    Cancelled = ffi::GANTRY_CANCELLED,
    Unsupported = ffi::GANTRY_UNSUPPORTED,
    Internal = ffi::GANTRY_INTERNAL,
    AbiMismatch = ffi::GANTRY_ABI_MISMATCH,
    LoadFailed = ffi::GANTRY_LOAD_FAILED,
}

impl Status {
    pub const ALL: [Status; 10] = [
        Status::Ok,
        Status::OomVram,
        Status::OomRam,
        Status::ModelCorrupt,
        Status::Timeout,
        Status::Cancelled,
        Status::Unsupported,
        Status::Internal,
        Status::AbiMismatch,
        Status::LoadFailed,
    ];

    /// Decode a wire value; unknown codes (a buggy plugin) become `Internal`.
    pub fn from_raw(raw: ffi::gantry_status_t) -> Status {
        Status::ALL
            .into_iter()
            .find(|s| *s as i32 == raw)
            .unwrap_or(Status::Internal)
    }

    pub fn as_raw(self) -> ffi::gantry_status_t {
        self as i32
    }

    /// Stable upper-case name, as in the specification (`OOM_VRAM`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::OomVram => "OOM_VRAM",
            Status::OomRam => "OOM_RAM",
            Status::ModelCorrupt => "MODEL_CORRUPT",
            Status::Timeout => "TIMEOUT",
            Status::Cancelled => "CANCELLED",
            Status::Unsupported => "UNSUPPORTED",
            Status::Internal => "INTERNAL",
            Status::AbiMismatch => "ABI_MISMATCH",
            Status::LoadFailed => "LOAD_FAILED",
        }
    }

    /// The specification's HTTP status for this code. This is the only place
    /// the mapping lives; the node's error responses call it.
    pub fn http_status(self) -> u16 {
        match self {
            Status::Ok => 200,
            Status::OomVram | Status::OomRam => 507,
            Status::ModelCorrupt => 500,
            Status::Timeout => 504,
            Status::Cancelled => 499,
            Status::Unsupported => 400,
            Status::Internal | Status::AbiMismatch | Status::LoadFailed => 500,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed engine call: the code plus the plugin's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineError {
    pub status: Status,
    pub message: String,
}

impl EngineError {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Status::Internal, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(Status::Unsupported, message)
    }
    /// This error as that of input `i` of a batch of `n` (`embed_batch`): the message names
    /// the input where there are several, and is left as it is for one.
    pub fn for_input(self, i: usize, n: usize) -> Self {
        match n {
            1 => self,
            _ => Self::new(self.status, format!("input {i}: {}", self.message)),
        }
    }
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for EngineError {}

/// Compute backend a plugin build targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Cpu,
    Cuda,
}

impl Backend {
    pub fn from_raw(raw: ffi::gantry_backend_t) -> Option<Backend> {
        match raw {
            ffi::GANTRY_BACKEND_CPU => Some(Backend::Cpu),
            ffi::GANTRY_BACKEND_CUDA => Some(Backend::Cuda),
            _ => None,
        }
    }
    pub fn as_raw(self) -> ffi::gantry_backend_t {
        match self {
            Backend::Cpu => ffi::GANTRY_BACKEND_CPU,
            Backend::Cuda => ffi::GANTRY_BACKEND_CUDA,
        }
    }
    /// The manifest spelling: `cpu` or `cuda`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
    pub fn parse(s: &str) -> Option<Backend> {
        match s {
            "cpu" => Some(Backend::Cpu),
            "cuda" => Some(Backend::Cuda),
            _ => None,
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Weight format of a registered model. Fixed at registration; never switched at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Gguf,
    Safetensors,
    /// Since ABI 1.10: an ONNX graph and the config beside it (a Piper voice).
    Onnx,
}

impl Format {
    pub fn from_raw(raw: ffi::gantry_format_t) -> Option<Format> {
        match raw {
            ffi::GANTRY_FORMAT_GGUF => Some(Format::Gguf),
            ffi::GANTRY_FORMAT_SAFETENSORS => Some(Format::Safetensors),
            ffi::GANTRY_FORMAT_ONNX => Some(Format::Onnx),
            _ => None,
        }
    }
    pub fn as_raw(self) -> ffi::gantry_format_t {
        match self {
            Format::Gguf => ffi::GANTRY_FORMAT_GGUF,
            Format::Safetensors => ffi::GANTRY_FORMAT_SAFETENSORS,
            Format::Onnx => ffi::GANTRY_FORMAT_ONNX,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Gguf => "gguf",
            Format::Safetensors => "safetensors",
            Format::Onnx => "onnx",
        }
    }
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "gguf" => Some(Format::Gguf),
            "safetensors" => Some(Format::Safetensors),
            "onnx" => Some(Format::Onnx),
            _ => None,
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Log severity of a plugin line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
}

impl LogLevel {
    pub fn from_raw(raw: ffi::gantry_log_level_t) -> LogLevel {
        match raw {
            ffi::GANTRY_LOG_ERROR => LogLevel::Error,
            ffi::GANTRY_LOG_WARN => LogLevel::Warn,
            ffi::GANTRY_LOG_INFO => LogLevel::Info,
            _ => LogLevel::Debug,
        }
    }
    pub fn as_raw(self) -> ffi::gantry_log_level_t {
        match self {
            LogLevel::Error => ffi::GANTRY_LOG_ERROR,
            LogLevel::Warn => ffi::GANTRY_LOG_WARN,
            LogLevel::Info => ffi::GANTRY_LOG_INFO,
            LogLevel::Debug => ffi::GANTRY_LOG_DEBUG,
        }
    }
}

/// What the plugin says about itself (from `info`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineInfo {
    pub engine_id: String,
    pub engine_version: String,
    pub backend: Option<Backend>,
    pub description: Option<String>,
    /// Since ABI 1.2: bit set of `ffi::GANTRY_CAP_*` (0 for older plugins).
    pub capabilities: u32,
    /// Since ABI 1.3: how this build uses the hardware (e.g. the CPU variant it runs and
    /// its SIMD extensions); `None` for older plugins or when the plugin says nothing.
    pub build_info: Option<String>,
}

impl EngineInfo {
    /// The plugin applies an allowed-token mask before sampling (`GANTRY_CAP_TOKEN_MASK`).
    pub fn supports_token_mask(&self) -> bool {
        self.capabilities & ffi::GANTRY_CAP_TOKEN_MASK != 0
    }

    /// The plugin samples at every position of an entry and truncates sequences
    /// (`GANTRY_CAP_SPECULATE`, ABI 1.5): the host may verify drafted tokens.
    pub fn supports_speculation(&self) -> bool {
        self.capabilities & ffi::GANTRY_CAP_SPECULATE != 0
    }

    /// The plugin loads LoRA adapters and runs each sequence with one (`GANTRY_CAP_ADAPTERS`,
    /// ABI 1.6).
    pub fn supports_adapters(&self) -> bool {
        self.capabilities & ffi::GANTRY_CAP_ADAPTERS != 0
    }
}

/// Engine-wide settings handed to `create`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub backend: Backend,
    pub device_ids: Vec<i32>,
    /// 0 = no limit beyond the device.
    pub vram_limit_bytes: u64,
    /// 0 = the plugin's choice.
    pub n_threads: u32,
    /// Most sequences open at once per model.
    pub max_batch_size: u32,
    /// Default per-sequence context; 0 = the model's trained length.
    pub context_length: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            backend: Backend::Cpu,
            device_ids: Vec::new(),
            vram_limit_bytes: 0,
            n_threads: 0,
            max_batch_size: 8,
            context_length: 4096,
        }
    }
}

/// What to load (`load_model`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelDescriptor {
    pub model_id: String,
    pub model_dir: PathBuf,
    pub primary_file: PathBuf,
    pub format: Format,
    pub quantization: Option<String>,
    pub mmproj: Option<PathBuf>,
    /// Per-sequence context; 0 = the engine config's default.
    pub context_length: u32,
    /// Sequences open at once; 0 = the engine config's `max_batch_size`.
    pub max_sequences: u32,
    /// Since ABI 1.3: the devices the host placed the model on (first = main); empty =
    /// the engine config's `device_ids`.
    pub device_ids: Vec<i32>,
    /// Since ABI 1.12: CPU threads for this model; 0 = the engine config's `n_threads`.
    pub n_threads: u32,
}

impl ModelDescriptor {
    /// `primary_file` in `format` as `model_id`, in the file's directory, with every other
    /// choice left to the engine config (context, sequences, devices, threads) and no
    /// quantization or projector.
    pub fn new(
        model_id: impl Into<String>,
        primary_file: impl Into<PathBuf>,
        format: Format,
    ) -> Self {
        let primary_file = primary_file.into();
        ModelDescriptor {
            model_id: model_id.into(),
            model_dir: primary_file
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
            primary_file,
            format,
            quantization: None,
            mmproj: None,
            context_length: 0,
            max_sequences: 0,
            device_ids: Vec::new(),
            n_threads: 0,
        }
    }

    /// The threads this model's work runs on: its own, else the engine config's (0 = the
    /// plugin's choice, as in [`EngineConfig::n_threads`]).
    pub fn threads_in(&self, config: &EngineConfig) -> u32 {
        if self.n_threads > 0 {
            self.n_threads
        } else {
            config.n_threads
        }
    }
}

/// A LoRA adapter to load next to a model (ABI 1.6 `adapter_load`).
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterDescriptor {
    /// The host's name for it, for messages.
    pub name: String,
    /// A GGUF LoRA file ([`Format::Gguf`]) or a PEFT directory ([`Format::Safetensors`]).
    pub path: PathBuf,
    pub format: Format,
    /// Multiplies the adapter's own `alpha / rank`.
    pub scale: f32,
}

/// What `adapter_load` returns: the plugin's id for the adapter and the memory it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadedAdapter {
    /// Nonzero; 0 names the base model in `seq_set_adapter`.
    pub id: u64,
    pub bytes: u64,
}

/// Facts about a loaded model (`model_info`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelInfo {
    pub architecture: String,
    pub vocab_size: u32,
    pub context_length: u32,
    pub trained_context_length: u32,
    pub kv_capacity_tokens: u64,
    pub max_sequences: u32,
    pub bos_token: Option<i32>,
    pub eos_token: Option<i32>,
    pub eog_tokens: Vec<i32>,
    pub bos_text: Option<String>,
    pub eos_text: Option<String>,
    pub chat_template: Option<String>,
    pub bytes_used: u64,
    /// Bit set of `ffi::GANTRY_MODALITY_*`.
    pub modalities: u32,
    pub embedding_dims: u32,
    pub add_bos: bool,
    /// Since ABI 1.7: bytes of recurrent state (state-space or short-convolution layers) one
    /// open sequence holds whatever its length; 0 with K/V only. Nonzero: no prefix reuse and
    /// no drafts (see [`ModelInfo::has_recurrent_state`]).
    pub recurrent_state_bytes: u64,
    /// Since ABI 1.9: the sample rate a transcription model takes its audio at
    /// ([`Input::Audio`]); 0 without audio.
    pub audio_sample_rate: u32,
    /// Since ABI 1.9: the most samples one [`Input::Audio`] may hold (Whisper: 30 s); the host
    /// cuts longer audio into windows.
    pub audio_max_samples: u64,
    /// Since ABI 1.10: a speech model's voices, the default first (empty without speech). A
    /// speech model produces its audio at `audio_sample_rate`.
    pub voices: Vec<String>,
}

impl ModelInfo {
    /// The model keeps a recurrent state per sequence: a verification entry's rejected drafts
    /// could not be cut back, so the host drafts nothing for it.
    pub fn has_recurrent_state(&self) -> bool {
        self.recurrent_state_bytes > 0
    }
    pub fn supports_completion(&self) -> bool {
        self.modalities & ffi::GANTRY_MODALITY_COMPLETION != 0
    }
    pub fn supports_embedding(&self) -> bool {
        self.modalities & ffi::GANTRY_MODALITY_EMBEDDING != 0
    }
    /// Audio in, text out (ABI 1.9): `seq_set_input` with [`Input::Audio`], then `step`.
    pub fn supports_transcription(&self) -> bool {
        self.modalities & ffi::GANTRY_MODALITY_TRANSCRIPTION != 0
    }
    /// Text in, audio out (ABI 1.10): `speech_open`, then `speech_next` until done.
    pub fn supports_speech(&self) -> bool {
        self.modalities & ffi::GANTRY_MODALITY_SPEECH != 0
    }
}

/// One speech synthesis (ABI 1.10 `speech_open`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpeechRequest<'a> {
    /// Never empty.
    pub text: &'a str,
    /// One of the model's [`ModelInfo::voices`]; `None`: the default (the first).
    pub voice: Option<&'a str>,
    /// Pace, 1 = the voice's own; within [0.25, 4].
    pub speed: f32,
}

/// One piece of a speech (ABI 1.10 `speech_next`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpeechPiece {
    /// Mono PCM in [-1, 1] at the model's `audio_sample_rate`.
    pub samples: Vec<f32>,
    /// The last piece.
    pub done: bool,
}

/// What a sequence is conditioned on (ABI 1.9 `seq_set_input`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Input<'a> {
    /// Mono PCM in [-1, 1] at `sample_rate` (the model's [`ModelInfo::audio_sample_rate`]).
    Audio {
        samples: &'a [f32],
        sample_rate: u32,
        /// Since ABI 1.11 (`GANTRY_INPUT_ALIGN`): keep what `seq_token_times` needs.
        align: bool,
    },
    /// 8-bit RGB pixels, rows top to bottom (declared: no engine takes images yet).
    Image {
        rgb: &'a [u8],
        width: u32,
        height: u32,
    },
}

impl Input<'_> {
    /// The kind's name, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Input::Audio { .. } => "audio",
            Input::Image { .. } => "image",
        }
    }
}

/// Per-sequence sampling parameters. Validated by the node before they get here.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// <= 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub penalty_last_n: i32,
    pub seed: u64,
    pub logit_bias: Vec<(i32, f32)>,
    pub top_logprobs: u32,
    pub want_logprob: bool,
}

impl Sampling {
    /// Argmax decoding with every filter and penalty off.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
            logit_bias: Vec::new(),
            top_logprobs: 0,
            want_logprob: false,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Self::greedy()
    }
}

/// One sequence's share of a step.
#[derive(Clone, Debug)]
pub struct StepEntry<'a> {
    pub seq: u64,
    pub tokens: &'a [i32],
    /// `Some` when a token must be sampled after `tokens`.
    pub sample: Option<&'a Sampling>,
    /// Since ABI 1.1 (`GANTRY_STEP_FRESH`): evaluate the sequence from scratch, taking no
    /// prefix from a cache, so reproducible sampling does not depend on what is cached.
    pub fresh: bool,
    /// Since ABI 1.2 (`gantry_sampling_t::allowed_tokens`): the tokens this step may sample,
    /// one bit per token (bit `t % 32` of word `t / 32`); `None` = every token. Only with
    /// `sample`, and only for plugins that declare `GANTRY_CAP_TOKEN_MASK`.
    pub allowed: Option<&'a [u32]>,
    /// Since ABI 1.5 (`GANTRY_STEP_SAMPLE_ALL`, only with `sample`, only for plugins that
    /// declare `GANTRY_CAP_SPECULATE`): sample after every token of `tokens`, not only the
    /// last; the entry then takes `tokens.len()` consecutive result slots.
    pub sample_all: bool,
}

impl StepEntry<'_> {
    /// A verification entry: it samples after every token (`sample_all` with `sample`).
    pub fn verifies(&self) -> bool {
        self.sample_all && self.sample.is_some()
    }

    /// How many result slots this entry takes: `tokens.len()` when it verifies, else one.
    pub fn result_slots(&self) -> usize {
        if self.verifies() {
            self.tokens.len()
        } else {
            1
        }
    }
}

/// Whether `token` is set in an allowed-token mask (see [`StepEntry::allowed`]); tokens past
/// the mask's last word are not allowed.
pub fn token_allowed(mask: &[u32], token: i32) -> bool {
    usize::try_from(token)
        .ok()
        .and_then(|t| mask.get(t / 32).map(|w| w & (1 << (t % 32)) != 0))
        .unwrap_or(false)
}

/// A sampled token with its log probability and the top alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct SampledToken {
    pub token: i32,
    /// NaN when not asked for.
    pub logprob: f32,
    pub top: Vec<(i32, f32)>,
}

/// `MAJOR.MINOR.PATCH` with digits only: the manifest's and EnginePlugin's
/// `version` rule, shared by the node and the operator.
pub fn is_semver(v: &str) -> bool {
    let parts: Vec<&str> = v.split('.').collect();
    parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}
