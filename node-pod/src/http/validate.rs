//! Validation (HTTP → here → chat template): OpenAI parameters become a checked `ValidParams`.
//!
//! Every range check lives here and every message quotes the field and the
//! limit ("`temperature` must be within [0, 2], got 3"). A parameter the node
//! cannot honour is refused; nothing is silently ignored. Length checks that
//! need the tokenized prompt are in [`check_lengths`].

use std::time::Duration;

use gantry_engine_abi::Sampling;
use serde_json::Value;

use super::openai::{ChatRequest, Common, CompletionRequest};
use crate::error::ApiError;

/// Most stop sequences a request may carry (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Most alternatives per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// What generation needs, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidParams {
    pub sampling: Sampling,
    /// `None` = context length minus the prompt.
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    /// `Some(n)`: logprobs wanted, with `n` alternatives.
    pub logprobs: Option<u32>,
    pub stream: bool,
    pub include_usage: bool,
    /// Requested deadline; `Some(None)` = the request asked for none.
    pub timeout: Option<Option<Duration>>,
}

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
    if let Some(n) = c.n
        && n != 1
    {
        return Err(ApiError::unsupported(
            "n",
            format!("`n` must be 1 (one choice per request), got {n}"),
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
        Some(m) => Some(u32::try_from(m).unwrap_or(u32::MAX)),
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

fn response_format(v: &Option<Value>) -> Result<(), ApiError> {
    match v
        .as_ref()
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
    {
        None if v.is_none() => Ok(()),
        Some("text") => Ok(()),
        Some(other) => Err(ApiError::unsupported(
            "response_format",
            format!("`response_format.type` {other:?} is not supported; only \"text\" is"),
        )),
        None => Err(ApiError::invalid(
            "response_format",
            "`response_format` must be an object with a `type`",
        )),
    }
}

/// Check a chat request; returns the parameters and whether the model must
/// accept images (which a text-only model refuses).
pub fn chat(req: &ChatRequest) -> Result<ValidParams, ApiError> {
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
    response_format(&req.response_format)?;
    if let Some(tc) = &req.tool_choice {
        let ok = matches!(tc.as_str(), Some("none" | "auto"));
        if !ok {
            return Err(ApiError::unsupported(
                "tool_choice",
                "`tool_choice` may be \"none\" or \"auto\"; forcing a tool call needs constrained decoding, which Gantry does not do",
            ));
        }
    }
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    let mut any_text = false;
    for (i, m) in req.messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                format!("messages[{i}].role"),
                format!("`messages[{i}].role` is required"),
            )
        })?;
        if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!(
                    "`messages[{i}].role` must be system, developer, user, assistant or tool, got {role:?}"
                ),
            ));
        }
        match m.get("content") {
            None | Some(Value::Null) => {
                if role != "assistant" {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].content"),
                        format!("`messages[{i}].content` is required"),
                    ));
                }
            }
            Some(Value::String(s)) => any_text |= !s.trim().is_empty(),
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    match part.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            let t = part.get("text").and_then(Value::as_str).ok_or_else(|| {
                                ApiError::invalid(
                                    format!("messages[{i}].content[{j}].text"),
                                    format!("`messages[{i}].content[{j}].text` must be a string"),
                                )
                            })?;
                            any_text |= !t.trim().is_empty();
                        }
                        Some(kind @ ("image_url" | "input_audio" | "file")) => {
                            return Err(ApiError::unsupported(
                                format!("messages[{i}].content[{j}]"),
                                format!(
                                    "`messages[{i}].content[{j}]` is of type {kind:?}, but the model is text-only"
                                ),
                            ));
                        }
                        other => {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].content[{j}].type"),
                                format!(
                                    "`messages[{i}].content[{j}].type` {other:?} is not a known content part"
                                ),
                            ));
                        }
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].content"),
                    format!("`messages[{i}].content` must be a string or a list of parts"),
                ));
            }
        }
    }
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
    Ok(with_logprobs(p, top))
}

pub fn completion(req: &CompletionRequest) -> Result<ValidParams, ApiError> {
    let p = common(&req.common())?;
    if req.echo.unwrap_or(false) {
        return Err(ApiError::unsupported(
            "echo",
            "`echo: true` is not supported",
        ));
    }
    if let Some(b) = req.best_of
        && b != 1
    {
        return Err(ApiError::unsupported(
            "best_of",
            format!("`best_of` must be 1, got {b}"),
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "`suffix` (fill-in-the-middle) is not supported",
        ));
    }
    response_format(&req.response_format)?;
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
    Ok(with_logprobs(p, top))
}

