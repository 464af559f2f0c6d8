//! Engine ABI, wire level: `repr(C)` mirrors of `include/gantry_engine.h`, shared by the host and plugins.
//!
//! Every item here mirrors one in the header with the same layout; the
//! `layout` test compiles the header with the system C compiler and compares
//! every size and offset. Change the header first, then this file.

use std::ffi::{c_char, c_void};

pub const GANTRY_ABI_MAJOR: u32 = 1;
pub const GANTRY_ABI_MINOR: u32 = 12;
/// Name of the one exported symbol (with its NUL, as `dlsym` wants it).
pub const GANTRY_ENGINE_ENTRY_SYMBOL: &[u8] = b"gantry_engine_entry\0";
pub const GANTRY_ERROR_MESSAGE_MAX: usize = 1024;
pub const GANTRY_MAX_TOP_LOGPROBS: usize = 20;

pub type gantry_status_t = i32;
pub const GANTRY_OK: gantry_status_t = 0;
pub const GANTRY_OOM_VRAM: gantry_status_t = 1;
pub const GANTRY_OOM_RAM: gantry_status_t = 2;
pub const GANTRY_MODEL_CORRUPT: gantry_status_t = 3;
pub const GANTRY_TIMEOUT: gantry_status_t = 4;
pub const GANTRY_CANCELLED: gantry_status_t = 5;
pub const GANTRY_UNSUPPORTED: gantry_status_t = 6;
pub const GANTRY_INTERNAL: gantry_status_t = 7;
pub const GANTRY_ABI_MISMATCH: gantry_status_t = 8;
pub const GANTRY_LOAD_FAILED: gantry_status_t = 9;

pub type gantry_backend_t = u32;
pub const GANTRY_BACKEND_CPU: gantry_backend_t = 0;
pub const GANTRY_BACKEND_CUDA: gantry_backend_t = 1;

pub type gantry_format_t = u32;
pub const GANTRY_FORMAT_GGUF: gantry_format_t = 0;
pub const GANTRY_FORMAT_SAFETENSORS: gantry_format_t = 1;
/// Since 1.10: an ONNX graph with its config beside it.
pub const GANTRY_FORMAT_ONNX: gantry_format_t = 2;

pub type gantry_log_level_t = u32;
pub const GANTRY_LOG_ERROR: gantry_log_level_t = 0;
pub const GANTRY_LOG_WARN: gantry_log_level_t = 1;
pub const GANTRY_LOG_INFO: gantry_log_level_t = 2;
pub const GANTRY_LOG_DEBUG: gantry_log_level_t = 3;

pub type gantry_modality_t = u32;
pub const GANTRY_MODALITY_COMPLETION: gantry_modality_t = 1;
pub const GANTRY_MODALITY_EMBEDDING: gantry_modality_t = 2;
/// Since ABI 1.9: audio in, text out (`seq_set_input`, then `step`).
pub const GANTRY_MODALITY_TRANSCRIPTION: gantry_modality_t = 4;
/// Since ABI 1.9 declared, 1.10 served: text in, audio out (`speech_open`, `speech_next`).
pub const GANTRY_MODALITY_SPEECH: gantry_modality_t = 8;
/// Since ABI 1.9, declared: image in, text out.
pub const GANTRY_MODALITY_VISION: gantry_modality_t = 16;
/// Since ABI 1.9, declared: text in, image out.
pub const GANTRY_MODALITY_IMAGE: gantry_modality_t = 32;

pub type gantry_input_kind_t = u32;
/// Since ABI 1.9: mono f32 PCM at the model's `audio_sample_rate`.
pub const GANTRY_INPUT_AUDIO: gantry_input_kind_t = 1;
/// Since ABI 1.9, declared: 8-bit RGB pixels.
pub const GANTRY_INPUT_IMAGE: gantry_input_kind_t = 2;
/// Since 1.11: keep what `seq_token_times` needs for the tokens fed after this input.
pub const GANTRY_INPUT_ALIGN: u64 = 1;

pub type gantry_capability_t = u32;
/// Since ABI 1.2: `step` honours `gantry_sampling_t::allowed_tokens` (see the header).
pub const GANTRY_CAP_TOKEN_MASK: gantry_capability_t = 1;
/// Since ABI 1.5: `step` honours `GANTRY_STEP_SAMPLE_ALL` and `seq_truncate` works.
pub const GANTRY_CAP_SPECULATE: gantry_capability_t = 2;
/// Since ABI 1.6: `adapter_load`, `adapter_unload` and `seq_set_adapter` work.
pub const GANTRY_CAP_ADAPTERS: gantry_capability_t = 4;

