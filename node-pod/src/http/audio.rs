//! HTTP layer, speech recognition (entered once per request, from the router):
//! `POST /v1/audio/transcriptions` and `/v1/audio/translations`, as OpenAI's API has them.
//!
//! The request path: the multipart form (`file`, `model`, `language`, `response_format`,
//! `temperature`) → the ready model, which must declare the transcription modality (ABI 1.9)
//! → the upload decoded and resampled to the model's rate (`crate::audio`, off the async
//! runtime) → cut into windows of the model's longest input (Whisper: 30 s), one scheduler job
//! each with its audio (the engine gets it through `seq_set_input` when the sequence opens)
//! and the decoder prompt `<|startoftranscript|>`, language, task, `<|notimestamps|>` → the
//! windows' texts joined, as `json`, `text` or `verbose_json` (one segment per window).
//! Timestamps (`srt`, `vtt`, `timestamp_granularities`), `stream`, `prompt` and language
//! detection are refused with a 400 that says so: not implemented yet.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::Multipart;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{AppState, InflightGuard};
use crate::audio;
use crate::error::ApiError;
use crate::scheduler::{GenEvent, GenerateJob, Job};
use gantry_engine_abi::Sampling;

/// The longest audio one request may hold: 30 minutes.
pub const MAX_AUDIO_SECS: u32 = 1800;

/// Which route: the speech in its own language, or in English.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Transcribe,
    Translate,
}

impl Task {
    fn name(self) -> &'static str {
        match self {
            Task::Transcribe => "transcribe",
            Task::Translate => "translate",
        }
    }
    fn endpoint(self) -> &'static str {
        match self {
            Task::Transcribe => "audio_transcriptions",
            Task::Translate => "audio_translations",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Text,
    VerboseJson,
}

/// The form, read.
struct Form {
    file: Option<(Vec<u8>, Option<String>)>,
    model: Option<String>,
    language: Option<String>,
    format: Format,
    temperature: f32,
}

async fn read_form(mut mp: Multipart) -> Result<Form, ApiError> {
    let mut f = Form {
        file: None,
        model: None,
        language: None,
        format: Format::Json,
        temperature: 0.0,
    };
    let bad = |field: &str, e: axum::extract::multipart::MultipartError| {
        ApiError::invalid(field, format!("the multipart form cannot be read: {e}"))
    };
    while let Some(field) = mp.next_field().await.map_err(|e| bad("file", e))? {
        let name = field.name().unwrap_or_default().to_string();
        if name == "file" {
            let filename = field.file_name().map(str::to_string);
            let bytes = field.bytes().await.map_err(|e| bad("file", e))?;
            f.file = Some((bytes.to_vec(), filename));
            continue;
        }
        let text = field.text().await.map_err(|e| bad(&name, e))?;
        match name.as_str() {
            "model" => f.model = Some(text),
            "language" => f.language = Some(text.trim().to_lowercase()),
            "response_format" => {
                f.format = match text.as_str() {
                    "json" => Format::Json,
                    "text" => Format::Text,
                    "verbose_json" => Format::VerboseJson,
                    "srt" | "vtt" => {
                        return Err(ApiError::unsupported(
                            "response_format",
                            format!(
                                "`response_format` `{text}` needs timestamps, which this node does not produce yet; use json, text or verbose_json"
                            ),
                        ));
                    }
                    other => {
                        return Err(ApiError::invalid(
                            "response_format",
                            format!(
                                "`response_format` must be one of json, text, srt, verbose_json, vtt; got `{other}`"
                            ),
                        ));
                    }
                }
            }
            "temperature" => {
                f.temperature = text
                    .trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|t| (0.0..=1.0).contains(t))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "temperature",
                            format!("`temperature` must be a number from 0 to 1, got `{text}`"),
                        )
                    })?;
            }
            "stream" if text.trim() == "true" => {
                return Err(ApiError::unsupported(
                    "stream",
                    "streamed transcriptions are not implemented yet; leave `stream` false",
                ));
            }
            "timestamp_granularities[]" | "timestamp_granularities" => {
                return Err(ApiError::unsupported(
                    "timestamp_granularities",
                    "timestamps are not implemented yet",
                ));
            }
            "prompt" if !text.is_empty() => {
                return Err(ApiError::unsupported(
                    "prompt",
                    "a `prompt` (text before the audio) is not implemented yet",
                ));
            }
            // Other fields (`stream: false`, `chunking_strategy`, ...) change nothing here.
            _ => {}
        }
    }
    Ok(f)
}

/// The id of a special token the model's vocabulary must hold, `None` when it does not.
fn special(ready: &crate::node::ReadyModel, text: &str) -> Option<i32> {
    match ready.shared.tokenize(text, false, true) {
        Ok(ids) if ids.len() == 1 => Some(ids[0]),
        _ => None,
    }
}

pub async fn transcriptions(state: AppState, mp: Multipart, task: Task) -> Response {
    let r = transcribe(&state, mp, task).await;
    let (model, code) = match &r {
        Ok((m, _)) => (m.clone(), 200),
        Err(e) => ("-".to_string(), e.status),
    };
    state.count(&model, task.endpoint(), code);
    match r {
        Ok((_, resp)) => resp,
        Err(e) => e.into_response(),
    }
}

