//! Reply shapes (the last step of a generation, after the scheduler's events): OpenAI's
//! `chat.completion` / `text_completion` parts — ids, usage, logprobs in both formats, finish
//! reasons, stream chunks — and the timeouts a reply can end with. The node's
//! `http/response.rs` drives the events; every JSON shape it sends is built here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gantry_scheduler::{FinishReason, TokenLogprob};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::tool_reply::ReplyTools;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    Chat,
    Completion,
}

impl Flavor {
    pub fn endpoint(self) -> &'static str {
        match self {
            Flavor::Chat => "chat_completions",
            Flavor::Completion => "completions",
        }
    }
}

/// Set on a plain reply the node shortened: `deadline` when the request deadline, not the
/// context, bounded a request that gave no `max_tokens`.
pub const TRUNCATED_HEADER: &str = "x-gantry-truncated";

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub fn request_id(flavor: Flavor) -> String {
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let prefix = match flavor {
        Flavor::Chat => "chatcmpl",
        Flavor::Completion => "cmpl",
    };
    format!("{prefix}-{:x}{n:06x}", t & 0xffff_ffff)
}

pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What every part of one reply repeats, and how the reply is shaped.
#[derive(Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub flavor: Flavor,
    pub logprobs: bool,
    pub include_usage: bool,
    /// Whether the client set `max_tokens` (decides what a plain request cut by its deadline gets).
    pub max_tokens_given: bool,
    pub stall: Duration,
    /// How the reply's text becomes tool calls.
    pub tools: ReplyTools,
    /// The choice a stream's chunks belong to (`index`; 0 unless `n` > 1).
    pub choice: u32,
}

impl Meta {
    /// One stream chunk: a text delta (at `text_len` bytes into the reply, which legacy
    /// logprobs report), its token's logprob, the finish reason of the last.
    pub fn chunk(
        &self,
        delta_text: &str,
        text_len: usize,
        logprob: Option<&TokenLogprob>,
        finish: Option<&str>,
    ) -> Value {
        match self.flavor {
            Flavor::Chat => {
                let delta = if finish.is_some() && delta_text.is_empty() {
                    json!({})
                } else {
                    json!({"content": delta_text})
                };
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "system_fingerprint": fingerprint(),
                    "choices": [{
                        "index": self.choice, "delta": delta,
                        "logprobs": logprob.map(|l| json!({"content": [chat_logprob(l)]})),
                        "finish_reason": finish,
                    }],
                })
            }
            Flavor::Completion => {
                let lp = logprob.map(|l| {
                    let mut one = LegacyLogprobs::default();
                    one.push(l, text_len);
                    one.json()
                });
                json!({
                    "id": self.id, "object": "text_completion", "created": self.created,
                    "model": self.model, "system_fingerprint": fingerprint(),
                    "choices": [{"index": self.choice, "text": delta_text, "logprobs": lp, "finish_reason": finish}],
                })
            }
        }
    }

    /// The usage chunk that closes a stream with `include_usage`.
    pub fn usage_chunk(&self, prompt: u32, cached: Option<u32>, completion: u32) -> Value {
        let object = match self.flavor {
            Flavor::Chat => "chat.completion.chunk",
            Flavor::Completion => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "system_fingerprint": fingerprint(), "choices": [], "usage": usage(prompt, cached, completion),
        })
    }
}

/// The refusal for a request whose deadline passed before it was admitted.
pub fn queue_timeout(queued: Duration) -> ApiError {
    ApiError {
        code: Some("queue_timeout".into()),
        ..ApiError::timeout(format!(
            "the request waited {:.1} s in the queue and its deadline passed before it started; \
             nothing was generated (raise `timeout`, or retry when the model is less busy)",
            queued.as_secs_f64()
        ))
    }
}

/// The error for a request cut by its deadline after it started.
pub fn deadline_exceeded(completion_tokens: u32) -> ApiError {
    ApiError {
        code: Some("deadline_exceeded".into()),
        ..ApiError::timeout(format!(
            "the request deadline passed after {completion_tokens} generated tokens; \
             lower `max_tokens`, raise `timeout`, or stream the reply"
        ))
    }
}

/// The error for a stream that went quiet for longer than the stall limit.
pub fn stall_timeout(stall: Duration) -> ApiError {
    ApiError {
        code: Some("stall_timeout".into()),
        ..ApiError::timeout(format!(
            "no token arrived for {} s (the stall limit); the engine may be hung",
            stall.as_secs()
        ))
    }
}

/// OpenAI's `usage`; `prompt_tokens_details.cached_tokens` when the engine said how much of the
/// prompt came from its prefix cache.
pub fn usage(prompt: u32, cached: Option<u32>, completion: u32) -> Value {
    let mut u = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
    if let Some(c) = cached {
        u["prompt_tokens_details"] = json!({"cached_tokens": c});
    }
    u
}

pub fn chat_logprob(l: &TokenLogprob) -> Value {
    json!({
        "token": l.text,
        "logprob": l.logprob,
        "bytes": l.bytes,
        "top_logprobs": l.top.iter().map(|(_, t, b, lp)| json!({"token": t, "logprob": lp, "bytes": b})).collect::<Vec<_>>(),
    })
}

/// Legacy completions logprobs, accumulated.
#[derive(Default)]
pub struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top: Vec<Value>,
    offsets: Vec<usize>,
}

impl LegacyLogprobs {
    pub fn push(&mut self, l: &TokenLogprob, offset: usize) {
        self.tokens.push(l.text.clone());
        self.token_logprobs.push(l.logprob);
        let mut m = serde_json::Map::new();
        for (_, t, _, lp) in &l.top {
            m.insert(t.clone(), json!(lp));
        }
        self.top.push(Value::Object(m));
        self.offsets.push(offset);
    }
    pub fn json(&self) -> Value {
        json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top, "text_offset": self.offsets})
    }
}

/// OpenAI's `finish_reason`: `tool_calls` when a reply that ended normally holds calls.
pub fn finish_reason(reason: FinishReason, calls: bool) -> &'static str {
    if calls && reason == FinishReason::Stop {
        "tool_calls"
    } else {
        reason.as_openai()
    }
}

pub fn fingerprint() -> String {
    concat!("gantry-", env!("CARGO_PKG_VERSION")).to_string()
}