pub const GANTRY_STEP_SAMPLE: u32 = 1;
/// Since ABI 1.1: take no cached prefix for this entry's sequence (see the header).
pub const GANTRY_STEP_FRESH: u32 = 2;
/// Since ABI 1.5: sample after every token of this entry (see the header).
pub const GANTRY_STEP_SAMPLE_ALL: u32 = 4;

/// Opaque engine handle (plugin-allocated).
#[repr(C)]
pub struct gantry_engine_t {
    _private: [u8; 0],
}

/// Opaque model handle (plugin-allocated).
#[repr(C)]
pub struct gantry_model_t {
    _private: [u8; 0],
}

#[repr(C)]
pub struct gantry_error_t {
    pub message: [c_char; GANTRY_ERROR_MESSAGE_MAX],
}

#[repr(C)]
pub struct gantry_engine_info_t {
    pub struct_size: u32,
    pub engine_id: *const c_char,
    pub engine_version: *const c_char,
    pub backend: gantry_backend_t,
    pub description: *const c_char,
    /// Since 1.2.
    pub capabilities: gantry_capability_t,
    /// Since 1.3.
    pub build_info: *const c_char,
}

#[repr(C)]
pub struct gantry_host_api_t {
    pub struct_size: u32,
    pub ctx: *mut c_void,
    pub log: Option<unsafe extern "C" fn(*mut c_void, gantry_log_level_t, *const c_char)>,
}

#[repr(C)]
pub struct gantry_engine_config_t {
    pub struct_size: u32,
    pub backend: gantry_backend_t,
    pub device_ids: *const i32,
    pub n_device_ids: usize,
    pub vram_limit_bytes: u64,
    pub n_threads: u32,
    pub max_batch_size: u32,
    pub context_length: u32,
}

#[repr(C)]
pub struct gantry_model_desc_t {
    pub struct_size: u32,
    pub model_id: *const c_char,
    pub model_dir: *const c_char,
    pub primary_file: *const c_char,
    pub format: gantry_format_t,
    pub quantization: *const c_char,
    pub mmproj: *const c_char,
    pub context_length: u32,
    pub max_sequences: u32,
    /// Since 1.3.
    pub device_ids: *const i32,
    /// Since 1.3.
    pub n_device_ids: usize,
    /// Since 1.12: 0 = the engine config's `n_threads`.
    pub n_threads: u32,
}

/// Since 1.6.
#[repr(C)]
pub struct gantry_adapter_desc_t {
    pub struct_size: u32,
    pub name: *const c_char,
    pub path: *const c_char,
    pub format: gantry_format_t,
    pub scale: f32,
}

#[repr(C)]
pub struct gantry_model_info_t {
    pub struct_size: u32,
    pub architecture: *const c_char,
    pub vocab_size: u32,
    pub context_length: u32,
    pub trained_context_length: u32,
    pub kv_capacity_tokens: u64,
    pub max_sequences: u32,
    pub bos_token: i32,
    pub eos_token: i32,
    pub eog_tokens: *const i32,
    pub n_eog_tokens: usize,
    pub bos_text: *const c_char,
    pub eos_text: *const c_char,
    pub chat_template: *const c_char,
    pub bytes_used: u64,
    pub modalities: gantry_modality_t,
    pub embedding_dims: u32,
    pub add_bos: bool,
    /// Since 1.7.
    pub recurrent_state_bytes: u64,
    /// Since 1.9.
    pub audio_sample_rate: u32,
    /// Since 1.9.
    pub audio_max_samples: u64,
    /// Since 1.10: voice names separated by `\n`, or null.
    pub voices: *const c_char,
}

/// Since 1.10.
#[repr(C)]
pub struct gantry_speech_request_t {
    pub struct_size: u32,
    pub text: *const c_char,
    pub n_text: usize,
    pub voice: *const c_char,
    pub speed: f32,
}

