//! Engine host, a loaded model's calls (the scheduler's step and the tokenizer's calls land
//! here): two handles that encode the header's threading rules in types, over two
//! implementations of each call group — the plugin in this process (`plugin/local.rs`) and
//! the model's worker process (`worker/remote.rs`).
//!
//! [`ModelShared`] (`info`/`tokenize`/`detokenize`) may be called from any thread;
//! [`ModelExec`] (`seq_*`/`step`/`embed`) is owned by one scheduler and takes `&mut self`.
//! The plugin's `unload_model` runs (or the worker is killed) when the last of the two is
//! dropped.

use std::sync::Arc;

use gantry_api::WorkerCrash;
use gantry_engine_abi::{
    AdapterDescriptor, EngineError, EngineInfo, Input, LoadedAdapter, ModelInfo, SampledToken,
    SpeechPiece, SpeechRequest, StepEntry,
};

/// The calls any thread may make at any time.
pub(crate) trait SharedCalls: Send + Sync {
    /// The plugin that serves the model.
    fn plugin(&self) -> &EngineInfo;
    /// The worker process serving the model (`process` isolation).
    fn worker_pid(&self) -> Option<u32>;
    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError>;
    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError>;
    /// Each token's bytes on its own; one call per token unless the implementation batches.
    fn detokenize_each(
        &self,
        tokens: &[i32],
        render_special: bool,
    ) -> Result<Vec<Vec<u8>>, EngineError> {
        tokens
            .iter()
            .map(|t| self.detokenize(&[*t], render_special))
            .collect()
    }
}

