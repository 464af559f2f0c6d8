//! HTTP layer, model limits (after tokenization, before the response cache): a valid request
//! checked against the ready model it is for.
//!
//! `validate.rs` checks what the request alone decides; what depends on the
//! loaded model is checked here, once: its kind (generation or embedding),
//! its vocabulary (prompts given as token ids), its context length (the
//! prompt must leave room; `max_tokens` defaults to what is left) and its
//! timeout limits. The result carries everything the scheduler and the
//! response need.

use std::sync::Arc;
use std::time::Duration;

pub use gantry_openai::tool_reply::ReplyTools;

use super::validate::{ValidEmbeddingRequest, ValidParams, ValidPrompt};
use crate::constraint::Constraint;
use crate::error::ApiError;
use crate::node::{ReadyModel, ServedModel};
use gantry_api::config::SchedulerConfig;

/// A prompt as it reaches this step: encoded by the node, or token ids the
/// client sent (still to be checked against the vocabulary).
pub enum PromptTokens<'a> {
    Encoded(Vec<i32>),
    Sent(&'a [i64]),
}

/// Everything needed to run one generation.
pub struct Generation {
    pub model_id: String,
    pub ready: Arc<ReadyModel>,
    pub prompt: Vec<i32>,
    pub params: ValidParams,
    pub max_tokens: u32,
    pub deadline: Option<Duration>,
    /// How long a stream may go without a token once the first one arrived.
    pub stall: Duration,
    /// The compiled grammar (see [`constrain`]), when the request constrains its output.
    pub constraint: Option<Box<Constraint>>,
    /// The grammar of each other choice (`n` > 1): a grammar's state follows one output.
    pub fork_constraints: Vec<Box<Constraint>>,
    /// How the reply's tool calls are read (chat requests with `tools`).
    pub tools: ReplyTools,
    /// The LoRA adapter the request named, held until its last token (`model_id` is then
    /// the adapter's id).
    pub adapter: Option<crate::node::AdapterLease>,
    /// The audio a transcription is of (16 kHz mono for Whisper), given to the engine when the
    /// sequence opens.
    pub audio: Option<Arc<Vec<f32>>>,
}

/// Compile the request's grammar (if any) against the model's vocabulary, off the async
/// runtime. (A model whose engine cannot apply masks refused it in [`generation`], with a
/// 400 naming the engine: a constrained request never gets an unconstrained answer.)
pub async fn constrain(mut g: Generation) -> Result<Generation, ApiError> {
    let Some(req) = g.params.constraint.clone() else {
        return Ok(g);
    };
    let vocabulary = g.ready.vocabulary.clone();
    let n = g.params.n.max(1) as usize;
    let mut compiled = tokio::task::spawn_blocking(move || {
        let compiler = vocabulary.compiler().map_err(|e| {
            ApiError::internal(format!(
                "constrained decoding is unavailable for this model: {e}"
            ))
        })?;
        (0..n)
            .map(|_| compiler.compile(&req).map(Box::new).map_err(ApiError::from))
            .collect::<Result<Vec<_>, ApiError>>()
    })
    .await
    .map_err(|e| ApiError::internal(format!("grammar compilation failed: {e}")))??;
    g.constraint = Some(compiled.remove(0));
    g.fork_constraints = compiled;
    Ok(g)
}

/// Check a generation request against its model (and `adapter`, the LoRA adapter its model id
/// names). `prompt_field` is the request field a context-length refusal names (`messages` for
/// chat, `prompt` for completions).
pub fn generation(
    sched: &SchedulerConfig,
    m: &ServedModel,
    ready: Arc<ReadyModel>,
    adapter: Option<crate::node::AdapterLease>,
    prompt: PromptTokens<'_>,
    prompt_field: &'static str,
    params: ValidParams,
) -> Result<Generation, ApiError> {
    let prompt = match prompt {
        PromptTokens::Encoded(ids) => ids,
        PromptTokens::Sent(ids) => token_ids(ids, ready.shared.info().vocab_size)?,
    };
    if let Some(c) = &params.constraint
        && !ready.shared.supports_token_mask()
    {
        return Err(ApiError::invalid(
            c.field.clone(),
            format!(
                "`{}` needs constrained decoding, which engine `{}` (serving model `{}`) does not support: its plugin does not declare GANTRY_CAP_TOKEN_MASK",
                c.field, ready.plugin, m.config.id
            ),
        ));
    }
    if !ready.shared.info().supports_completion() {
        let (what, route) = if ready.shared.info().supports_transcription() {
            ("a speech recognition model", "/v1/audio/transcriptions")
        } else {
            ("an embedding model", "/v1/embeddings")
        };
        return Err(ApiError::unsupported(
            "model",
            format!("model `{}` is {what}; use {route}", m.config.id),
        ));
    }
    let vocab = ready.shared.info().vocab_size;
    if let Some((t, _)) = params
        .sampling
        .logit_bias
        .iter()
        .find(|(t, _)| *t < 0 || *t as u32 >= vocab)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("`logit_bias` key {t} is outside the vocabulary [0, {vocab})"),
        ));
    }
    let max_tokens = check_lengths(
        prompt.len(),
        params.max_tokens,
        ready.scheduler.context_length(),
        prompt_field,
    )?;
    let deadline = deadline_for(m, sched, params.timeout)?;
    Ok(Generation {
        model_id: adapter
            .as_ref()
            .map_or_else(|| m.config.id.clone(), |a| a.id().to_string()),
        ready,
        prompt,
        params,
        max_tokens,
        deadline,
        stall: Duration::from_secs(sched.stall_timeout_seconds.max(1)),
        constraint: None,
        fork_constraints: Vec::new(),
        tools: ReplyTools::Off,
        adapter,
        audio: None,
    })
}

