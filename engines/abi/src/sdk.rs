//! Engine ABI, plugin side: safe traits for Rust engine authors and the glue that exports them.
//!
//! A plugin implements [`Engine`] and [`Model`] and calls
//! [`declare_engine!`](crate::declare_engine). The macro exports
//! `gantry_engine_entry`, whose vtable points at the generic `extern "C"`
//! shims ([`vtable`], in `sdk/shims.rs`; adapters, media and counters in `sdk/adapters.rs`,
//! `sdk/media.rs` and `sdk/counters.rs`). Every shim runs the trait method inside
//! `catch_unwind` (`sdk/guard.rs`), so a panic becomes `GANTRY_INTERNAL` with the panic
//! message and never unwinds into the host (since Rust 1.81 that would abort the whole
//! node). The C structs are read and written in `sdk/convert.rs`.

use std::ffi::{CString, c_char, c_void};

use crate::ffi;
use crate::types::*;

mod adapters;
mod convert;
mod counters;
mod guard;
mod media;
mod shims;

pub use convert::{allowed_from_c, sampling_from_c, write_error};
pub use shims::{entry, vtable};

/// A plugin's engine: created once per node process, loads models.
pub trait Engine: Send + Sync + Sized + 'static {
    type Model: Model;

    /// Must equal the manifest's `id`.
    const ID: &'static str;
    /// Semantic version; must equal the manifest's `version`.
    const VERSION: &'static str;
    const BACKEND: Backend;
    const DESCRIPTION: &'static str;
    /// Optional features (`ffi::GANTRY_CAP_*`, since ABI 1.2). An engine that sets
    /// `GANTRY_CAP_TOKEN_MASK` must honour [`StepEntry::allowed`] in `step`.
    const CAPABILITIES: u32 = 0;

    /// How this build uses the hardware, one line (since ABI 1.3): for example the CPU
    /// variant the library picked for this machine and its SIMD extensions. Asked once,
    /// when the host first reads the engine's info, before `create`.
    fn build_info() -> String {
        String::new()
    }

    fn create(config: EngineConfig, log: HostLog) -> Result<Self, EngineError>;

    /// Load a model. On failure nothing may stay allocated.
    fn load_model(&self, desc: &ModelDescriptor) -> Result<Self::Model, EngineError>;
}

