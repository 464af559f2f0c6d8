//! HTTP layer, streamed responses (the last step of a `stream: true` generation): each
//! choice's events as SSE chunks, several choices (`n` > 1) interleaved as their tokens come,
//! then one usage chunk if asked for and `[DONE]`.

use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use futures::stream::{self, Stream, StreamExt};
use serde_json::{Value, json};

use gantry_openai::reply::{
    Flavor, Meta, deadline_exceeded, finish_reason, queue_timeout, stall_timeout,
};
use gantry_openai::tool_reply::{self, ToolReader};

use super::{Events, Next};
use crate::error::ApiError;
use crate::http::{AppState, InflightGuard};
use crate::scheduler::{FinishReason, GenEvent, TokenLogprob};

/// Usage of the choices of one stream (`n` > 1), summed for its last chunk.
#[derive(Default)]
struct Totals {
    prompt: u32,
    cached: Option<u32>,
    completion: u32,
}

/// State carried from one SSE event to the next.
struct StreamState {
    state: AppState,
    meta: Meta,
    source: Events,
    started: bool,
    seen_first: bool,
    done: bool,
    text_len: usize,
    /// Reads tool calls out of the text (chat replies with tools).
    tools: Option<ToolReader>,
    /// Whether a tool call was streamed (the finish reason is then `tool_calls`).
    sent_call: bool,
    /// One choice of several (`n` > 1): its usage goes here and the merged stream sends the
    /// usage chunk and `[DONE]` once, after every choice ended.
    shared: Option<std::sync::Arc<std::sync::Mutex<Totals>>>,
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

impl StreamState {
    /// A token's text read for tool calls: one chunk per delta; a token whose text is held
    /// (inside a call) still sends its logprobs in a chunk with an empty delta.
    fn tool_chunks(&mut self, text: &str, logprob: Option<&TokenLogprob>, out: &mut Vec<Event>) {
        let pieces = self
            .tools
            .as_mut()
            .map(|r| r.push(text))
            .unwrap_or_default();
        self.push_deltas(pieces, logprob, out);
    }

    fn push_deltas(
        &mut self,
        pieces: Vec<crate::toolcall::Piece>,
        logprob: Option<&TokenLogprob>,
        out: &mut Vec<Event>,
    ) {
        let deltas = tool_reply::deltas(pieces, &self.meta.id);
        if deltas.is_empty() && logprob.is_some() {
            let mut c = self.meta.chunk("", self.text_len, logprob, None);
            c["choices"][0]["delta"] = json!({});
            out.push(data(&c));
        }
        for (i, d) in deltas.into_iter().enumerate() {
            self.sent_call |= d.get("tool_calls").is_some();
            let mut c =
                self.meta
                    .chunk("", self.text_len, if i == 0 { logprob } else { None }, None);
            c["choices"][0]["delta"] = d;
            out.push(data(&c));
        }
    }

