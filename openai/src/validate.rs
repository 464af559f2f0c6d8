//! OpenAI surface, validation (after parsing, before the model is looked up): a parsed OpenAI
//! request becomes a checked `Valid*Request`.
//!
//! Every check that needs only the request lives here, and every message
//! quotes the field and the limit ("`temperature` must be within [0, 2], got
//! 3"). A parameter the node cannot honour is refused; nothing is silently
//! ignored. Messages leave as typed [`ChatMessage`]s, prompts as
//! [`ValidPrompt`]s: nothing later reads request JSON again. What needs the
//! loaded model (its kind, vocabulary, context length and timeout limits) is
//! checked once it is ready, in the node's `http/limits.rs`.

use std::time::Duration;

use gantry_engine_abi::Sampling;
use serde_json::Value;

use serde_json::Map;

mod embeddings;
pub mod speech;
pub mod structured;
pub use embeddings::{ValidEmbeddingRequest, embedding};
pub use structured::ToolMode;

use crate::error::ApiError;
use crate::grammar::ConstraintRequest;
use crate::request::{ChatRequest, Common, CompletionRequest, PromptSpec};
use gantry_chat::template::{ChatMessage, Content, Role, TextPart, ToolCall};

/// Most stop sequences a request may carry (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Most alternatives per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// A chat request, checked: what the template, the limits and the scheduler need.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    /// Function specs, passed to the template as sent.
    pub tools: Option<Vec<Value>>,
    /// The template's extra variables: `chat_template_kwargs`, and `tool_choice` when given.
    pub template_kwargs: Map<String, Value>,
    /// How the reply's tool calls are produced and read.
    pub tool_mode: ToolMode,
    pub params: ValidParams,
}

/// A legacy completion request, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidCompletionRequest {
    pub model: String,
    pub prompt: ValidPrompt,
    pub params: ValidParams,
}

/// One prompt: text with more than whitespace, or a non-empty list of token ids
/// (checked against the vocabulary once the model is known).
#[derive(Clone, Debug, PartialEq)]
pub enum ValidPrompt {
    Text(String),
    Tokens(Vec<i64>),
}

/// What generation needs, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidParams {
    pub sampling: Sampling,
    /// `None` = context length minus the prompt.
    pub max_tokens: Option<u64>,
    pub stop: Vec<String>,
    /// `Some(n)`: logprobs wanted, with `n` alternatives.
    pub logprobs: Option<u32>,
    pub stream: bool,
    pub include_usage: bool,
    /// Requested deadline; `Some(None)` = the request asked for none.
    pub timeout: Option<Option<Duration>>,
    /// The client gave a `seed`: the engine evaluates the prompt from scratch
    /// (`StepEntry::fresh`), so the output does not depend on what is cached.
    pub seeded: bool,
    /// The grammar the output must follow (`response_format`, a forced tool call, an extra).
    pub constraint: Option<ConstraintRequest>,
    /// Choices to generate (`n`), each from the same prompt.
    pub n: u32,
    /// Drafted tokens may be verified for this request (Gantry's `speculation`, default on).
    pub speculate: bool,
}

/// The most choices one request may ask for (OpenAI's limit for `n`).
pub const MAX_CHOICES: i64 = 128;

fn range(field: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match v {
        Some(x) if !x.is_finite() || x < lo || x > hi => Err(ApiError::invalid(
            field,
            format!("`{field}` must be within [{lo}, {hi}], got {x}"),
        )),
        other => Ok(other),
    }
}