/// A loaded model. `info`, `tokenize` and `detokenize` may run concurrently
/// with `step` (see the header's THREADING section), hence `&self` + `Sync`.
pub trait Model: Send + Sync + 'static {
    /// Called once right after load; the result is cached for the model's life.
    fn info(&self) -> ModelInfo;
    fn tokenize(
        &self,
        text: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError>;
    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError>;
    fn seq_open(&self) -> Result<u64, EngineError>;
    fn seq_release(&self, seq: u64);
    /// One forward pass. Returns one slot per entry (`tokens.len()` slots for an entry with
    /// [`StepEntry::sample_all`], see [`StepEntry::result_slots`]): `Some` exactly for the
    /// entries that asked for a sample.
    fn step(&self, entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError>;
    fn embed(&self, tokens: &[i32]) -> Result<Vec<f32>, EngineError>;
    /// Embed several inputs at once (since ABI 1.8, `embed_batch`): one vector per input, in
    /// order. An engine that can run them as one batch overrides it; the default embeds them
    /// one by one, and a failing input fails the call with its index (where there are
    /// several).
    fn embed_batch(&self, inputs: &[&[i32]]) -> Result<Vec<Vec<f32>>, EngineError> {
        inputs
            .iter()
            .enumerate()
            .map(|(i, t)| self.embed(t).map_err(|e| e.for_input(i, inputs.len())))
            .collect()
    }
    /// How many tokens of `seq`'s first entry came from a cache instead of being evaluated
    /// (since ABI 1.4, `seq_cached_tokens`); `None` when unknown. The host asks after the step
    /// that carried the first entry. The default reports nothing, as a 1.3 plugin does.
    fn seq_cached_tokens(&self, _seq: u64) -> Option<u64> {
        None
    }
    /// A new sequence whose KV holds what `src`'s holds (since ABI 1.5, `seq_fork`); the host
    /// uses it for `n` > 1, so a prompt is evaluated once. The default refuses, and the host
    /// evaluates the prompt once per sequence instead.
    fn seq_fork(&self, _src: u64) -> Result<u64, EngineError> {
        Err(EngineError::unsupported(
            "this engine does not fork sequences",
        ))
    }
    /// Keep the first `n_keep` tokens of `seq` and forget the rest, with the samples taken
    /// after them (since ABI 1.5, `seq_truncate`; required with `GANTRY_CAP_SPECULATE`).
    fn seq_truncate(&self, _seq: u64, _n_keep: usize) -> Result<(), EngineError> {
        Err(EngineError::unsupported(
            "this engine does not truncate sequences",
        ))
    }
    /// Load a LoRA adapter (since ABI 1.6, `adapter_load`; required with
    /// `GANTRY_CAP_ADAPTERS`). A mismatch with the base is `LoadFailed` naming the tensor.
    fn adapter_load(&self, _desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        Err(EngineError::unsupported(
            "this engine serves no LoRA adapters",
        ))
    }
    /// Free an adapter no open sequence uses (since ABI 1.6).
    fn adapter_unload(&self, _adapter: u64) {}
    /// Run `seq` with `adapter` (0 = the base model) from its first step on (since ABI 1.6).
    fn seq_set_adapter(&self, _seq: u64, _adapter: u64) -> Result<(), EngineError> {
        Err(EngineError::unsupported(
            "this engine serves no LoRA adapters",
        ))
    }
    /// Condition `seq` on `input` before its first step (since ABI 1.9, `seq_set_input`;
    /// required with `GANTRY_MODALITY_TRANSCRIPTION`). The default refuses.
    fn seq_set_input(&self, _seq: u64, input: &Input<'_>) -> Result<(), EngineError> {
        Err(EngineError::unsupported(format!(
            "this model takes no {} input",
            input.kind()
        )))
    }
    /// Start synthesizing `req` (since ABI 1.10, `speech_open`; required with
    /// `GANTRY_MODALITY_SPEECH`): check the voice and the text, cut it into pieces, return a
    /// nonzero handle. Nothing is synthesized yet. The default refuses.
    fn speech_open(&self, _req: &SpeechRequest<'_>) -> Result<u64, EngineError> {
        Err(EngineError::unsupported(
            "this model does not synthesize speech",
        ))
    }
    /// Synthesize the next piece of `speech` (since ABI 1.10, `speech_next`).
    fn speech_next(&self, _speech: u64) -> Result<SpeechPiece, EngineError> {
        Err(EngineError::unsupported(
            "this model does not synthesize speech",
        ))
    }
    /// Free `speech`, finished or not (since ABI 1.10, `speech_close`).
    fn speech_close(&self, _speech: u64) {}
    /// When in its input each token fed to `seq` from position `first` (after the input) on
    /// is spoken, in seconds (since ABI 1.11, `seq_token_times`), for a sequence whose input
    /// asked for it ([`Input::Audio`]'s `align`). The default refuses.
    fn seq_token_times(&self, _seq: u64, _first: usize) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::unsupported(
            "this model does not align its tokens with its input",
        ))
    }
    /// The probability of `token` right after the first `n_fed` tokens fed to `seq`, under the
    /// model's raw distribution (since ABI 1.11, `seq_token_prob`). The default refuses.
    fn seq_token_prob(&self, _seq: u64, _n_fed: usize, _token: i32) -> Result<f32, EngineError> {
        Err(EngineError::unsupported(
            "this model does not report a token's probability",
        ))
    }
    /// The model's event counters, each cumulative since load (since ABI 1.12,
    /// `model_counters`): short snake_case names the host reports as
    /// `gantry_engine_events_total{event=...}`. Called between steps about once a second, so
    /// it should only read. The default has none.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

/// The host's log callback, safe to call from any thread.
#[derive(Clone, Copy)]
pub struct HostLog {
    ctx: *mut c_void,
    log: Option<unsafe extern "C" fn(*mut c_void, ffi::gantry_log_level_t, *const c_char)>,
}

// SAFETY: the header guarantees the host's log callback and its ctx may be
// used from any plugin thread until `destroy` returns.
unsafe impl Send for HostLog {}
// SAFETY: as above; the callback is re-entrant by contract.
unsafe impl Sync for HostLog {}

impl HostLog {
    /// A logger that drops every line (for tests and hosts without a callback).
    pub fn discard() -> Self {
        Self {
            ctx: std::ptr::null_mut(),
            log: None,
        }
    }

    pub fn log(&self, level: LogLevel, message: &str) {
        let Some(log) = self.log else { return };
        // Interior NULs would truncate the line; replace them instead.
        let line = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
        // SAFETY: `log` and `ctx` come from the host's gantry_host_api_t, valid
        // until destroy; `line` outlives the call.
        unsafe { log(self.ctx, level.as_raw(), line.as_ptr()) }
    }
}

/// Export an [`Engine`] implementation as a Gantry plugin.
///
/// ```text
/// gantry_engine_abi::declare_engine!(MyEngine);
/// ```
/// expands to the `gantry_engine_entry` symbol returning a static entry whose
/// vtable calls `MyEngine` through panic-catching shims.
#[macro_export]
macro_rules! declare_engine {
    ($engine:ty) => {
        static GANTRY_ENGINE_VTABLE: $crate::ffi::gantry_engine_vtable_t =
            $crate::sdk::vtable::<$engine>();
        static GANTRY_ENGINE_ENTRY: $crate::ffi::gantry_engine_entry_t =
            $crate::sdk::entry(&GANTRY_ENGINE_VTABLE);

        /// The plugin's one exported symbol (see gantry_engine.h).
        #[unsafe(no_mangle)]
        pub extern "C" fn gantry_engine_entry() -> *const $crate::ffi::gantry_engine_entry_t {
            &GANTRY_ENGINE_ENTRY
        }
    };
}