/// Since 1.9.
#[repr(C)]
pub struct gantry_input_t {
    pub struct_size: u32,
    pub kind: gantry_input_kind_t,
    pub data: *const c_void,
    pub n: usize,
    pub sample_rate: u32,
    pub width: u32,
    pub height: u32,
    /// Since 1.11: 64 bits, so that it starts past the 1.9 struct's tail padding.
    pub flags: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct gantry_logit_bias_t {
    pub token: i32,
    pub bias: f32,
}

#[repr(C)]
pub struct gantry_sampling_t {
    pub struct_size: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub penalty_last_n: i32,
    pub seed: u64,
    pub logit_bias: *const gantry_logit_bias_t,
    pub n_logit_bias: usize,
    pub top_logprobs: u32,
    pub want_logprob: bool,
    /// Since 1.2: the allowed-token bitmask, or null.
    pub allowed_tokens: *const u32,
    pub n_allowed_words: usize,
}

#[repr(C)]
pub struct gantry_step_entry_t {
    pub seq: u64,
    pub tokens: *const i32,
    pub n_tokens: usize,
    pub flags: u32,
    pub sampling: *const gantry_sampling_t,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct gantry_token_logprob_t {
    pub token: i32,
    pub logprob: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct gantry_step_result_t {
    pub token: i32,
    pub logprob: f32,
    pub n_top: u32,
    pub top: [gantry_token_logprob_t; GANTRY_MAX_TOP_LOGPROBS],
}

impl Default for gantry_step_result_t {
    fn default() -> Self {
        Self {
            token: -1,
            logprob: f32::NAN,
            n_top: 0,
            top: [gantry_token_logprob_t::default(); GANTRY_MAX_TOP_LOGPROBS],
        }
    }
}

pub type InfoFn = unsafe extern "C" fn(*mut gantry_engine_info_t);
pub type CreateFn = unsafe extern "C" fn(
    *const gantry_engine_config_t,
    *const gantry_host_api_t,
    *mut *mut gantry_engine_t,
    *mut gantry_error_t,
) -> gantry_status_t;
pub type DestroyFn = unsafe extern "C" fn(*mut gantry_engine_t);
pub type LoadModelFn = unsafe extern "C" fn(
    *mut gantry_engine_t,
    *const gantry_model_desc_t,
    *mut *mut gantry_model_t,
    *mut gantry_error_t,
) -> gantry_status_t;
pub type ModelInfoFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *mut gantry_model_info_t,
    *mut gantry_error_t,
) -> gantry_status_t;
pub type TokenizeFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *const c_char,
    usize,
    bool,
    bool,
    *mut i32,
    usize,
    *mut usize,
    *mut gantry_error_t,
) -> gantry_status_t;
pub type DetokenizeFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *const i32,
    usize,
    bool,
    *mut c_char,
    usize,
    *mut usize,
    *mut gantry_error_t,
) -> gantry_status_t;
pub type SeqOpenFn =
    unsafe extern "C" fn(*mut gantry_model_t, *mut u64, *mut gantry_error_t) -> gantry_status_t;
pub type SeqReleaseFn = unsafe extern "C" fn(*mut gantry_model_t, u64);
pub type StepFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *const gantry_step_entry_t,
    usize,
    *mut gantry_step_result_t,
    *mut gantry_error_t,
) -> gantry_status_t;
pub type EmbedFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *const i32,
    usize,
    *mut f32,
    usize,
    *mut usize,
    *mut gantry_error_t,
) -> gantry_status_t;
pub type UnloadModelFn = unsafe extern "C" fn(*mut gantry_model_t);
/// Since 1.4: cached tokens of a sequence's first entry, or -1 when unknown.
pub type SeqCachedTokensFn = unsafe extern "C" fn(*mut gantry_model_t, u64) -> i64;
/// Since 1.5: a new sequence holding what `src`'s KV holds.
pub type SeqForkFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    u64,
    *mut u64,
    *mut gantry_error_t,
) -> gantry_status_t;
/// Since 1.5: keep the first `n_keep` tokens of a sequence.
pub type SeqTruncateFn =
    unsafe extern "C" fn(*mut gantry_model_t, u64, u64, *mut gantry_error_t) -> gantry_status_t;
/// Since 1.6: load a LoRA adapter next to a model.
pub type AdapterLoadFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *const gantry_adapter_desc_t,
    *mut u64,
    *mut u64,
    *mut gantry_error_t,
) -> gantry_status_t;
/// Since 1.6: free an adapter.
pub type AdapterUnloadFn = unsafe extern "C" fn(*mut gantry_model_t, u64);
/// Since 1.6: run a sequence with an adapter (0 = the base model).
pub type SeqSetAdapterFn =
    unsafe extern "C" fn(*mut gantry_model_t, u64, u64, *mut gantry_error_t) -> gantry_status_t;
/// Since 1.8: embed several inputs in one call (tokens, lengths, n_inputs, out, capacity, dims).
pub type EmbedBatchFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *const i32,
    *const usize,
    usize,
    *mut f32,
    usize,
    *mut usize,
    *mut gantry_error_t,
) -> gantry_status_t;