fn common(c: &Common<'_>) -> Result<ValidParams, ApiError> {
    if c.model.trim().is_empty() {
        return Err(ApiError::invalid("model", "`model` must name a model"));
    }
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` must be within [1, {MAX_CHOICES}], got {n}"),
        ));
    }
    let temperature = range("temperature", c.temperature, 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = range("top_p", c.top_p, 0.0, 1.0)?.unwrap_or(1.0);
    if top_p == 0.0 {
        return Err(ApiError::invalid("top_p", "`top_p` must be > 0, got 0"));
    }
    let min_p = range("min_p", c.min_p, 0.0, 1.0)?.unwrap_or(0.0);
    let presence = range("presence_penalty", c.presence_penalty, -2.0, 2.0)?.unwrap_or(0.0);
    let frequency = range("frequency_penalty", c.frequency_penalty, -2.0, 2.0)?.unwrap_or(0.0);
    let repetition = range("repetition_penalty", c.repetition_penalty, 0.0, 10.0)?.unwrap_or(1.0);
    if repetition == 0.0 {
        return Err(ApiError::invalid(
            "repetition_penalty",
            "`repetition_penalty` must be > 0, got 0",
        ));
    }
    let top_k = match c.top_k {
        Some(k) if k < 0 => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be >= 0, got {k}"),
            ));
        }
        Some(k) => i32::try_from(k).map_err(|_| {
            ApiError::invalid("top_k", format!("`top_k` must be <= {}, got {k}", i32::MAX))
        })?,
        None => 0,
    };
    let max_tokens = match c.max_tokens {
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("`max_tokens` must be >= 1, got {m}"),
            ));
        }
        // Kept as given: the model's limit check names the value the client sent.
        Some(m) => Some(m as u64),
        None => None,
    };
    if c.stop.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "`stop` may hold at most {MAX_STOP} sequences, got {}",
                c.stop.len()
            ),
        ));
    }
    if c.stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` sequences must not be empty strings",
        ));
    }
    let mut logit_bias = Vec::new();
    if let Some(map) = c.logit_bias {
        for (k, v) in map {
            let token: i32 = k.parse().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` keys must be token ids, got {k:?}"),
                )
            })?;
            let bias = v.as_f64().ok_or_else(|| {
                ApiError::invalid("logit_bias", format!("`logit_bias[{k}]` must be a number"))
            })?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias[{k}]` must be within [-100, 100], got {bias}"),
                ));
            }
            // -100 bans the token, as OpenAI documents.
            logit_bias.push((
                token,
                if bias <= -100.0 {
                    f32::NEG_INFINITY
                } else {
                    bias as f32
                },
            ));
        }
        logit_bias.sort_by_key(|(t, _)| *t);
    }
    let timeout = match c.timeout {
        None => None,
        Some(t) if !t.is_finite() || t < 0.0 => {
            return Err(ApiError::invalid(
                "timeout",
                format!("`timeout` must be >= 0 seconds, got {t}"),
            ));
        }
        Some(0.0) => Some(None),
        Some(t) => Some(Some(Duration::from_secs_f64(t))),
    };
    Ok(ValidParams {
        sampling: Sampling {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            min_p: min_p as f32,
            repetition_penalty: repetition as f32,
            presence_penalty: presence as f32,
            frequency_penalty: frequency as f32,
            penalty_last_n: 64,
            // A request without a seed still gets a fixed, per-request one.
            seed: c.seed.map_or_else(rand_seed, |s| s as u64),
            logit_bias,
            top_logprobs: 0,
            want_logprob: false,
        },
        max_tokens,
        stop: c.stop.clone(),
        logprobs: None,
        stream: c.stream,
        include_usage: c.include_usage,
        timeout,
        seeded: c.seed.is_some(),
        constraint: None,
        n: n as u32,
        speculate: c.speculation.unwrap_or(true),
    })
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

fn with_logprobs(mut p: ValidParams, top: Option<u32>) -> ValidParams {
    if let Some(n) = top {
        p.logprobs = Some(n);
        p.sampling.want_logprob = true;
        p.sampling.top_logprobs = n;
    }
    p
}

fn refuse_if_set(field: &str, v: &Option<Value>, why: &str) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(_) => Err(ApiError::unsupported(
            field,
            format!("`{field}` is not supported: {why}"),
        )),
    }
}

