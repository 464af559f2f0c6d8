//! The seam between the scheduler and whatever runs the model (scheduler → engine): the few
//! calls continuous batching needs, so the scheduler drives an in-process plugin, a worker
//! process or a test engine alike, and knows nothing of plugin loading.

use gantry_api::WorkerCrash;
use gantry_engine_abi::{
    AdapterDescriptor, EngineError, Input, LoadedAdapter, SampledToken, SpeechPiece, SpeechRequest,
    StepEntry,
};

/// The limits of one engine instance, fixed at load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// Sequences the engine runs at once.
    pub max_sequences: usize,
    /// KV cells of all its sequences together.
    pub kv_capacity_tokens: u64,
    /// Tokens one sequence may hold.
    pub context_length: u32,
    /// Tokens that end a generation.
    pub eog_tokens: Vec<i32>,
    /// The engine samples at every position of an entry and truncates sequences (ABI 1.5
    /// `GANTRY_CAP_SPECULATE`), so drafted tokens can be verified in one step.
    pub speculation: bool,
    /// The rate a job's audio is at (ABI 1.9 `audio_sample_rate`; 0 without audio).
    pub audio_sample_rate: u32,
}

/// One loaded engine instance, owned by its scheduler thread (TGI's `Backend`).
pub trait Engine: Send + 'static {
    fn limits(&self) -> EngineLimits;
    /// A new sequence; an `OomVram`/`OomRam` status means "not now" (admission waits).
    fn seq_open(&mut self) -> Result<u64, EngineError>;
    fn seq_release(&mut self, seq: u64);
    /// One batched step; a sampled token for every entry that asked for one.
    fn step(&mut self, entries: &[StepEntry<'_>])
    -> Result<Vec<Option<SampledToken>>, EngineError>;
    /// A new sequence whose KV holds what `src`'s holds (ABI 1.5 `seq_fork`), for `n` > 1;
    /// `Unsupported` when the engine cannot (the prompt is then evaluated once per choice).
    fn seq_fork(&mut self, _src: u64) -> Result<u64, EngineError> {
        Err(EngineError::unsupported(
            "the engine does not fork sequences",
        ))
    }
    /// Keep the first `n_keep` tokens of `seq` (ABI 1.5 `seq_truncate`): drafted tokens the
    /// verification rejected leave the KV cache.
    fn seq_truncate(&mut self, _seq: u64, _n_keep: u64) -> Result<(), EngineError> {
        Err(EngineError::unsupported(
            "the engine does not truncate sequences",
        ))
    }
    /// Load a LoRA adapter next to the model (ABI 1.6 `adapter_load`).
    fn adapter_load(&mut self, _desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        Err(EngineError::unsupported(
            "the engine serves no LoRA adapters",
        ))
    }
    /// Free an adapter no sequence uses (ABI 1.6 `adapter_unload`).
    fn adapter_unload(&mut self, _adapter: u64) {}
    /// Run a freshly opened sequence with an adapter (ABI 1.6 `seq_set_adapter`).
    fn seq_set_adapter(&mut self, _seq: u64, _adapter: u64) -> Result<(), EngineError> {
        Err(EngineError::unsupported(
            "the engine serves no LoRA adapters",
        ))
    }
    /// Condition a freshly opened sequence on an input (ABI 1.9 `seq_set_input`): a
    /// transcription model's audio.
    fn seq_set_input(&mut self, _seq: u64, input: &Input<'_>) -> Result<(), EngineError> {
        Err(EngineError::unsupported(format!(
            "the engine takes no {} input",
            input.kind()
        )))
    }
    /// Start synthesizing speech (ABI 1.10 `speech_open`): the engine's handle.
    fn speech_open(&mut self, _req: &SpeechRequest<'_>) -> Result<u64, EngineError> {
        Err(EngineError::unsupported("the engine synthesizes no speech"))
    }
    /// The next piece of a speech (ABI 1.10 `speech_next`).
    fn speech_next(&mut self, _speech: u64) -> Result<SpeechPiece, EngineError> {
        Err(EngineError::unsupported("the engine synthesizes no speech"))
    }
    /// Free a speech (ABI 1.10 `speech_close`).
    fn speech_close(&mut self, _speech: u64) {}
    /// When each token fed to `seq` from `first` on is spoken in its input (ABI 1.11
    /// `seq_token_times`).
    fn seq_token_times(&mut self, _seq: u64, _first: usize) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::unsupported(
            "the engine does not align tokens with their audio",
        ))
    }
    /// The probability of `token` right after the first `n_fed` tokens fed to `seq`, under the
    /// model's raw distribution (ABI 1.11 `seq_token_prob`).
    fn seq_token_prob(
        &mut self,
        _seq: u64,
        _n_fed: usize,
        _token: i32,
    ) -> Result<f32, EngineError> {
        Err(EngineError::unsupported(
            "the engine does not report a token's probability",
        ))
    }
    /// The engine's event counters, cumulative since load (ABI 1.12 `model_counters`); none
    /// by default. Asked between steps about once a second.
    fn counters(&mut self) -> Vec<(String, u64)> {
        Vec::new()
    }
    /// Prompt tokens the sequence took from the engine's prefix cache, when it says.
    fn seq_cached_tokens(&mut self, seq: u64) -> Option<u64>;
    /// One vector per input, in order, in one engine call where the engine can batch them.
    fn embed_batch(&mut self, inputs: &[Vec<i32>]) -> Result<Vec<Vec<f32>>, EngineError>;
    /// The bytes of one token (empty when the engine cannot say).
    fn token_bytes(&self, token: i32) -> Vec<u8>;
    /// The crash that ended the engine's worker process, once it has ended.
    fn crashed(&self) -> Option<WorkerCrash>;
    /// What the watchdog does when a step overruns.
    fn on_overrun(&self) -> Overrun;
}

/// What the watchdog does about a step that overran its limit.
pub enum Overrun {
    /// An in-process engine cannot be interrupted: mark the node hung (`/healthz` fails and
    /// Kubernetes restarts the pod).
    MarkHung,
    /// An engine in a worker process: kill it (the crash path restarts the model). The
    /// closure returns the pid it killed, `None` when the worker is already gone.
    Kill(Box<dyn Fn() -> Option<u32> + Send>),
}

/// A request's grammar as the scheduler drives it (structured outputs, forced tool calls):
/// compute the allowed-token mask before a sampling step, then consume what was sampled.
pub trait Grammar: Send + std::fmt::Debug {
    /// Compute the mask for the next token; the seconds it took, or why the grammar failed.
    fn compute_mask(&mut self) -> Result<f64, String>;
    /// The mask computed last: one bit per vocabulary entry.
    fn mask(&self) -> &[u32];
    /// Advance past a sampled token; an error when the token was outside the mask.
    fn consume(&mut self, token: i32) -> Result<(), String>;
    /// The grammar accepts no more tokens.
    fn is_done(&self) -> bool;
}
