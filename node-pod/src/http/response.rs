//! HTTP layer, responses (the last step of a generation): cache or queue, then the scheduler's
//! events as OpenAI JSON or as SSE.
//!
//! A temperature-0 answer found in the response cache is replayed; otherwise
//! the job goes to the model's scheduler with a per-request event channel.
//! A plain request collects the events into one `chat.completion` or
//! `text_completion`; a stream sends one chunk per token, a final chunk with
//! `finish_reason`, an optional usage chunk and `[DONE]`. Dropping the
//! response (a client that disconnects) drops the event receiver, which the
//! scheduler notices before its next step. An `n` > 1 request has one channel per choice;
//! the streamed shape is `response/streamed.rs`.

use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use gantry_openai::reply::{
    Flavor, LegacyLogprobs, Meta, TRUNCATED_HEADER, chat_logprob, deadline_exceeded, fingerprint,
    finish_reason, now_secs, queue_timeout, request_id, stall_timeout, usage,
};
use gantry_openai::tool_reply;

use super::limits::Generation;
use super::{AppState, InflightGuard};
use crate::error::ApiError;
use crate::response_cache::{CacheKey, CachedAnswer};
use crate::scheduler::{FinishReason, GenEvent, GenerateJob, Job};

mod streamed;
use streamed::stream_response;

