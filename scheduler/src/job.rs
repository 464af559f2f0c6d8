//! Jobs and their events (HTTP handler → scheduler → HTTP handler): what a request asks of
//! a model's scheduler, and what comes back on its channel.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_api::WorkerCrash;
use gantry_engine_abi::{AdapterDescriptor, EngineError, LoadedAdapter, Sampling};
use tokio::sync::{mpsc, oneshot};

use crate::engine::Grammar;

/// Why a generation ended (OpenAI's `finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The request deadline passed while it generated. OpenAI has no such finish reason: a
    /// stream ends with an error event, a plain request as docs/node.md says.
    Deadline,
    /// The deadline passed while the request was still queued: no token was generated, and
    /// the client gets a 504 before any byte.
    QueueTimeout,
    /// The request failed while it generated (its grammar); an `Error` event was sent
    /// instead of `Done`.
    Failed,
}

impl FinishReason {
    /// The OpenAI `finish_reason`; the deadline kinds only reach a client as `length` where
    /// docs/node.md says so (a plain request without `max_tokens`).
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::Failed => "stop",
            FinishReason::Length | FinishReason::Deadline | FinishReason::QueueTimeout => "length",
        }
    }

    /// The `reason` label of `gantry_request_finish_total`.
    pub fn label(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Deadline => "deadline",
            FinishReason::QueueTimeout => "queue_timeout",
            FinishReason::Failed => "error",
        }
    }
}

/// Why a job failed: the engine said so, or the worker process under it ended (every job
/// on it fails the same way; the HTTP edge answers 503 `engine_crashed`).
#[derive(Clone, Debug, PartialEq)]
pub enum GenError {
    Engine(EngineError),
    Crashed(WorkerCrash),
}

impl std::fmt::Display for GenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GenError::Engine(e) => write!(f, "{e}"),
            GenError::Crashed(c) => f.write_str(&c.message()),
        }
    }
}

impl From<EngineError> for GenError {
    fn from(e: EngineError) -> Self {
        GenError::Engine(e)
    }
}

/// Log probability of one token, with its text.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: i32,
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(i32, String, Vec<u8>, f32)>,
}

/// What a job's event channel carries.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// One generated token: the text it completes (possibly empty while a
    /// multi-byte character or a possible stop sequence is pending).
    Token {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The end, with usage and the time spent queued.
    Done {
        reason: FinishReason,
        prompt_tokens: u32,
        /// Prompt tokens the engine took from its prefix cache; `None` when it does not say
        /// (ABI 1.4 `seq_cached_tokens`) or the prompt never reached it.
        cached_tokens: Option<u32>,
        completion_tokens: u32,
        queued: Duration,
    },
    /// When each generated token is spoken in the job's audio (ABI 1.11 `seq_token_times`,
    /// asked for by [`GenerateJob::align`]), seconds from the audio's start: one time per
    /// generated token, where the model's attention was while it predicted that token (the
    /// last one's time is where the text before it ends). Sent just before `Done`.
    Times(Vec<f32>),
    /// The probability [`GenerateJob::probe`] asked for (ABI 1.11 `seq_token_prob`). Sent just
    /// before `Done`.
    Probe(f32),
    /// The log-probability of the end-of-generation token that ended a job with `audio` and
    /// `logprobs` (speech recognition counts it in a window's average log-probability, as
    /// openai-whisper does). Sent just before `Done`.
    StopLogprob(f32),
    /// The job failed; no more events follow.
    Error(GenError),
}

/// A generation request, validated and tokenized.
#[derive(Debug)]
pub struct GenerateJob {
    pub prompt: Vec<i32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    /// `Some(n)`: report logprobs with `n` alternatives.
    pub logprobs: Option<u32>,
    pub deadline: Option<Instant>,
    /// Evaluate from scratch (no cached prefix): the request gave a `seed`.
    pub fresh: bool,
    /// The grammar the output must follow (structured outputs, forced tool calls): each
    /// sampling step gets its allowed-token mask.
    pub grammar: Option<Box<dyn Grammar>>,
    pub arrived: Instant,
    pub events: mpsc::UnboundedSender<GenEvent>,
    /// A worker crash already interrupted it once (it is not retried twice).
    pub retried: bool,
    /// The other choices of an `n` > 1 request, each with its own sampling, grammar and
    /// channel. They start from this job's prompt once it is evaluated (ABI 1.5 `seq_fork`),
    /// so the prompt is evaluated once; where the engine cannot fork, they run as jobs of
    /// their own.
    pub forks: Vec<GenerateJob>,
    /// Drafted tokens may be verified for it (speculative decoding; a request can opt out).
    pub speculate: bool,
    /// The LoRA adapter it runs with (its name in the model's `adapters`); `None` = the base
    /// model. The node loads it into this replica ([`AdapterJob::Load`]) before it submits.
    pub adapter: Option<Arc<str>>,
    /// Audio the sequence is conditioned on (speech recognition, ABI 1.9 `seq_set_input`):
    /// mono samples at the model's `audio_sample_rate`, given to the engine when the sequence
    /// opens; forks share it.
    pub audio: Option<Arc<Vec<f32>>>,
    /// Align the generated tokens with `audio` ([`GenEvent::Times`] before `Done`).
    pub align: bool,
    /// `(n, token)`: report the probability of `token` right after the prompt's first `n`
    /// tokens, under the model's raw distribution ([`GenEvent::Probe`] before `Done`; Whisper's
    /// no-speech probability).
    pub probe: Option<(usize, i32)>,
}

impl GenerateJob {
    /// Send `ev` to this job and to every fork still waiting inside it (an `n` > 1 request
    /// that ends before its choices started); returns how many choices it reached.
    pub fn send_all(&self, ev: GenEvent) -> usize {
        for f in &self.forks {
            let _ = f.events.send(ev.clone());
        }
        let _ = self.events.send(ev);
        1 + self.forks.len()
    }
}

/// Inputs of an embedding request, embedded together (one engine call): the node cuts a
/// request into jobs of at most the prompt chunk's tokens, so steps run between them.
#[derive(Debug)]
pub struct EmbedJob {
    pub inputs: Vec<Vec<i32>>,
    /// One vector per input, in order.
    pub reply: oneshot::Sender<Result<Vec<Vec<f32>>, GenError>>,
}

/// A change to the LoRA adapters loaded into one replica's engine; it runs between steps.
#[derive(Debug)]
pub enum AdapterJob {
    /// Load it under `name` (a name already loaded answers with what it holds).
    Load {
        name: Arc<str>,
        desc: AdapterDescriptor,
        reply: oneshot::Sender<Result<LoadedAdapter, GenError>>,
    },
    /// Unload it; refused (`false`) while a queued or running sequence uses it.
    Unload {
        name: Arc<str>,
        reply: oneshot::Sender<bool>,
    },
}

#[derive(Debug)]
pub enum Job {
    Generate(GenerateJob),
    Embed(EmbedJob),
    Adapter(AdapterJob),
    Speech(crate::speech::SpeechJob),
}

/// Where a scheduler sends the jobs its worker's crash interrupted before their first token.
pub type Requeue = Arc<dyn Fn(Vec<GenerateJob>, WorkerCrash) + Send + Sync>;
