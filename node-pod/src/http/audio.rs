//! HTTP layer, speech recognition (entered once per request, from the router):
//! `POST /v1/audio/transcriptions` and `/v1/audio/translations`, as OpenAI's API has them.
//!
//! The request path: the multipart form (`file`, `model`, `language`, `prompt`,
//! `response_format`, `timestamp_granularities[]`, `temperature`, `stream`, `include[]`) →
//! the ready model, which must declare the transcription modality (ABI 1.9) → the upload
//! decoded and resampled to the model's rate (`crate::audio`, off the async runtime) → cut
//! into windows of the model's longest input (Whisper: 30 s), one scheduler job each with its
//! audio (the engine gets it through `seq_set_input` when the sequence opens) and the decoder
//! prompt (`<|startofprev|>` and the `prompt`'s tokens, `<|startoftranscript|>`, language and
//! task for multilingual models, `<|notimestamps|>` unless the format needs times), decoded
//! again at higher temperatures when the answer fails openai-whisper's thresholds and dropped
//! when it is silence (`audio/decoder.rs`, `transcript/fallback.rs`; `temperature` 0 only) →
//! each window's tokens, cut into segments by their timestamps (`crate::transcript`) → `json`,
//! `text`, `verbose_json`, `srt` or `vtt`; or, with `stream`, each token's text as a
//! `transcript.text.delta` event as the windows decode, then `transcript.text.done`;
//! `include[]=logprobs` (json) adds each text token's log-probability to the answer and to
//! the events.
//! Without a `language`, a multilingual model's first window decides it (`detect_language`).
//! Word timestamps (`timestamp_granularities[]=word`): each window's job asks the engine to
//! align its tokens with the audio (ABI 1.11 `seq_token_times`), and `crate::transcript`
//! groups the timed tokens into words.

use axum::extract::Multipart;
use axum::http::header;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{AppState, InflightGuard};
use crate::audio;
use crate::error::ApiError;
use crate::transcript::{self, Segment};
use gantry_engine_abi::Sampling;

mod decoder;
mod form;
use decoder::{Decoder, collect, submit};
use form::{Form, Format, read_form};

/// The longest audio one request may hold: 30 minutes.
pub const MAX_AUDIO_SECS: u32 = 1800;

/// Every released English-only Whisper (`tiny.en` to `medium.en`) has this vocabulary; the
/// multilingual ones have one or two tokens more (openai-whisper tells them apart the same
/// way). An English-only model's decoder prompt has no language and no task.
const ENGLISH_ONLY_VOCAB: u32 = 51_864;

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

/// Whether the model's decoder prompt names a language and a task (multilingual Whisper).
fn multilingual(ready: &crate::node::ReadyModel) -> bool {
    special(ready, "<|en|>").is_some() && ready.shared.info().vocab_size != ENGLISH_ONLY_VOCAB
}

/// The decoder prompt for the form in `language` (the form's, or the detected one; English
/// when neither), and the language the answer reports.
fn decoder_prompt(
    ready: &crate::node::ReadyModel,
    model: &str,
    (form, language): (&Form, Option<&str>),
    task: Task,
    timed: bool,
) -> Result<(Vec<i32>, String), ApiError> {
    let info = ready.shared.info();
    let sot = special(ready, "<|startoftranscript|>").ok_or_else(|| {
        ApiError::internal(format!(
            "model `{model}` has no <|startoftranscript|> token"
        ))
    })?;
    let mut prompt = Vec::new();
    if let Some(text) = &form.prompt {
        // Text before the audio, as openai-whisper gives it: `<|startofprev|>` and the
        // prompt's last tokens, at most half the decoder's context.
        let prev = special(ready, "<|startofprev|>").ok_or_else(|| {
            ApiError::invalid(
                "prompt",
                format!("model `{model}` takes no `prompt` (it has no <|startofprev|> token)"),
            )
        })?;
        let ids = ready
            .shared
            .tokenize(&format!(" {}", text.trim()), false, false)
            .map_err(|e| ApiError::invalid("prompt", format!("`prompt`: {}", e.message)))?;
        let keep = (info.context_length as usize / 2).saturating_sub(1);
        prompt.push(prev);
        prompt.extend_from_slice(&ids[ids.len().saturating_sub(keep)..]);
    }
    prompt.push(sot);
    let multilingual = multilingual(ready);
    let language = match (language, multilingual) {
        (l, true) => {
            let l = l.unwrap_or("en");
            let id = special(ready, &format!("<|{l}|>")).ok_or_else(|| {
                ApiError::invalid(
                    "language",
                    format!("`language` `{l}` is not a language model `{model}` knows (ISO-639-1, e.g. en)"),
                )
            })?;
            prompt.push(id);
            l.to_string()
        }
        (Some(l), false) if l != "en" => {
            return Err(ApiError::invalid(
                "language",
                format!("model `{model}` is English-only; `language` `{l}` is not available"),
            ));
        }
        (_, false) => "en".to_string(),
    };
    if multilingual {
        let t = special(ready, &format!("<|{}|>", task.name())).ok_or_else(|| {
            ApiError::invalid("model", format!("model `{model}` cannot {}", task.name()))
        })?;
        prompt.push(t);
    } else if task == Task::Translate {
        return Err(ApiError::invalid(
            "model",
            format!("model `{model}` is English-only: it translates nothing"),
        ));
    }
    if !timed && let Some(t) = special(ready, "<|notimestamps|>") {
        prompt.push(t);
    }
    Ok((prompt, language))
}