/// Answer a generation request: count it, replay a cached answer or queue the
/// job, then collect the events into one JSON body or stream them as SSE.
pub async fn respond(
    state: AppState,
    flavor: Flavor,
    generation: Result<Generation, ApiError>,
) -> Response {
    let mut p = match generation {
        Ok(p) => p,
        Err(e) => {
            state.count("-", flavor.endpoint(), e.status);
            return e.into_response();
        }
    };
    let guard = InflightGuard::new(state.node.clone()).holding(p.adapter.clone());
    let n = p.params.n.max(1);
    // A constrained answer is not cached: the key does not describe the grammar. Nor are
    // several choices: the key does not count them.
    let key = (state.node.cache.enabled() && p.constraint.is_none() && n == 1)
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
    let sources = match key.as_ref().and_then(|k| state.node.cache.get(k)) {
        Some(events) => vec![Events::Cached(events.into_iter())],
        None => {
            let now = Instant::now();
            let (job, receivers) = jobs(&mut p, n, now);
            if let Err(e) = p.ready.scheduler.submit(Job::Generate(job)) {
                let e = ApiError::from(e);
                state.count(&p.model_id, flavor.endpoint(), e.status);
                return e.into_response();
            }
            let mut record = key.map(|k| (k, Vec::new()));
            receivers
                .into_iter()
                .map(|rx| Events::Live {
                    rx,
                    record: record.take(),
                    hard_deadline: p.deadline.map(|d| now + d + Duration::from_secs(2)),
                    peeked: None,
                })
                .collect()
        }
    };
    let meta = Meta {
        id: request_id(flavor),
        created: now_secs(),
        model: p.model_id.clone(),
        flavor,
        logprobs: p.params.logprobs.is_some(),
        include_usage: p.params.include_usage,
        max_tokens_given: p.params.max_tokens.is_some(),
        stall: p.stall,
        tools: p.tools.clone(),
        choice: 0,
    };
    if p.params.stream {
        // The status line waits for the first event of every choice: a request that never
        // starts (its deadline passed in the queue, or the engine refused it) gets an HTTP
        // error, not a 200 with an empty stream.
        let mut sources = sources;
        for source in &mut sources {
            if let Err(e) = source.peek_first(meta.stall, &state, &meta).await {
                state.count(&p.model_id, flavor.endpoint(), e.status);
                return e.into_response();
            }
        }
        state.count(&p.model_id, flavor.endpoint(), 200);
        stream_response(state, meta, sources, guard).into_response()
    } else {
        let resp = collect_all(&state, &meta, sources).await;
        let code = match &resp {
            Ok(_) => 200,
            Err(e) => e.status,
        };
        state.count(&p.model_id, flavor.endpoint(), code);
        drop(guard);
        match resp {
            Ok((v, false)) => axum::Json(v).into_response(),
            // Cut by the deadline, with no `max_tokens` given: what was generated, and why it stopped.
            Ok((v, true)) => ([(TRUNCATED_HEADER, "deadline")], axum::Json(v)).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

/// The scheduler job of a request and the event channel of each of its `n` choices. Choice
/// `i` > 0 is a fork of the job (its prompt evaluated once) with the seed `seed + i` and its
/// own grammar, so a seeded request gives the same choices every time.
fn jobs(
    p: &mut Generation,
    n: u32,
    now: Instant,
) -> (GenerateJob, Vec<mpsc::UnboundedReceiver<GenEvent>>) {
    let mut receivers = Vec::with_capacity(n as usize);
    let mut grammars = std::iter::once(p.constraint.take()).chain(
        std::mem::take(&mut p.fork_constraints)
            .into_iter()
            .map(Some),
    );
    let mut choices: Vec<GenerateJob> = (0..n)
        .map(|i| {
            let (tx, rx) = mpsc::unbounded_channel();
            receivers.push(rx);
            let mut sampling = p.params.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(u64::from(i));
            GenerateJob {
                prompt: p.prompt.clone(),
                max_tokens: p.max_tokens,
                sampling,
                stop: p.params.stop.clone(),
                logprobs: p.params.logprobs,
                deadline: p.deadline.map(|d| now + d),
                fresh: p.params.seeded,
                grammar: grammars
                    .next()
                    .flatten()
                    .map(|c| c as Box<dyn crate::scheduler::Grammar>),
                arrived: now,
                events: tx,
                retried: false,
                forks: Vec::new(),
                speculate: p.params.speculate,
                adapter: p.adapter.as_ref().map(|a| a.name()),
                audio: p.audio.clone(),
                align: false,
                probe: None,
            }
        })
        .collect();
    let mut job = choices.remove(0);
    job.forks = choices;
    (job, receivers)
}

/// Where a request's events come from.
enum Events {
    Cached(std::vec::IntoIter<GenEvent>),
    Live {
        rx: mpsc::UnboundedReceiver<GenEvent>,
        /// Events kept to fill the response cache once the answer is complete.
        record: Option<(CacheKey, Vec<GenEvent>)>,
        hard_deadline: Option<Instant>,
        /// The first event, read before the status line was sent (boxed: a token event is
        /// large and this slot is usually empty).
        peeked: Option<Box<GenEvent>>,
    },
}

enum Next {
    Event(GenEvent),
    /// No token within the stall limit (after the first one) or past the hard deadline.
    Stalled,
    Closed,
}

impl Events {
    /// Wait for the first event; an error when the request ended before producing anything
    /// (queue timeout, engine error), which the caller answers with an HTTP status.
    async fn peek_first(
        &mut self,
        stall: Duration,
        state: &AppState,
        meta: &Meta,
    ) -> Result<(), ApiError> {
        let Events::Live { .. } = self else {
            return Ok(());
        };
        let first = match self.next(false, stall, state).await {
            Next::Event(GenEvent::Done {
                reason: FinishReason::QueueTimeout,
                queued,
                ..
            }) => return Err(queue_timeout(queued)),
            Next::Event(GenEvent::Error(e)) => return Err(ApiError::from(e)),
            Next::Event(ev) => ev,
            Next::Stalled => {
                tracing::warn!(model = %meta.model, id = %meta.id, "deadline passed before the first event");
                return Err(deadline_exceeded(0));
            }
            Next::Closed => {
                return Err(ApiError::internal(
                    "the scheduler ended the request without an answer",
                ));
            }
        };
        if let Events::Live { peeked, .. } = self {
            *peeked = Some(Box::new(first));
        }
        Ok(())
    }

    async fn next(&mut self, seen_first: bool, stall: Duration, state: &AppState) -> Next {
        match self {
            Events::Cached(it) => it.next().map_or(Next::Closed, Next::Event),
            Events::Live {
                rx,
                record,
                hard_deadline,
                peeked,
            } => {
                if let Some(ev) = peeked.take() {
                    return Next::Event(*ev);
                }
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

async fn collect_response(
    state: &AppState,
    meta: &Meta,
    mut source: Events,
) -> Result<(Value, bool), ApiError> {
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
                cached_tokens,
                completion_tokens,
                queued,
            }) => {
                match reason {
                    FinishReason::QueueTimeout => return Err(queue_timeout(queued)),
                    // A request that set no `max_tokens` left the length to the node, whose
                    // bound is the context or the deadline, whichever comes first: it gets
                    // what was generated, `length`, and a header saying which bound cut it.
                    FinishReason::Deadline if meta.max_tokens_given || completion_tokens == 0 => {
                        return Err(deadline_exceeded(completion_tokens));
                    }
                    _ => {}
                }
                let u = usage(prompt_tokens, cached_tokens, completion_tokens);
                let cut = reason == FinishReason::Deadline;
                return Ok((
                    match meta.flavor {
                        Flavor::Chat => {
                            let (message, calls) =
                                tool_reply::message(&text, &meta.tools, &meta.id);
                            json!({
                                "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
                                "system_fingerprint": fingerprint(),
                                "choices": [{
                                    "index": 0,
                                    "message": message,
                                    "logprobs": if meta.logprobs { json!({"content": chat_lp}) } else { Value::Null },
                                    "finish_reason": finish_reason(reason, calls),
                                }],
                                "usage": u,
                            })
                        }
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
                    },
                    cut,
                ));
            }
            Next::Event(GenEvent::Error(e)) => return Err(ApiError::from(e)),
            // Only a transcription asks for times and probabilities.
            Next::Event(GenEvent::Times(_) | GenEvent::Probe(_) | GenEvent::StopLogprob(_)) => {}
            Next::Stalled => {
                state.node.metrics.finished_by_http(&meta.model, "stall");
                return Err(if seen_first {
                    stall_timeout(meta.stall)
                } else {
                    deadline_exceeded(0)
                });
            }
            Next::Closed => {
                return Err(ApiError::internal(
                    "the scheduler ended the request without an answer",
                ));
            }
        }
    }
}

/// Collect every choice (concurrently) into one body: the choices in order with their
/// `index`, the prompt counted once and the completions summed, as OpenAI counts `n` > 1.
/// The first choice that fails fails the request (the others are then cancelled).
async fn collect_all(
    state: &AppState,
    meta: &Meta,
    sources: Vec<Events>,
) -> Result<(Value, bool), ApiError> {
    let answers = futures::future::join_all(
        sources
            .into_iter()
            .map(|s| collect_response(state, meta, s)),
    )
    .await;
    let mut answers = answers.into_iter();
    let (mut body, mut cut) = answers
        .next()
        .ok_or_else(|| ApiError::internal("a request without choices"))??;
    let mut completion = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    for (i, answer) in answers.enumerate() {
        let (v, c) = answer?;
        cut |= c;
        completion += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        let mut choice = v["choices"][0].clone();
        choice["index"] = json!(i + 1);
        if let Some(choices) = body["choices"].as_array_mut() {
            choices.push(choice);
        }
    }
    let prompt = body["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    body["usage"]["completion_tokens"] = json!(completion);
    body["usage"]["total_tokens"] = json!(prompt + completion);
    Ok((body, cut))
}
