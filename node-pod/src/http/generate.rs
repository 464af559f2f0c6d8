//! HTTP layer, generation: chat and legacy completions from parsed request to response or SSE stream.
//!
//! Request path: parse (`openai.rs`) → validate (`validate.rs`) → chat
//! template (`template.rs`) → tokenize (`tokenizer.rs`) → length checks →
//! response cache → scheduler (`scheduler.rs`) → events → OpenAI JSON or SSE
//! (one event per token, `[DONE]` last). Dropping the response (a client that
//! disconnects) drops the event receiver, which the scheduler notices before
//! its next step.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::openai::{ChatRequest, CompletionRequest, PromptSpec};
use super::validate::{self, ValidParams};
use super::{AppState, InflightGuard};
use crate::cache::{CacheKey, CachedAnswer};
use crate::error::ApiError;
use crate::node::{ModelState, ReadyModel, ServedModel};
use crate::scheduler::{FinishReason, GenEvent, GenerateJob, Job, TokenLogprob};
use crate::template::TemplateError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    Chat,
    Completion,
}

impl Flavor {
    fn endpoint(self) -> &'static str {
        match self {
            Flavor::Chat => "chat_completions",
            Flavor::Completion => "completions",
        }
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn request_id(flavor: Flavor) -> String {
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

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A model that can take a request now, loading it first when it is lazy.
/// 503 for a model whose artifacts are still being fetched, with how far it got.
fn downloading(id: &str, progress: Option<&crate::store::Progress>) -> ApiError {
    let Some(p) = progress else {
        return ApiError::unavailable(format!("model `{id}` is downloading; retry shortly"), 5);
    };
    let s = p.snapshot();
    let mib = |b: u64| b as f64 / 1048576.0;
    let mut msg = format!("model `{id}` is still downloading");
    if s.bytes_total > 0 {
        msg.push_str(&format!(
            " ({:.1} of {:.1} MiB)",
            mib(s.bytes_done),
            mib(s.bytes_total)
        ));
    }
    if let Some(m) = &s.message {
        msg.push_str(&format!(": {m}"));
    }
    msg.push_str("; retry later");
    // Retry-After: the time the rest should take at the current rate, within [1, 60] s.
    let remaining = s.bytes_total.saturating_sub(s.bytes_done) as f64;
    let eta = if s.bytes_per_second > 0.0 {
        remaining / s.bytes_per_second
    } else {
        10.0
    };
    ApiError::unavailable(msg, eta.clamp(1.0, 60.0).ceil() as u64)
}

pub async fn ready_model(
    state: &AppState,
    id: &str,
) -> Result<(Arc<ServedModel>, Arc<ReadyModel>), ApiError> {
    let node = &state.node;
    if node.draining.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the node is shutting down", 1));
    }
    let m = node
        .models
        .get(id)
        .cloned()
        .ok_or_else(|| ApiError::not_found_model(id))?;
    match m.state() {
        ModelState::Ready(r) => {
            node.touch(&m); // the memory policy's "last used"
            Ok((m, r))
        }
        ModelState::Idle => {
            // `load: lazy` (or unloaded by the memory policy): this request loads the model.
            node.touch(&m);
            let (n, mm) = (state.node.clone(), m.clone());
            tokio::task::spawn_blocking(move || n.load(&mm))
                .await
                .map_err(|e| ApiError::internal(format!("load task: {e}")))?;
            match m.state() {
                ModelState::Ready(r) => Ok((m, r)),
                // Refused by the memory policy or the engine: 507 with OOM_RAM/OOM_VRAM.
                ModelState::Idle => match m.memory.refusal() {
                    Some(r) => Err(ApiError::from(r.to_engine_error())),
                    None => Err(ApiError::unavailable(format!("model `{id}` is loading"), 5)),
                },
                ModelState::Failed(msg) => Err(ApiError::unavailable(
                    format!("model `{id}` failed to load: {msg}"),
                    30,
                )),
                _ => Err(ApiError::unavailable(format!("model `{id}` is loading"), 5)),
            }
        }
        ModelState::Pending
            if m.download
                .as_ref()
                .is_some_and(|d| d.state() != gantry_api::ArtifactState::Ready) =>
        {
            Err(downloading(id, m.download.as_deref()))
        }
        ModelState::Pending | ModelState::Loading => Err(ApiError::unavailable(
            format!("model `{id}` is loading; retry shortly"),
            5,
        )),
        ModelState::Failed(msg) => Err(ApiError::unavailable(
            format!("model `{id}` is not available: {msg}"),
            30,
        )),
        ModelState::Unsupported => {
            let why = m
                .verdict
                .read()
                .ok()
                .and_then(|v| v.clone())
                .map(|v| match v {
                    gantry_api::EngineVerdict::Unsupported { rejections } => rejections
                        .iter()
                        .map(|r| format!("{}: {}", r.plugin, r.reason))
                        .collect::<Vec<_>>()
                        .join("; "),
                    gantry_api::EngineVerdict::Supported { .. } => String::new(),
                })
                .unwrap_or_default();
            Err(ApiError::unavailable(
                format!("no engine on this node supports model `{id}`: {why}"),
                60,
            ))
        }
    }
}

/// Everything needed to run one generation.
struct Prepared {
    model_id: String,
    ready: Arc<ReadyModel>,
    prompt: Vec<i32>,
    params: ValidParams,
    max_tokens: u32,
    deadline: Option<Duration>,
    stall: Duration,
}

fn deadline_for(
    m: &ServedModel,
    state: &AppState,
    asked: Option<Option<Duration>>,
) -> Result<Option<Duration>, ApiError> {
    let sched = &state.node.config.scheduler;
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

fn prepare(
    state: &AppState,
    m: &ServedModel,
    ready: Arc<ReadyModel>,
    prompt: Vec<i32>,
    params: ValidParams,
) -> Result<Prepared, ApiError> {
    if !ready.shared.info().supports_completion() {
        return Err(ApiError::unsupported(
            "model",
            format!(
                "model `{}` is an embedding model; use /v1/embeddings",
                m.config.id
            ),
        ));
    }
    let max_tokens = validate::check_lengths(
        prompt.len(),
        params.max_tokens,
        ready.scheduler.context_length,
    )?;
    let deadline = deadline_for(m, state, params.timeout)?;
    Ok(Prepared {
        model_id: m.config.id.clone(),
        ready,
        prompt,
        params,
        max_tokens,
        deadline,
        stall: Duration::from_secs(state.node.config.scheduler.stall_timeout_seconds.max(1)),
    })
}

pub async fn chat(state: AppState, body: axum::body::Bytes) -> Response {
    let result = async {
        let req: ChatRequest = super::openai::parse(&body)?;
        let params = validate::chat(&req)?;
        let (m, ready) = ready_model(&state, &req.model).await?;
        let messages = parse_tool_call_arguments(&req.messages);
        let mut extra = req.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(tc) = &req.tool_choice {
            extra.insert("tool_choice".into(), tc.clone());
        }
        let text = ready
            .template
            .render(&messages, req.tools.as_deref(), true, Some(&extra))
            .map_err(|e| match e {
                TemplateError::Raised(msg) => ApiError::invalid("messages", msg),
                other => ApiError::invalid("messages", other.to_string()),
            })?;
        // Templates usually write BOS themselves; add it only when they do not.
        let info = ready.shared.info();
        let add_bos = info.add_bos
            && !info
                .bos_text
                .as_deref()
                .is_some_and(|b| !b.is_empty() && text.starts_with(b));
        let prompt = ready
            .tokenizer
            .encode(&text, add_bos, true)
            .map_err(ApiError::from)?;
        prepare(&state, &m, ready, prompt, params)
    }
    .await;
    finish(state, Flavor::Chat, result).await
}

pub async fn completion(state: AppState, body: axum::body::Bytes) -> Response {
    let result = async {
        let req: CompletionRequest = super::openai::parse(&body)?;
        let params = validate::completion(&req)?;
        let (m, ready) = ready_model(&state, &req.model).await?;
        let prompt = match &req.prompt {
            PromptSpec::Text(t) => {
                if t.trim().is_empty() {
                    return Err(ApiError::invalid("prompt", "`prompt` is empty or whitespace"));
                }
                ready.tokenizer.encode(t, ready.shared.info().add_bos, false).map_err(ApiError::from)?
            }
            PromptSpec::Texts(v) if v.len() == 1 => {
                if v[0].trim().is_empty() {
                    return Err(ApiError::invalid("prompt", "`prompt` is empty or whitespace"));
                }
                ready.tokenizer.encode(&v[0], ready.shared.info().add_bos, false).map_err(ApiError::from)?
            }
            PromptSpec::Tokens(ids) => token_ids(ids, ready.shared.info().vocab_size)?,
            PromptSpec::TokenLists(l) if l.len() == 1 => token_ids(&l[0], ready.shared.info().vocab_size)?,
            _ => {
                return Err(ApiError::unsupported("prompt", "`prompt` must be one prompt (batches of prompts are not supported; send one request each)"));
            }
        };
        prepare(&state, &m, ready, prompt, params)
    }
    .await;
    finish(state, Flavor::Completion, result).await
}

/// OpenAI clients send `tool_calls[].function.arguments` as a JSON string;
/// templates expect an object (they `tojson` it), so it is parsed first, as
/// llama-server and vLLM do. Arguments that are not a JSON object stay as sent.
fn parse_tool_call_arguments(messages: &[Value]) -> Vec<Value> {
    let mut out = messages.to_vec();
    for m in &mut out {
        let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) else {
            continue;
        };
        for call in calls {
            let Some(args) = call
                .get_mut("function")
                .and_then(|f| f.get_mut("arguments"))
            else {
                continue;
            };
            if let Some(Ok(obj @ Value::Object(_))) =
                args.as_str().map(serde_json::from_str::<Value>)
            {
                *args = obj;
            }
        }
    }
    out
}

pub fn token_ids(ids: &[i64], vocab: u32) -> Result<Vec<i32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` holds no tokens"));
    }
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

async fn finish(state: AppState, flavor: Flavor, prepared: Result<Prepared, ApiError>) -> Response {
    let p = match prepared {
        Ok(p) => p,
        Err(e) => {
            state.count("-", flavor.endpoint(), e.status);
            return e.into_response();
        }
    };
    let guard = InflightGuard::new(state.node.clone());
    let key = state
        .node
        .cache
        .enabled()
        .then(|| {
            CacheKey::for_request(
                &p.model_id,
                &p.prompt,
                p.max_tokens,
                &p.params.stop,
                p.params.logprobs,
                &p.params.sampling,
            )
        })
        .flatten();
    let source = match key.as_ref().and_then(|k| state.node.cache.get(k)) {
        Some(events) => Source::Cached(events.into_iter()),
        None => {
            let (tx, rx) = mpsc::unbounded_channel();
            let now = Instant::now();
            let job = GenerateJob {
                prompt: p.prompt.clone(),
                max_tokens: p.max_tokens,
                sampling: p.params.sampling.clone(),
                stop: p.params.stop.clone(),
                logprobs: p.params.logprobs,
                deadline: p.deadline.map(|d| now + d),
                arrived: now,
                events: tx,
            };
            if let Err(e) = p.ready.scheduler.submit(Job::Generate(job)) {
                let e = ApiError::from(e);
                state.count(&p.model_id, flavor.endpoint(), e.status);
                return e.into_response();
            }
            Source::Live {
                rx,
                record: key.map(|k| (k, Vec::new())),
                hard_deadline: p.deadline.map(|d| now + d + Duration::from_secs(2)),
            }
        }
    };
    let meta = Meta {
        id: request_id(flavor),
        created: now_secs(),
        model: p.model_id.clone(),
        flavor,
        logprobs: p.params.logprobs.is_some(),
        include_usage: p.params.include_usage,
        stall: p.stall,
    };
    if p.params.stream {
        state.count(&p.model_id, flavor.endpoint(), 200);
        stream_response(state, meta, source, guard).into_response()
    } else {
        let resp = collect_response(&state, &meta, source).await;
        let code = match &resp {
            Ok(_) => 200,
            Err(e) => e.status,
        };
        state.count(&p.model_id, flavor.endpoint(), code);
        drop(guard);
        match resp {
            Ok(v) => axum::Json(v).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    flavor: Flavor,
    logprobs: bool,
    include_usage: bool,
    stall: Duration,
}

/// Where a request's events come from.
enum Source {
    Cached(std::vec::IntoIter<GenEvent>),
    Live {
        rx: mpsc::UnboundedReceiver<GenEvent>,
        /// Events kept to fill the response cache once the answer is complete.
        record: Option<(CacheKey, Vec<GenEvent>)>,
        hard_deadline: Option<Instant>,
    },
}

enum Next {
    Event(GenEvent),
    /// No token within the stall limit (after the first one) or past the hard deadline.
    Stalled,
    Closed,
}

impl Source {
    async fn next(&mut self, seen_first: bool, stall: Duration, state: &AppState) -> Next {
        match self {
            Source::Cached(it) => it.next().map_or(Next::Closed, Next::Event),
            Source::Live {
                rx,
                record,
                hard_deadline,
            } => {
                let mut limit = if seen_first {
                    stall
                } else {
                    Duration::from_secs(24 * 3600)
                };
                if let Some(d) = hard_deadline {
                    limit = limit.min(d.saturating_duration_since(Instant::now()));
                }
                let ev = match tokio::time::timeout(limit, rx.recv()).await {
                    Ok(Some(ev)) => ev,
                    Ok(None) => return Next::Closed,
                    Err(_) => return Next::Stalled,
                };
                if let Some((key, events)) = record {
                    events.push(ev.clone());
                    if matches!(ev, GenEvent::Done { .. })
                        && let Some(answer) = CachedAnswer::new(key.clone(), std::mem::take(events))
                    {
                        state.node.cache.put(answer);
                    }
                }
                Next::Event(ev)
            }
        }
    }
}

fn usage(prompt: u32, completion: u32) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn chat_logprob(l: &TokenLogprob) -> Value {
    json!({
        "token": l.text,
        "logprob": l.logprob,
        "bytes": l.bytes,
        "top_logprobs": l.top.iter().map(|(_, t, b, lp)| json!({"token": t, "logprob": lp, "bytes": b})).collect::<Vec<_>>(),
    })
}

/// Legacy completions logprobs, accumulated.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top: Vec<Value>,
    offsets: Vec<usize>,
}

impl LegacyLogprobs {
    fn push(&mut self, l: &TokenLogprob, offset: usize) {
        self.tokens.push(l.text.clone());
        self.token_logprobs.push(l.logprob);
        let mut m = serde_json::Map::new();
        for (_, t, _, lp) in &l.top {
            m.insert(t.clone(), json!(lp));
        }
        self.top.push(Value::Object(m));
        self.offsets.push(offset);
    }
    fn json(&self) -> Value {
        json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top, "text_offset": self.offsets})
    }
}

async fn collect_response(
    state: &AppState,
    meta: &Meta,
    mut source: Source,
) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut chat_lp: Vec<Value> = Vec::new();
    let mut legacy = LegacyLogprobs::default();
    let mut seen_first = false;
    loop {
        match source.next(seen_first, meta.stall, state).await {
            Next::Event(GenEvent::Token { text: t, logprob }) => {
                seen_first = true;
                if let Some(l) = &logprob {
                    chat_lp.push(chat_logprob(l));
                    legacy.push(l, text.len());
                }
                text.push_str(&t);
            }
            Next::Event(GenEvent::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            }) => {
                if reason == FinishReason::Deadline {
                    return Err(ApiError::timeout(format!(
                        "the request deadline passed after {completion_tokens} tokens; a non-streamed request returns nothing partial"
                    )));
                }
                let u = usage(prompt_tokens, completion_tokens);
                return Ok(match meta.flavor {
                    Flavor::Chat => json!({
                        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
                        "system_fingerprint": fingerprint(),
                        "choices": [{
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": if meta.logprobs { json!({"content": chat_lp}) } else { Value::Null },
                            "finish_reason": reason.as_openai(),
                        }],
                        "usage": u,
                    }),
                    Flavor::Completion => json!({
                        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
                        "system_fingerprint": fingerprint(),
                        "choices": [{
                            "index": 0,
                            "text": text,
                            "logprobs": if meta.logprobs { legacy.json() } else { Value::Null },
                            "finish_reason": reason.as_openai(),
                        }],
                        "usage": u,
                    }),
                });
            }
            Next::Event(GenEvent::Error(e)) => return Err(ApiError::from(e)),
            Next::Stalled => {
                return Err(ApiError::timeout(
                    "no token arrived within the stall limit; the engine may be hung",
                ));
            }
            Next::Closed => {
                return Err(ApiError::internal(
                    "the scheduler ended the request without an answer",
                ));
            }
        }
    }
}

fn fingerprint() -> String {
    concat!("gantry-", env!("CARGO_PKG_VERSION")).to_string()
}

/// State carried from one SSE event to the next.
struct StreamState {
    state: AppState,
    meta: Meta,
    source: Source,
    _guard: InflightGuard,
    started: bool,
    seen_first: bool,
    done: bool,
    text_len: usize,
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

impl StreamState {
    fn chunk(
        &self,
        delta_text: &str,
        logprob: Option<&TokenLogprob>,
        finish: Option<&str>,
    ) -> Value {
        match self.meta.flavor {
            Flavor::Chat => {
                let delta = if finish.is_some() && delta_text.is_empty() {
                    json!({})
                } else {
                    json!({"content": delta_text})
                };
                json!({
                    "id": self.meta.id, "object": "chat.completion.chunk", "created": self.meta.created,
                    "model": self.meta.model, "system_fingerprint": fingerprint(),
                    "choices": [{
                        "index": 0, "delta": delta,
                        "logprobs": logprob.map(|l| json!({"content": [chat_logprob(l)]})),
                        "finish_reason": finish,
                    }],
                })
            }
            Flavor::Completion => {
                let lp = logprob.map(|l| {
                    let mut one = LegacyLogprobs::default();
                    one.push(l, self.text_len);
                    one.json()
                });
                json!({
                    "id": self.meta.id, "object": "text_completion", "created": self.meta.created,
                    "model": self.meta.model, "system_fingerprint": fingerprint(),
                    "choices": [{"index": 0, "text": delta_text, "logprobs": lp, "finish_reason": finish}],
                })
            }
        }
    }

    fn usage_chunk(&self, prompt: u32, completion: u32) -> Value {
        let object = match self.meta.flavor {
            Flavor::Chat => "chat.completion.chunk",
            Flavor::Completion => "text_completion",
        };
        json!({
            "id": self.meta.id, "object": object, "created": self.meta.created, "model": self.meta.model,
            "system_fingerprint": fingerprint(), "choices": [], "usage": usage(prompt, completion),
        })
    }

    /// The events for the next step of the stream (empty = end).
    async fn advance(&mut self) -> Vec<Event> {
        if self.done {
            return Vec::new();
        }
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            if self.meta.flavor == Flavor::Chat {
                let mut first = self.chunk("", None, None);
                first["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
                out.push(data(&first));
                return out;
            }
        }
        match self
            .source
            .next(self.seen_first, self.meta.stall, &self.state)
            .await
        {
            Next::Event(GenEvent::Token { text, logprob }) => {
                self.seen_first = true;
                out.push(data(&self.chunk(&text, logprob.as_ref(), None)));
                self.text_len += text.len();
            }
            Next::Event(GenEvent::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            }) => {
                if reason == FinishReason::Deadline {
                    tracing::info!(model = %self.meta.model, id = %self.meta.id, "request deadline passed; the stream ends with what it has");
                }
                out.push(data(&self.chunk("", None, Some(reason.as_openai()))));
                if self.meta.include_usage {
                    out.push(data(&self.usage_chunk(prompt_tokens, completion_tokens)));
                }
                out.push(Event::default().data("[DONE]"));
                self.done = true;
            }
            Next::Event(GenEvent::Error(e)) => {
                let e = ApiError::from(e);
                out.push(Event::default().data(e.body_json()));
                out.push(Event::default().data("[DONE]"));
                self.done = true;
            }
            Next::Stalled => {
                tracing::warn!(model = %self.meta.model, id = %self.meta.id, "no token within the stall limit; ending the stream");
                out.push(data(&self.chunk("", None, Some("length"))));
                out.push(Event::default().data("[DONE]"));
                self.done = true;
            }
            Next::Closed => {
                out.push(
                    Event::default().data(
                        ApiError::internal("the request ended without an answer").body_json(),
                    ),
                );
                self.done = true;
            }
        }
        out
    }
}

fn stream_response(
    state: AppState,
    meta: Meta,
    source: Source,
    guard: InflightGuard,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let st = StreamState {
        state,
        meta,
        source,
        _guard: guard,
        started: false,
        seen_first: false,
        done: false,
        text_len: 0,
    };
    let events = stream::unfold(st, |mut st| async move {
        let batch = st.advance().await;
        if batch.is_empty() {
            None
        } else {
            Some((stream::iter(batch.into_iter().map(Ok)), st))
        }
    })
    .flatten();
    Sse::new(events)
}