/// Check a chat request: parameters, and every message typed.
pub fn chat(req: &ChatRequest) -> Result<ValidChatRequest, ApiError> {
    let mut c = req.common();
    if req.max_completion_tokens.is_some() {
        if c.max_tokens.is_some() && c.max_tokens != req.max_completion_tokens {
            return Err(ApiError::invalid(
                "max_completion_tokens",
                "give `max_completion_tokens` or `max_tokens`, not two different values",
            ));
        }
        c.max_tokens = req.max_completion_tokens;
    }
    let p = common(&c)?;
    refuse_if_set("audio", &req.audio, "Gantry serves text")?;
    refuse_if_set(
        "prediction",
        &req.prediction,
        "predicted outputs are not implemented",
    )?;
    refuse_if_set(
        "web_search_options",
        &req.web_search_options,
        "the node has no web access",
    )?;
    refuse_if_set(
        "reasoning_effort",
        &req.reasoning_effort,
        "the model has no reasoning-effort control",
    )?;
    refuse_if_set("functions", &req.functions, "use `tools` instead")?;
    refuse_if_set(
        "function_call",
        &req.function_call,
        "use `tool_choice` instead",
    )?;
    if let Some(m) = &req.modalities {
        let text_only = m.as_array().is_some_and(|a| a.iter().all(|x| x == "text"));
        if !text_only {
            return Err(ApiError::unsupported(
                "modalities",
                "`modalities` may only be [\"text\"]",
            ));
        }
    }
    let output = structured::chat_output(
        req.response_format.as_ref(),
        &req.extras(),
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    let messages = messages(&req.messages)?;
    let any_text = messages
        .iter()
        .any(|m| m.content.as_ref().is_some_and(Content::has_text));
    if !any_text {
        return Err(ApiError::invalid(
            "messages",
            "the prompt is empty: every message's content is empty or whitespace",
        ));
    }
    let top = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (_, Some(n)) if !(0..=MAX_TOP_LOGPROBS).contains(&n) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be within [0, {MAX_TOP_LOGPROBS}], got {n}"),
            ));
        }
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ));
        }
        (true, n) => Some(n.unwrap_or(0) as u32),
        (false, _) => None,
    };
    let mut template_kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(tc) = &req.tool_choice {
        template_kwargs.insert("tool_choice".into(), tc.clone());
    }
    Ok(ValidChatRequest {
        model: req.model.clone(),
        messages: messages
            .into_iter()
            .map(parse_tool_call_arguments)
            .collect(),
        tools: req.tools.clone(),
        template_kwargs,
        tool_mode: output.tools,
        params: ValidParams {
            constraint: output.constraint,
            ..with_logprobs(p, top)
        },
    })
}

/// Check and type the messages of a conversation, keeping what the client
/// sent (tool-call arguments too) for the template.
pub fn messages(sent: &[Value]) -> Result<Vec<ChatMessage>, ApiError> {
    sent.iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect()
}

fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            format!("messages[{i}].role"),
            format!("`messages[{i}].role` is required"),
        )
    })?;
    let role = Role::parse(role).ok_or_else(|| {
        ApiError::invalid(
            format!("messages[{i}].role"),
            format!(
                "`messages[{i}].role` must be system, developer, user, assistant or tool, got {role:?}"
            ),
        )
    })?;
    let content = match m.get("content") {
        None | Some(Value::Null) if role != Role::Assistant => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                format!("`messages[{i}].content` is required"),
            ));
        }
        None => None,
        Some(Value::Null) => Some(Content::Null),
        Some(Value::String(s)) => Some(Content::Text(s.clone())),
        Some(Value::Array(parts)) => Some(Content::Parts(
            parts
                .iter()
                .enumerate()
                .map(|(j, part)| text_part(i, j, part))
                .collect::<Result<_, _>>()?,
        )),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                format!("`messages[{i}].content` must be a string or a list of parts"),
            ));
        }
    };
    let fields = m.as_object().cloned().unwrap_or_default();
    let order: Vec<String> = fields.keys().cloned().collect();
    let mut rest = Map::new();
    let mut tool_calls = None;
    for (key, value) in fields {
        match (key.as_str(), value) {
            ("role" | "content", _) => {}
            ("tool_calls", Value::Array(calls)) => {
                tool_calls = Some(calls.into_iter().map(ToolCall::new).collect());
            }
            (_, value) => {
                rest.insert(key, value);
            }
        }
    }
    Ok(ChatMessage::new(role, content, tool_calls, rest, order))
}