async fn transcribe(
    state: &AppState,
    mp: Multipart,
    task: Task,
) -> Result<(String, Response), ApiError> {
    let form = read_form(mp).await?;
    let model = form
        .model
        .clone()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::invalid("model", "`model` is required"))?;
    let (bytes, filename) = form
        .file
        .ok_or_else(|| ApiError::invalid("file", "`file` is required: the audio to transcribe"))?;
    let (m, ready) = state.node.ready_model(&model).await?;
    let info = ready.shared.info().clone();
    if !info.supports_transcription() {
        return Err(ApiError::invalid(
            "model",
            format!(
                "model `{model}` does not transcribe audio: its engine serves no transcription (ABI 1.9)"
            ),
        ));
    }
    // The decoder prompt: start, language and task (multilingual models), no timestamps.
    let sot = special(&ready, "<|startoftranscript|>").ok_or_else(|| {
        ApiError::internal(format!(
            "model `{model}` has no <|startoftranscript|> token"
        ))
    })?;
    let mut prompt = vec![sot];
    let english = special(&ready, "<|en|>");
    let multilingual = english.is_some();
    let language = match (&form.language, english) {
        (Some(l), Some(_)) => {
            let id = special(&ready, &format!("<|{l}|>")).ok_or_else(|| {
                ApiError::invalid(
                    "language",
                    format!("`language` `{l}` is not a language model `{model}` knows (ISO-639-1, e.g. en)"),
                )
            })?;
            prompt.push(id);
            l.clone()
        }
        // Language detection is not implemented: English unless the request says otherwise.
        (None, Some(en)) => {
            prompt.push(en);
            "en".to_string()
        }
        (Some(l), None) if l != "en" => {
            return Err(ApiError::invalid(
                "language",
                format!("model `{model}` is English-only; `language` `{l}` is not available"),
            ));
        }
        (_, None) => "en".to_string(),
    };
    if multilingual {
        let t = special(&ready, &format!("<|{}|>", task.name())).ok_or_else(|| {
            ApiError::invalid("model", format!("model `{model}` cannot {}", task.name()))
        })?;
        prompt.push(t);
    } else if task == Task::Translate {
        return Err(ApiError::invalid(
            "model",
            format!("model `{model}` is English-only: it translates nothing"),
        ));
    }
    if let Some(t) = special(&ready, "<|notimestamps|>") {
        prompt.push(t);
    }
    let rate = info.audio_sample_rate;
    let decoded = tokio::task::spawn_blocking(move || {
        audio::decode(bytes, filename.as_deref(), rate, MAX_AUDIO_SECS)
    })
    .await
    .map_err(|e| ApiError::internal(format!("audio decoding task: {e}")))?
    .map_err(|e| ApiError::invalid("file", e.to_string()))?;
    let _guard = InflightGuard::new(state.node.clone());
    let window = info.audio_max_samples.max(1) as usize;
    let max_tokens = info
        .context_length
        .saturating_sub(prompt.len() as u32)
        .max(1);
    let sampling = Sampling {
        temperature: form.temperature,
        want_logprob: true,
        ..Sampling::greedy()
    };
    let mut waiting = Vec::new();
    for chunk in decoded.samples.chunks(window) {
        let (tx, rx) = mpsc::unbounded_channel();
        ready.scheduler.submit(Job::Generate(GenerateJob {
            prompt: prompt.clone(),
            max_tokens,
            sampling: sampling.clone(),
            stop: Vec::new(),
            logprobs: Some(0),
            deadline: m
                .config
                .request_timeout(&state.node.config.scheduler)
                .map(|d| Instant::now() + d),
            fresh: true,
            grammar: None,
            arrived: Instant::now(),
            events: tx,
            retried: false,
            forks: Vec::new(),
            speculate: false,
            adapter: None,
            audio: Some(Arc::new(chunk.to_vec())),
        }))?;
        waiting.push(rx);
    }
    let mut segments = Vec::new();
    let mut texts = Vec::new();
    for (i, mut rx) in waiting.into_iter().enumerate() {
        let (mut text, mut lps) = (String::new(), Vec::new());
        let tokens = loop {
            match rx.recv().await {
                Some(GenEvent::Token { text: t, logprob }) => {
                    text.push_str(&t);
                    if let Some(lp) = logprob {
                        lps.push(lp.logprob);
                    }
                }
                Some(GenEvent::Done {
                    completion_tokens, ..
                }) => break completion_tokens,
                Some(GenEvent::Error(e)) => return Err(ApiError::from(e)),
                None => {
                    return Err(ApiError::internal(
                        "the scheduler ended the transcription without an answer",
                    ));
                }
            }
        };
        let start = (i * window) as f64 / f64::from(rate);
        let end = (start + window as f64 / f64::from(rate)).min(decoded.seconds);
        let avg = if lps.is_empty() {
            0.0
        } else {
            lps.iter().sum::<f32>() / lps.len() as f32
        };
        segments.push(json!({
            "id": i, "seek": i * window / 160, "start": start, "end": end, "text": text,
            "tokens": tokens, "temperature": form.temperature, "avg_logprob": avg,
        }));
        texts.push(text.trim().to_string());
    }
    let text = texts.join(" ");
    let body: Value = match form.format {
        Format::Text => {
            return Ok((
                model,
                ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response(),
            ));
        }
        Format::Json => json!({
            "text": text,
            "usage": {"type": "duration", "seconds": decoded.seconds.ceil() as u64},
        }),
        Format::VerboseJson => json!({
            "task": task.name(), "language": language, "duration": decoded.seconds,
            "text": text, "segments": segments,
            "usage": {"type": "duration", "seconds": decoded.seconds.ceil() as u64},
        }),
    };
    Ok((model, axum::Json(body).into_response()))
}