/// The calls only the model's scheduler makes, never concurrently.
pub(crate) trait ExecCalls: Send {
    fn seq_open(&mut self) -> Result<u64, EngineError>;
    fn seq_release(&mut self, seq: u64);
    fn step(&mut self, entries: &[StepEntry<'_>])
    -> Result<Vec<Option<SampledToken>>, EngineError>;
    fn seq_cached_tokens(&mut self, seq: u64) -> Option<u64>;
    /// ABI 1.5 `seq_fork`; `Unsupported` when the plugin lacks it.
    fn seq_fork(&mut self, src: u64) -> Result<u64, EngineError>;
    /// ABI 1.5 `seq_truncate`; `Unsupported` when the plugin lacks it.
    fn seq_truncate(&mut self, seq: u64, n_keep: u64) -> Result<(), EngineError>;
    /// ABI 1.6 `adapter_load`; `Unsupported` when the plugin lacks it.
    fn adapter_load(&mut self, desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError>;
    /// ABI 1.6 `adapter_unload`; nothing when the plugin lacks it.
    fn adapter_unload(&mut self, adapter: u64);
    /// ABI 1.6 `seq_set_adapter`; `Unsupported` when the plugin lacks it.
    fn seq_set_adapter(&mut self, seq: u64, adapter: u64) -> Result<(), EngineError>;
    /// ABI 1.9 `seq_set_input`; `Unsupported` when the plugin lacks it.
    fn seq_set_input(&mut self, seq: u64, input: &Input<'_>) -> Result<(), EngineError>;
    /// ABI 1.10 `speech_open`; `Unsupported` when the plugin lacks it.
    fn speech_open(&mut self, req: &SpeechRequest<'_>) -> Result<u64, EngineError>;
    /// ABI 1.10 `speech_next`; `Unsupported` when the plugin lacks it.
    fn speech_next(&mut self, speech: u64) -> Result<SpeechPiece, EngineError>;
    /// ABI 1.10 `speech_close`; nothing when the plugin lacks it.
    fn speech_close(&mut self, speech: u64);
    /// ABI 1.11 `seq_token_times`; `Unsupported` when the plugin lacks it.
    fn seq_token_times(&mut self, seq: u64, first: usize) -> Result<Vec<f32>, EngineError>;
    /// ABI 1.11 `seq_token_prob`; `Unsupported` when the plugin lacks it.
    fn seq_token_prob(&mut self, seq: u64, n_fed: usize, token: i32) -> Result<f32, EngineError>;
    /// ABI 1.12 `model_counters`; none when the plugin lacks it.
    fn counters(&mut self) -> Result<Vec<(String, u64)>, EngineError>;
    /// One vector per input, in order (ABI 1.8 `embed_batch`, or `embed` once per input where
    /// the plugin lacks it). `dims` is the model's embedding size, the first guess of one
    /// vector's length.
    fn embed_batch(
        &mut self,
        inputs: &[Vec<i32>],
        dims: usize,
    ) -> Result<Vec<Vec<f32>>, EngineError>;
    /// The worker process under the calls (`process` isolation).
    fn worker(&self) -> Option<Arc<dyn WorkerProcess>> {
        None
    }
}

/// A model's worker process, as a watchdog and the crash path see it.
pub trait WorkerProcess: Send + Sync {
    fn pid(&self) -> u32;
    /// The crash that ended it; `None` while it runs or when the node stopped it.
    fn crash(&self) -> Option<WorkerCrash>;
    /// Kill it because a step overran (its crash then says `hung`).
    fn kill_hung(&self);
}

/// Calls on a model that any thread may make at any time.
pub struct ModelShared {
    calls: Box<dyn SharedCalls>,
    info: ModelInfo,
}

impl std::fmt::Debug for ModelShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelShared")
            .field("info", &self.info)
            .finish()
    }
}

impl ModelShared {
    pub(crate) fn new(calls: Box<dyn SharedCalls>, info: ModelInfo) -> Self {
        Self { calls, info }
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn plugin_id(&self) -> &str {
        &self.calls.plugin().engine_id
    }

    /// Whether the plugin applies allowed-token masks (`GANTRY_CAP_TOKEN_MASK`, ABI 1.2).
    pub fn supports_token_mask(&self) -> bool {
        self.calls.plugin().supports_token_mask()
    }

    /// Whether the plugin verifies drafted tokens in one step (`GANTRY_CAP_SPECULATE`, ABI 1.5).
    pub fn supports_speculation(&self) -> bool {
        self.calls.plugin().supports_speculation()
    }

    /// Whether the plugin loads LoRA adapters (`GANTRY_CAP_ADAPTERS`, ABI 1.6).
    pub fn supports_adapters(&self) -> bool {
        self.calls.plugin().supports_adapters()
    }

    /// The worker process serving this model (`process` isolation).
    pub fn worker_pid(&self) -> Option<u32> {
        self.calls.worker_pid()
    }

    /// Each token's bytes on its own (a vocabulary): one call per token in-process, one
    /// round trip for all of them to a worker.
    pub fn detokenize_each(
        &self,
        tokens: &[i32],
        render_special: bool,
    ) -> Result<Vec<Vec<u8>>, EngineError> {
        self.calls.detokenize_each(tokens, render_special)
    }

    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        self.calls.tokenize(text, add_special, parse_special)
    }

    /// Raw bytes of `tokens`; may end inside a UTF-8 character.
    pub fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        self.calls.detokenize(tokens, render_special)
    }
}

/// Calls that only the model's scheduler makes (never concurrently).
pub struct ModelExec {
    calls: Box<dyn ExecCalls>,
    shared: Arc<ModelShared>,
}

impl std::fmt::Debug for ModelExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelExec")
            .field("model", &self.shared.info.architecture)
            .finish()
    }
}

impl ModelExec {
    pub(crate) fn new(calls: Box<dyn ExecCalls>, shared: Arc<ModelShared>) -> Self {
        Self { calls, shared }
    }

    pub fn shared(&self) -> &Arc<ModelShared> {
        &self.shared
    }

    /// The worker crash that ended this model, if it runs in one that crashed.
    pub fn crashed(&self) -> Option<WorkerCrash> {
        self.calls.worker().and_then(|w| w.crash())
    }

    /// Its worker, which the watchdog may kill (`process` isolation).
    pub fn worker(&self) -> Option<Arc<dyn WorkerProcess>> {
        self.calls.worker()
    }

    pub fn seq_open(&mut self) -> Result<u64, EngineError> {
        self.calls.seq_open()
    }

    pub fn seq_release(&mut self, seq: u64) {
        self.calls.seq_release(seq)
    }

    /// One forward pass; see the header's `step`.
    pub fn step(
        &mut self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        self.calls.step(entries)
    }