/// Since 1.9: condition a sequence on an input (audio for a transcription model).
pub type SeqSetInputFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    u64,
    *const gantry_input_t,
    *mut gantry_error_t,
) -> gantry_status_t;

/// Since 1.10: start a speech synthesis.
pub type SpeechOpenFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *const gantry_speech_request_t,
    *mut u64,
    *mut gantry_error_t,
) -> gantry_status_t;
/// Since 1.10: the next piece of a speech (samples, n, done).
pub type SpeechNextFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    u64,
    *mut *const f32,
    *mut usize,
    *mut bool,
    *mut gantry_error_t,
) -> gantry_status_t;
/// Since 1.10: free a speech.
pub type SpeechCloseFn = unsafe extern "C" fn(*mut gantry_model_t, u64);
pub type SeqTokenProbFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    u64,
    usize,
    i32,
    *mut f32,
    *mut gantry_error_t,
) -> gantry_status_t;
pub type SeqTokenTimesFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    u64,
    usize,
    *mut f32,
    usize,
    *mut usize,
    *mut gantry_error_t,
) -> gantry_status_t;

/// Since 1.12: one of a model's event counters.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct gantry_counter_t {
    pub name: *const c_char,
    pub value: u64,
}
/// Since 1.12: the model's counters (array, n), plugin-owned until the next call.
pub type ModelCountersFn = unsafe extern "C" fn(
    *mut gantry_model_t,
    *mut *const gantry_counter_t,
    *mut usize,
    *mut gantry_error_t,
) -> gantry_status_t;

#[repr(C)]
pub struct gantry_engine_vtable_t {
    pub struct_size: u32,
    pub info: Option<InfoFn>,
    pub create: Option<CreateFn>,
    pub destroy: Option<DestroyFn>,
    pub load_model: Option<LoadModelFn>,
    pub model_info: Option<ModelInfoFn>,
    pub tokenize: Option<TokenizeFn>,
    pub detokenize: Option<DetokenizeFn>,
    pub seq_open: Option<SeqOpenFn>,
    pub seq_release: Option<SeqReleaseFn>,
    pub step: Option<StepFn>,
    pub embed: Option<EmbedFn>,
    pub unload_model: Option<UnloadModelFn>,
    /// Since 1.4; optional.
    pub seq_cached_tokens: Option<SeqCachedTokensFn>,
    /// Since 1.5; optional.
    pub seq_fork: Option<SeqForkFn>,
    /// Since 1.5; required with `GANTRY_CAP_SPECULATE`.
    pub seq_truncate: Option<SeqTruncateFn>,
    /// Since 1.6; required with `GANTRY_CAP_ADAPTERS`.
    pub adapter_load: Option<AdapterLoadFn>,
    /// Since 1.6; required with `GANTRY_CAP_ADAPTERS`.
    pub adapter_unload: Option<AdapterUnloadFn>,
    /// Since 1.6; required with `GANTRY_CAP_ADAPTERS`.
    pub seq_set_adapter: Option<SeqSetAdapterFn>,
    /// Since 1.8; optional.
    pub embed_batch: Option<EmbedBatchFn>,
    /// Since 1.9; required with `GANTRY_MODALITY_TRANSCRIPTION`.
    pub seq_set_input: Option<SeqSetInputFn>,
    /// Since 1.10; required with `GANTRY_MODALITY_SPEECH`.
    pub speech_open: Option<SpeechOpenFn>,
    /// Since 1.10; required with `GANTRY_MODALITY_SPEECH`.
    pub speech_next: Option<SpeechNextFn>,
    /// Since 1.10; required with `GANTRY_MODALITY_SPEECH`.
    pub speech_close: Option<SpeechCloseFn>,
    /// Since 1.11.
    pub seq_token_times: Option<SeqTokenTimesFn>,
    /// Since 1.11.
    pub seq_token_prob: Option<SeqTokenProbFn>,
    /// Since 1.12; optional.
    pub model_counters: Option<ModelCountersFn>,
}

#[repr(C)]
pub struct gantry_engine_entry_t {
    pub abi_major: u32,
    pub abi_minor: u32,
    pub struct_size: u32,
    pub vtable: *const gantry_engine_vtable_t,
}

// SAFETY: the entry and vtable are immutable statics holding function
// pointers; sharing them between threads is what the ABI intends.
#[allow(unsafe_code)]
unsafe impl Sync for gantry_engine_entry_t {}
// SAFETY: as above, the vtable only holds function pointers and a size.
#[allow(unsafe_code)]
unsafe impl Sync for gantry_engine_vtable_t {}

pub type EntryFn = unsafe extern "C" fn() -> *const gantry_engine_entry_t;