fn text_part(i: usize, j: usize, part: &Value) -> Result<TextPart, ApiError> {
    match part.get("type").and_then(Value::as_str) {
        Some("text") => {
            let t = part.get("text").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(
                    format!("messages[{i}].content[{j}].text"),
                    format!("`messages[{i}].content[{j}].text` must be a string"),
                )
            })?;
            Ok(TextPart::new(
                t.to_string(),
                part.as_object().cloned().unwrap_or_default(),
            ))
        }
        Some(kind @ ("image_url" | "input_audio" | "file")) => Err(ApiError::unsupported(
            format!("messages[{i}].content[{j}]"),
            format!("`messages[{i}].content[{j}]` is of type {kind:?}, but the model is text-only"),
        )),
        other => Err(ApiError::invalid(
            format!("messages[{i}].content[{j}].type"),
            format!("`messages[{i}].content[{j}].type` {other:?} is not a known content part"),
        )),
    }
}

/// OpenAI clients send `tool_calls[].function.arguments` as a JSON string;
/// templates expect an object (they `tojson` it), so it is parsed here, as
/// llama-server and vLLM do. Arguments that are not a JSON object stay as sent.
fn parse_tool_call_arguments(mut m: ChatMessage) -> ChatMessage {
    for call in m.tool_calls.iter_mut().flatten() {
        if let Some(gantry_chat::template::Arguments::Text(s)) = &call.arguments
            && let Ok(Value::Object(obj)) = serde_json::from_str::<Value>(s)
        {
            call.arguments = Some(gantry_chat::template::Arguments::Object(obj));
        }
    }
    m
}

/// Check a legacy completion request: parameters and its one prompt.
pub fn completion(req: &CompletionRequest) -> Result<ValidCompletionRequest, ApiError> {
    let p = common(&req.common())?;
    if req.echo.unwrap_or(false) {
        return Err(ApiError::unsupported(
            "echo",
            "`echo: true` is not supported",
        ));
    }
    // `best_of` > `n` would rank candidates the client never sees; equal to `n` it asks for
    // nothing more than `n` does.
    if let Some(b) = req.best_of
        && b != 1
        && b != i64::from(p.n)
    {
        return Err(ApiError::unsupported(
            "best_of",
            format!(
                "`best_of` must be 1 or equal to `n` ({}), got {b}: ranking more candidates than are returned is not supported",
                p.n
            ),
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "`suffix` (fill-in-the-middle) is not supported",
        ));
    }
    let constraint = structured::completion_output(req.response_format.as_ref(), &req.extras())?;
    let top = match req.logprobs {
        None => None,
        Some(n) if !(0..=MAX_TOP_LOGPROBS).contains(&n) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be within [0, {MAX_TOP_LOGPROBS}], got {n}"),
            ));
        }
        Some(n) => Some(n as u32),
    };
    let one = |t: &str| -> Result<ValidPrompt, ApiError> {
        if t.trim().is_empty() {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` is empty or whitespace",
            ));
        }
        Ok(ValidPrompt::Text(t.to_string()))
    };
    let prompt = match &req.prompt {
        PromptSpec::Text(t) => one(t)?,
        PromptSpec::Texts(v) if v.len() == 1 => one(&v[0])?,
        PromptSpec::Tokens(ids) => token_ids(ids)?,
        PromptSpec::TokenLists(l) if l.len() == 1 => token_ids(&l[0])?,
        _ => {
            return Err(ApiError::unsupported(
                "prompt",
                "`prompt` must be one prompt (batches of prompts are not supported; send one request each)",
            ));
        }
    };
    Ok(ValidCompletionRequest {
        model: req.model.clone(),
        prompt,
        params: ValidParams {
            constraint,
            ..with_logprobs(p, top)
        },
    })
}

pub(crate) fn token_ids(ids: &[i64]) -> Result<ValidPrompt, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` holds no tokens"));
    }
    Ok(ValidPrompt::Tokens(ids.to_vec()))
}

#[cfg(test)]
mod tests;