async fn transcribe(
    state: &AppState,
    mp: Multipart,
    task: Task,
) -> Result<(String, Response), ApiError> {
    let mut form = read_form(mp).await?;
    let model = form
        .model
        .clone()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::invalid("model", "`model` is required"))?;
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
    if form.logprobs && task == Task::Translate {
        return Err(ApiError::invalid(
            "include",
            "`include` logprobs is for transcriptions; translations take no `include`",
        ));
    }
    // The form's fields checked before the audio is decoded.
    let given = form.language.clone();
    decoder_prompt(&ready, &model, (&form, given.as_deref()), task, false)?;
    let (bytes, filename) = form
        .file
        .take()
        .ok_or_else(|| ApiError::invalid("file", "`file` is required: the audio to transcribe"))?;
    let rate = info.audio_sample_rate;
    let decoded = tokio::task::spawn_blocking(move || {
        audio::decode(bytes, filename.as_deref(), rate, MAX_AUDIO_SECS)
    })
    .await
    .map_err(|e| ApiError::internal(format!("audio decoding task: {e}")))?
    .map_err(|e| ApiError::invalid("file", e.to_string()))?;
    let window = info.audio_max_samples.max(1) as usize;
    // Audio longer than a window is decoded with timestamps whatever the format: where a
    // window's last segment is cut off, the next window starts there.
    let timed = form.format.timed() || decoded.samples.len() > window;
    let guard = InflightGuard::new(state.node.clone());
    let timeout = m.config.request_timeout(&state.node.config.scheduler);
    // No language given to a multilingual model: the first window's, as the model hears it.
    let language = match given {
        None if multilingual(&ready) => {
            let first = &decoded.samples[..window.min(decoded.samples.len())];
            Some(detect_language(&ready, first, timeout).await?)
        }
        l => l,
    };
    let (prompt, language) =
        decoder_prompt(&ready, &model, (&form, language.as_deref()), task, timed)?;
    // Temperature 0 is OpenAI's "increase the temperature until certain thresholds are hit"
    // (`transcript/fallback.rs`), unless the model's `temperatureFallback` is false.
    let fallback = form.temperature == 0.0 && m.config.temperature_fallback != Some(false);
    // openai-whisper's no-speech probability: `<|nospeech|>` (`<|nocaptions|>` in the
    // English-only models' older vocabulary) right after `<|startoftranscript|>`, for
    // `verbose_json` and for the fallback's silence test.
    let live_single = form.stream && decoded.samples.len() <= window;
    let probe = (form.format == Format::VerboseJson || (fallback && !live_single))
        .then(|| {
            let sot = special(&ready, "<|startoftranscript|>")?;
            let at = prompt.iter().position(|&t| t == sot)?;
            let token =
                special(&ready, "<|nospeech|>").or_else(|| special(&ready, "<|nocaptions|>"))?;
            Some((at + 1, token))
        })
        .flatten();
    let dec = Decoder {
        // At most half the decoder's context, as openai-whisper's `sample_len` (224 tokens
        // for Whisper; 30 s of speech is about 100), so a runaway sample ends there.
        max_tokens: info
            .context_length
            .saturating_sub(prompt.len() as u32)
            .min(info.context_length / 2)
            .max(1),
        prompt,
        // Timestamps are the tokens after `<|notimestamps|>`.
        first_timestamp: special(&ready, "<|notimestamps|>").map(|t| t + 1),
        sampling: Sampling {
            temperature: form.temperature,
            want_logprob: true,
            ..Sampling::greedy()
        },
        align: form.words,
        probe,
        timeout,
        ready,
        samples: decoded.samples,
        seconds: decoded.seconds,
        window,
        rate,
        fallback,
        live: live_single,
        windows: state.node.metrics.transcription_windows.clone(),
        model: model.clone(),
        _guard: guard,
    };
    if form.stream {
        return Ok((model, stream(dec, form.logprobs)));
    }
    let segments = dec.run(|_, _| {}).await?;
    let segs = || segments.iter().map(|(_, s)| s);
    let text = joined(segs());
    let plain = |body: String, kind: &str| {
        Ok((
            model.clone(),
            ([(header::CONTENT_TYPE, kind.to_string())], body).into_response(),
        ))
    };
    let usage = json!({"type": "duration", "seconds": dec.seconds.ceil() as u64});
    let body: Value = match form.format {
        Format::Text => return plain(text, "text/plain; charset=utf-8"),
        Format::Srt => return plain(transcript::srt(segs()), "text/plain; charset=utf-8"),
        Format::Vtt => return plain(transcript::vtt(segs()), "text/vtt; charset=utf-8"),
        Format::Json if form.logprobs => json!({
            "text": text, "usage": usage,
            "logprobs": transcript::logprobs_json(segs().flat_map(|s| &s.logprobs)),
        }),
        Format::Json => json!({"text": text, "usage": usage}),
        Format::VerboseJson => {
            let mut v = json!({
                "task": task.name(), "language": language, "duration": dec.seconds, "text": text,
                "usage": usage,
            });
            if form.segments {
                v["segments"] = transcript::verbose(&segments).into();
            }
            if form.words {
                v["words"] = transcript::words_json(segs());
            }
            v
        }
    };
    Ok((model, axum::Json(body).into_response()))
}