/// Check an embeddings request against its model and tokenize its inputs.
pub fn embedding(
    ready: &ReadyModel,
    req: &ValidEmbeddingRequest,
) -> Result<Vec<Vec<i32>>, ApiError> {
    let info = ready.shared.info();
    if !info.supports_embedding() {
        return Err(ApiError::unsupported(
            "model",
            format!("model `{}` does not produce embeddings", req.model),
        ));
    }
    if let Some(d) = req.dimensions
        && d != i64::from(info.embedding_dims)
    {
        return Err(ApiError::unsupported(
            "dimensions",
            format!(
                "`dimensions` must be {} for this model (no truncation), got {d}",
                info.embedding_dims
            ),
        ));
    }
    let ctx = ready.scheduler.context_length() as usize;
    let mut out = Vec::with_capacity(req.inputs.len());
    for (i, input) in req.inputs.iter().enumerate() {
        let tokens = match input {
            ValidPrompt::Text(t) => ready.tokenizer.encode_prompt(t, info)?,
            ValidPrompt::Tokens(ids) => token_ids(ids, info.vocab_size)?,
        };
        if tokens.len() > ctx {
            return Err(ApiError::invalid(
                "input",
                format!(
                    "`input[{i}]` has {} tokens; the most is {ctx}",
                    tokens.len()
                ),
            ));
        }
        out.push(tokens);
    }
    Ok(out)
}

/// Token ids a client sent, within the model's vocabulary.
fn token_ids(ids: &[i64], vocab: u32) -> Result<Vec<i32>, ApiError> {
    ids.iter()
        .map(|&t| {
            if t < 0 || t >= i64::from(vocab) {
                Err(ApiError::invalid(
                    "prompt",
                    format!("token id {t} is outside the vocabulary [0, {vocab})"),
                ))
            } else {
                Ok(t as i32)
            }
        })
        .collect()
}

/// The request's deadline within the model's limits: its default when the
/// request names none, never above its maximum.
fn deadline_for(
    m: &ServedModel,
    sched: &SchedulerConfig,
    asked: Option<Option<Duration>>,
) -> Result<Option<Duration>, ApiError> {
    let default = m.config.request_timeout(sched);
    let max = match m.config.max_request_timeout_seconds.unwrap_or(0) {
        0 => None,
        s => Some(Duration::from_secs(s)),
    };
    match asked {
        None => Ok(default),
        Some(None) if max.is_none() => Ok(None),
        Some(None) => Err(ApiError::invalid(
            "timeout",
            format!(
                "`timeout` 0 (none) is not allowed for this model; the most is {} seconds",
                max.map_or(0, |d| d.as_secs())
            ),
        )),
        Some(Some(d)) => match max {
            Some(limit) if d > limit => Err(ApiError::invalid(
                "timeout",
                format!(
                    "`timeout` must be <= {} seconds for this model, got {}",
                    limit.as_secs(),
                    d.as_secs_f64()
                ),
            )),
            _ => Ok(Some(d)),
        },
    }
}

/// Length rules once the prompt is tokenized: not empty, fits the context,
/// and `max_tokens` defaults to what is left.
pub fn check_lengths(
    prompt_tokens: usize,
    max_tokens: Option<u64>,
    context: u32,
    prompt_field: &'static str,
) -> Result<u32, ApiError> {
    let ctx = context as usize;
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(prompt_field, "the prompt is empty"));
    }
    if prompt_tokens >= ctx {
        return Err(ApiError {
            code: Some("context_length_exceeded".into()),
            ..ApiError::invalid(
                prompt_field,
                format!(
                    "the prompt has {prompt_tokens} tokens; the context length is {ctx}, leaving no room to generate"
                ),
            )
        });
    }
    let room = (ctx - prompt_tokens) as u32;
    match max_tokens {
        None => Ok(room),
        Some(m) if m > u64::from(room) => Err(ApiError {
            code: Some("context_length_exceeded".into()),
            ..ApiError::invalid(
                "max_tokens",
                format!(
                    "`max_tokens` must be <= {room} (context length {ctx} minus {prompt_tokens} prompt tokens), got {m}"
                ),
            )
        }),
        Some(m) => Ok(m as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_default_and_overflow() {
        assert_eq!(check_lengths(10, None, 100, "prompt").expect("ok"), 90);
        assert_eq!(check_lengths(10, Some(5), 100, "prompt").expect("ok"), 5);
        let e = check_lengths(10, Some(91), 100, "prompt").expect_err("too long");
        assert_eq!(
            e.message,
            "`max_tokens` must be <= 90 (context length 100 minus 10 prompt tokens), got 91"
        );
        assert!(check_lengths(100, None, 100, "messages").is_err());
        assert!(check_lengths(0, None, 100, "prompt").is_err());
    }
}