    /// How many tokens of `seq`'s first entry the engine took from its cache (ABI 1.4); `None`
    /// when the plugin does not report it (older than 1.4, or it does not know). Asked after
    /// the step that carried the first entry.
    pub fn seq_cached_tokens(&mut self, seq: u64) -> Option<u64> {
        self.calls.seq_cached_tokens(seq)
    }

    /// A new sequence holding what `src`'s KV holds (ABI 1.5); `Unsupported` from plugins
    /// without it.
    pub fn seq_fork(&mut self, src: u64) -> Result<u64, EngineError> {
        self.calls.seq_fork(src)
    }

    /// Keep the first `n_keep` tokens of `seq` (ABI 1.5, for speculative decoding).
    pub fn seq_truncate(&mut self, seq: u64, n_keep: u64) -> Result<(), EngineError> {
        self.calls.seq_truncate(seq, n_keep)
    }

    /// Load a LoRA adapter next to the model (ABI 1.6); `Unsupported` from plugins without
    /// `GANTRY_CAP_ADAPTERS`.
    pub fn adapter_load(&mut self, desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        if !self.shared.supports_adapters() {
            return Err(EngineError::unsupported(format!(
                "engine `{}` serves no LoRA adapters",
                self.shared.plugin_id()
            )));
        }
        self.calls.adapter_load(desc)
    }

    /// Free an adapter no open sequence uses (ABI 1.6).
    pub fn adapter_unload(&mut self, adapter: u64) {
        self.calls.adapter_unload(adapter)
    }

    /// Run `seq` with `adapter` (0 = the base) from its first step on (ABI 1.6).
    pub fn seq_set_adapter(&mut self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        self.calls.seq_set_adapter(seq, adapter)
    }

    /// Condition `seq` on `input` before its first step (ABI 1.9): audio for a transcription
    /// model, refused with the reason by a model that takes none.
    pub fn seq_set_input(&mut self, seq: u64, input: &Input<'_>) -> Result<(), EngineError> {
        self.calls.seq_set_input(seq, input)
    }

    /// Start synthesizing speech (ABI 1.10); refused with the reason by a model without the
    /// speech modality.
    pub fn speech_open(&mut self, req: &SpeechRequest<'_>) -> Result<u64, EngineError> {
        if !self.shared.info.supports_speech() {
            return Err(EngineError::unsupported(format!(
                "model `{}` does not synthesize speech",
                self.shared.info.architecture
            )));
        }
        self.calls.speech_open(req)
    }

    /// The next piece of a speech (ABI 1.10).
    pub fn speech_next(&mut self, speech: u64) -> Result<SpeechPiece, EngineError> {
        self.calls.speech_next(speech)
    }

    /// Free a speech, finished or not (ABI 1.10).
    pub fn speech_close(&mut self, speech: u64) {
        self.calls.speech_close(speech)
    }

    /// When each token fed to `seq` from `first` on is spoken in its input (ABI 1.11), for a
    /// sequence whose audio asked for it.
    pub fn seq_token_times(&mut self, seq: u64, first: usize) -> Result<Vec<f32>, EngineError> {
        self.calls.seq_token_times(seq, first)
    }

    /// The probability of `token` right after the first `n_fed` tokens fed to `seq`, under the
    /// model's raw distribution (ABI 1.11).
    pub fn seq_token_prob(
        &mut self,
        seq: u64,
        n_fed: usize,
        token: i32,
    ) -> Result<f32, EngineError> {
        self.calls.seq_token_prob(seq, n_fed, token)
    }

    /// The model's event counters, cumulative since load (ABI 1.12); none when the plugin
    /// keeps none.
    pub fn counters(&mut self) -> Result<Vec<(String, u64)>, EngineError> {
        self.calls.counters()
    }

    /// The embedding of one input.
    pub fn embed(&mut self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        self.embed_batch(&[tokens.to_vec()])?
            .pop()
            .ok_or_else(|| EngineError::internal("embed: no vector"))
    }

    /// The embeddings of several inputs, in one engine call where the plugin has ABI 1.8's
    /// `embed_batch`.
    pub fn embed_batch(&mut self, inputs: &[Vec<i32>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let dims = self.shared.info.embedding_dims as usize;
        self.calls.embed_batch(inputs, dims)
    }
}