/// The language of `audio` (a window) as the model hears it: one token sampled after a bare
/// `<|startoftranscript|>`, which the engine restricts to the language tokens there (the
/// native engine's Whisper rules; openai-whisper's `detect_language`), read back as its code.
async fn detect_language(
    ready: &crate::node::ReadyModel,
    audio: &[f32],
    timeout: Option<std::time::Duration>,
) -> Result<String, ApiError> {
    let sot = special(ready, "<|startoftranscript|>")
        .ok_or_else(|| ApiError::internal("the model has no <|startoftranscript|> token"))?;
    let sampling = Sampling {
        want_logprob: true,
        ..Sampling::greedy()
    };
    let rx = submit(
        ready,
        (&[sot], 1),
        std::slice::from_ref(&sampling),
        (false, None),
        timeout,
        audio,
    )?
    .remove(0);
    let tokens = collect(rx, sampling.temperature, |_, _| {}).await?.tokens;
    let token = tokens
        .first()
        .ok_or_else(|| ApiError::internal("language detection sampled nothing"))?;
    let text = ready
        .shared
        .detokenize(&[token.id], true)
        .map_err(|e| ApiError::internal(format!("language detection: {}", e.message)))?;
    let text = String::from_utf8_lossy(&text);
    text.strip_prefix("<|")
        .and_then(|t| t.strip_suffix("|>"))
        .filter(|c| (2..=3).contains(&c.len()) && c.bytes().all(|b| b.is_ascii_lowercase()))
        .map(str::to_string)
        .ok_or_else(|| {
            ApiError::internal(format!(
                "language detection: the model answered {text:?}, not a language token (its engine does not detect languages)"
            ))
        })
}

/// The answer's `text`: the segments' texts, trimmed, one space apart.
fn joined<'a>(segments: impl Iterator<Item = &'a Segment>) -> String {
    segments
        .map(|s| s.text.trim())
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// `stream`: the text as `transcript.text.delta` events as it is decoded (each token's for
/// audio of one window, each kept segment's for longer audio), then `transcript.text.done`
/// with the whole text; an error ends the stream with OpenAI's error body as its last event,
/// as a failing chat stream does.
fn stream(dec: Decoder, logprobs: bool) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<Event>();
    tokio::spawn(async move {
        let send = |v: Value| {
            let _ = tx.send(Event::default().data(v.to_string()));
        };
        let mut started = false;
        let result = dec
            .run(|t, lp| {
                // The first delta without the leading space the text's first word has, as
                // the unstreamed `text` is trimmed; each later segment starts on a new word.
                let delta = match std::mem::replace(&mut started, true) {
                    false => t.trim_start().to_string(),
                    true => t.to_string(),
                };
                let mut event = json!({"type": "transcript.text.delta", "delta": delta});
                if logprobs {
                    event["logprobs"] = transcript::logprobs_json(lp);
                }
                send(event);
            })
            .await;
        match result {
            Ok(segments) => {
                let segs = || segments.iter().map(|(_, s)| s);
                let mut event = json!({
                    "type": "transcript.text.done",
                    "text": joined(segs()),
                    "usage": {"type": "duration", "seconds": dec.seconds.ceil() as u64},
                });
                if logprobs {
                    event["logprobs"] = transcript::logprobs_json(segs().flat_map(|s| &s.logprobs));
                }
                send(event);
            }
            Err(e) => {
                let _ = tx.send(Event::default().data(e.body_json()));
            }
        }
    });
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|e| (Ok::<_, std::convert::Infallible>(e), rx))
    });
    Sse::new(events).into_response()
}