/// Length rules once the prompt is tokenized: not empty, fits the context,
/// and `max_tokens` defaults to what is left.
pub fn check_lengths(
    prompt_tokens: usize,
    max_tokens: Option<u32>,
    context: u32,
) -> Result<u32, ApiError> {
    let ctx = context as usize;
    if prompt_tokens == 0 {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if prompt_tokens >= ctx {
        return Err(ApiError {
            code: Some("context_length_exceeded".into()),
            ..ApiError::invalid(
                "messages",
                format!(
                    "the prompt has {prompt_tokens} tokens; the context length is {ctx}, leaving no room to generate"
                ),
            )
        });
    }
    let room = (ctx - prompt_tokens) as u32;
    match max_tokens {
        None => Ok(room),
        Some(m) if m > room => Err(ApiError {
            code: Some("context_length_exceeded".into()),
            ..ApiError::invalid(
                "max_tokens",
                format!(
                    "`max_tokens` must be <= {room} (context length {ctx} minus {prompt_tokens} prompt tokens), got {m}"
                ),
            )
        }),
        Some(m) => Ok(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::openai::parse;

    fn chat_err(body: serde_json::Value) -> ApiError {
        match parse::<ChatRequest>(body.to_string().as_bytes()) {
            Err(e) => e,
            Ok(req) => chat(&req).expect_err("should be refused"),
        }
    }

    fn msg() -> serde_json::Value {
        serde_json::json!([{"role": "user", "content": "hi"}])
    }

    #[test]
    fn each_range_check_names_its_field_and_limit() {
        let cases = [
            (
                "temperature",
                serde_json::json!(3),
                "`temperature` must be within [0, 2], got 3",
            ),
            (
                "top_p",
                serde_json::json!(1.5),
                "`top_p` must be within [0, 1], got 1.5",
            ),
            (
                "top_k",
                serde_json::json!(-1),
                "`top_k` must be >= 0, got -1",
            ),
            (
                "min_p",
                serde_json::json!(2),
                "`min_p` must be within [0, 1], got 2",
            ),
            (
                "presence_penalty",
                serde_json::json!(-3),
                "`presence_penalty` must be within [-2, 2], got -3",
            ),
            (
                "frequency_penalty",
                serde_json::json!(2.5),
                "`frequency_penalty` must be within [-2, 2], got 2.5",
            ),
            (
                "repetition_penalty",
                serde_json::json!(11),
                "`repetition_penalty` must be within [0, 10], got 11",
            ),
            (
                "max_tokens",
                serde_json::json!(0),
                "`max_tokens` must be >= 1, got 0",
            ),
            (
                "n",
                serde_json::json!(2),
                "`n` must be 1 (one choice per request), got 2",
            ),
            (
                "top_logprobs",
                serde_json::json!(21),
                "`top_logprobs` must be within [0, 20], got 21",
            ),
        ];
        for (field, value, message) in cases {
            let mut body = serde_json::json!({"model": "m", "messages": msg()});
            body[field] = value;
            if field == "top_logprobs" {
                body["logprobs"] = true.into();
            }
            let e = chat_err(body);
            assert_eq!(
                (e.status, e.param.as_deref(), e.message.as_str()),
                (400, Some(field), message)
            );
        }
    }

    #[test]
    fn parameters_the_model_cannot_honour_are_refused() {
        let image = serde_json::json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]);
        let e = chat_err(serde_json::json!({"model": "m", "messages": image}));
        assert!(e.message.contains("text-only"), "{}", e.message);
        let e = chat_err(
            serde_json::json!({"model": "m", "messages": msg(), "response_format": {"type": "json_object"}}),
        );
        assert_eq!(e.param.as_deref(), Some("response_format"));
        let e = chat_err(serde_json::json!({"model": "m", "messages": msg(), "frobnicate": 1}));
        assert_eq!(
            (e.param.as_deref(), e.code.as_deref()),
            (Some("frobnicate"), Some("unsupported_parameter"))
        );
        let e = chat_err(
            serde_json::json!({"model": "m", "messages": msg(), "tool_choice": "required"}),
        );
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let ok = parse::<ChatRequest>(serde_json::json!({"model": "m", "messages": msg(), "response_format": {"type": "text"}, "user": "u", "seed": 3}).to_string().as_bytes()).expect("parse");
        let p = chat(&ok).expect("valid");
        assert_eq!(p.sampling.seed, 3);
    }

    #[test]
    fn an_empty_or_whitespace_prompt_is_a_400() {
        let e = chat_err(
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "  \n "}]}),
        );
        assert!(e.message.contains("empty"));
        let e = chat_err(serde_json::json!({"model": "m", "messages": []}));
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn type_errors_name_the_field() {
        let e =
            chat_err(serde_json::json!({"model": "m", "messages": msg(), "temperature": "hot"}));
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(
            e.message.starts_with("`temperature`: invalid type"),
            "{}",
            e.message
        );
    }

    #[test]
    fn lengths_default_and_overflow() {
        assert_eq!(check_lengths(10, None, 100).expect("ok"), 90);
        assert_eq!(check_lengths(10, Some(5), 100).expect("ok"), 5);
        let e = check_lengths(10, Some(91), 100).expect_err("too long");
        assert_eq!(
            e.message,
            "`max_tokens` must be <= 90 (context length 100 minus 10 prompt tokens), got 91"
        );
        assert!(check_lengths(100, None, 100).is_err());
        assert!(check_lengths(0, None, 100).is_err());
    }
}