    /// The stream's end: `[DONE]`, unless the merged stream of several choices sends it.
    fn end(&mut self, out: &mut Vec<Event>) {
        if self.shared.is_none() {
            out.push(Event::default().data("[DONE]"));
        }
        self.done = true;
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
                let mut first = self.meta.chunk("", self.text_len, None, None);
                first["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
                out.push(data(&first));
                return out;
            }
        }
        // A token whose text is held (a possible stop sequence, a tool call being read) gives
        // no event; read on, since an empty batch would end the stream.
        loop {
            match self
                .source
                .next(self.seen_first, self.meta.stall, &self.state)
                .await
            {
                Next::Event(GenEvent::Token { text, logprob }) => {
                    self.seen_first = true;
                    if self.tools.is_some() {
                        self.tool_chunks(&text, logprob.as_ref(), &mut out);
                    } else {
                        out.push(data(&self.meta.chunk(
                            &text,
                            self.text_len,
                            logprob.as_ref(),
                            None,
                        )));
                    }
                    self.text_len += text.len();
                }
                Next::Event(GenEvent::Done {
                    reason,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                    queued,
                }) => {
                    let cut = match reason {
                        FinishReason::Deadline => Some(deadline_exceeded(completion_tokens)),
                        FinishReason::QueueTimeout => Some(queue_timeout(queued)),
                        FinishReason::Stop | FinishReason::Length | FinishReason::Failed => None,
                    };
                    if let Some(mut reader) = self.tools.take() {
                        let pieces = reader.finish();
                        self.push_deltas(pieces, None, &mut out);
                    }
                    if cut.is_none() {
                        let finish = finish_reason(reason, self.sent_call);
                        out.push(data(&self.meta.chunk(
                            "",
                            self.text_len,
                            None,
                            Some(finish),
                        )));
                    }
                    if let Some(totals) = &self.shared {
                        if let Ok(mut t) = totals.lock() {
                            t.prompt = prompt_tokens;
                            t.cached = t.cached.or(cached_tokens);
                            t.completion += completion_tokens;
                        }
                    } else if self.meta.include_usage {
                        out.push(data(&self.meta.usage_chunk(
                            prompt_tokens,
                            cached_tokens,
                            completion_tokens,
                        )));
                    }
                    // A cut stream ends with an error event (as OpenAI ends a stream that fails
                    // midway), never with a `finish_reason` a client would read as complete.
                    if let Some(e) = cut {
                        tracing::info!(model = %self.meta.model, id = %self.meta.id, code = ?e.code, "the stream was cut by its deadline");
                        out.push(Event::default().data(e.body_json()));
                    }
                    self.end(&mut out);
                }
                // Only a transcription asks for times and probabilities.
                Next::Event(GenEvent::Times(_) | GenEvent::Probe(_) | GenEvent::StopLogprob(_)) => {
                }
                Next::Event(GenEvent::Error(e)) => {
                    let e = ApiError::from(e);
                    out.push(Event::default().data(e.body_json()));
                    self.end(&mut out);
                }
                Next::Stalled => {
                    tracing::warn!(model = %self.meta.model, id = %self.meta.id, "no token within the stall limit; ending the stream");
                    self.state
                        .node
                        .metrics
                        .finished_by_http(&self.meta.model, "stall");
                    let e = if self.seen_first {
                        stall_timeout(self.meta.stall)
                    } else {
                        deadline_exceeded(0)
                    };
                    out.push(Event::default().data(e.body_json()));
                    self.end(&mut out);
                }
                Next::Closed => {
                    out.push(Event::default().data(
                        ApiError::internal("the request ended without an answer").body_json(),
                    ));
                    self.done = true;
                }
            }
            if !out.is_empty() || self.done {
                return out;
            }
        }
    }
}

pub(super) fn stream_response(
    state: AppState,
    meta: Meta,
    sources: Vec<Events>,
    guard: InflightGuard,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let several = sources.len() > 1;
    let totals = std::sync::Arc::new(std::sync::Mutex::new(Totals::default()));
    let choices: Vec<_> = sources
        .into_iter()
        .enumerate()
        .map(|(i, source)| {
            let meta = Meta {
                choice: i as u32,
                ..meta.clone()
            };
            let st = StreamState {
                state: state.clone(),
                tools: match meta.flavor {
                    Flavor::Chat => ToolReader::new(&meta.tools),
                    Flavor::Completion => None,
                },
                meta,
                source,
                started: false,
                seen_first: false,
                done: false,
                text_len: 0,
                sent_call: false,
                shared: several.then(|| totals.clone()),
            };
            stream::unfold(st, |mut st| async move {
                let batch = st.advance().await;
                if batch.is_empty() {
                    None
                } else {
                    Some((stream::iter(batch.into_iter().map(Ok)), st))
                }
            })
            .flatten()
            .boxed()
        })
        .collect();
    // Several choices interleave as their tokens come; once all ended, one usage chunk (if
    // asked for) and `[DONE]`. The in-flight guard lives until then.
    let tail = stream::once(async move {
        let _guard = guard;
        let mut out = Vec::new();
        if several {
            if meta.include_usage
                && let Ok(t) = totals.lock()
            {
                out.push(Ok(data(&meta.usage_chunk(
                    t.prompt,
                    t.cached,
                    t.completion,
                ))));
            }
            out.push(Ok(Event::default().data("[DONE]")));
        }
        stream::iter(out)
    })
    .flatten();
    Sse::new(stream::select_all(choices).chain(tail))
}
