//! HTTP layer, speech synthesis (entered once per request, from the router):
//! `POST /v1/audio/speech`, as OpenAI's API has it.
//!
//! The request path: the JSON body checked (`openai::validate::speech`: input length, format,
//! speed, stream format) → the ready model, which must declare the speech modality (ABI 1.10)
//! and know the `voice` → one scheduler job (`Job::Speech`), which the engine turns into
//! pieces (a sentence each) between the steps of anything else on the replica → the pieces
//! as 16-bit PCM: `wav` or `flac` (the voice's rate, one file once all is made), `pcm` (24 kHz
//! as OpenAI's, sent as each piece is made), or with `stream_format: "sse"` each piece as a
//! `speech.audio.delta` event and then `speech.audio.done`.

use std::time::Instant;

use axum::body::Body;
use axum::http::header;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::json;
use tokio::sync::mpsc;

use super::{AppState, InflightGuard};
use crate::audio;
use crate::error::ApiError;
use crate::scheduler::{Job, SpeechEvent, SpeechJob};
use gantry_openai::validate::speech::{SpeechFormat, StreamFormat, ValidSpeechRequest};

/// OpenAI's `pcm`: 24 kHz, 16-bit, mono.
pub const PCM_RATE: u32 = 24_000;

pub async fn speech(state: AppState, body: axum::body::Bytes) -> Response {
    let r = speak(&state, &body).await;
    let (model, code) = match &r {
        Ok((m, _)) => (m.clone(), 200),
        Err(e) => ("-".to_string(), e.status),
    };
    state.count(&model, "audio_speech", code);
    match r {
        Ok((_, resp)) => resp,
        Err(e) => e.into_response(),
    }
}

/// The pieces of one speech as they come, and what each becomes on the wire.
struct Pieces {
    rx: mpsc::UnboundedReceiver<SpeechEvent>,
    rate: u32,
    format: SpeechFormat,
    /// Seconds of audio so far.
    seconds: f64,
    _guard: InflightGuard,
}

impl Pieces {
    /// The next piece's samples; `Ok(None)` after the last.
    async fn next(&mut self) -> Result<Option<Vec<f32>>, ApiError> {
        match self.rx.recv().await {
            Some(SpeechEvent::Audio(samples)) => {
                self.seconds += samples.len() as f64 / f64::from(self.rate);
                Ok(Some(samples))
            }
            Some(SpeechEvent::Done { .. }) => Ok(None),
            Some(SpeechEvent::Error(e)) => Err(ApiError::from(e)),
            None => Err(ApiError::internal("the scheduler dropped the speech")),
        }
    }

    /// Every sample from `first` to the last piece, for an answer sent as one file.
    async fn all(&mut self, first: Option<Vec<f32>>) -> Result<Vec<f32>, ApiError> {
        let mut samples = Vec::new();
        let mut next = first;
        while let Some(s) = next {
            samples.extend_from_slice(&s);
            next = self.next().await?;
        }
        Ok(samples)
    }

    /// A piece's bytes in the answer's format (a `wav` stream's samples at the voice's rate).
    fn bytes(&self, samples: &[f32]) -> Result<Vec<u8>, ApiError> {
        match self.format {
            SpeechFormat::Wav | SpeechFormat::Flac => Ok(audio::pcm16(samples)),
            SpeechFormat::Pcm => audio::resample(samples, self.rate, PCM_RATE)
                .map(|s| audio::pcm16(&s))
                .map_err(|e| ApiError::internal(format!("resampling to 24 kHz: {e}"))),
        }
    }

    /// What starts a stream: a `wav` header whose length is not known yet.
    fn preamble(&self) -> Vec<u8> {
        match self.format {
            SpeechFormat::Wav => audio::wav_header(self.rate, 1, None),
            SpeechFormat::Pcm | SpeechFormat::Flac => Vec::new(),
        }
    }
}

async fn speak(state: &AppState, body: &[u8]) -> Result<(String, Response), ApiError> {
    let req: gantry_openai::request::SpeechRequest = gantry_openai::request::parse(body)?;
    let valid: ValidSpeechRequest = gantry_openai::validate::speech::speech(&req)?;
    let model = valid.model.clone();
    let (m, ready) = state.node.ready_model(&model).await?;
    let info = ready.shared.info().clone();
    if !info.supports_speech() {
        return Err(ApiError::invalid(
            "model",
            format!(
                "model `{model}` does not synthesize speech: its engine serves no speech (ABI 1.10)"
            ),
        ));
    }
    if let Some(v) = &valid.voice
        && !info.voices.iter().any(|k| k == v)
    {
        return Err(ApiError::invalid(
            "voice",
            format!(
                "`voice` {v:?} is not a voice of model `{model}`; it has: {}",
                info.voices.join(", ")
            ),
        ));
    }
    let guard = InflightGuard::new(state.node.clone());
    let timeout = m.config.request_timeout(&state.node.config.scheduler);
    let (tx, rx) = mpsc::unbounded_channel();
    let arrived = Instant::now();
    ready.scheduler.submit(Job::Speech(SpeechJob {
        text: valid.input.clone(),
        voice: valid.voice.clone(),
        speed: valid.speed,
        deadline: timeout.map(|t| arrived + t),
        arrived,
        events: tx,
    }))?;
    let mut pieces = Pieces {
        rx,
        rate: info.audio_sample_rate,
        format: valid.format,
        seconds: 0.0,
        _guard: guard,
    };
    // The first piece (or the refusal) comes before any byte is sent, so a bad request still
    // gets its error as JSON with its status. The voice was checked here: what the engine
    // refuses at the start is the text.
    let first = pieces.next().await.map_err(|mut e| {
        if e.status == 400 && e.param.is_none() {
            e.param = Some("input".into());
        }
        e
    })?;
    let content_type = match valid.format {
        SpeechFormat::Wav => "audio/wav",
        SpeechFormat::Pcm => "audio/pcm",
        SpeechFormat::Flac => "audio/flac",
    };
    let resp = match (valid.stream, valid.format) {
        (StreamFormat::Sse, _) => sse(pieces, first),
        (StreamFormat::Audio, SpeechFormat::Wav) => {
            // One file with its exact length once every piece is made.
            let data = audio::pcm16(&pieces.all(first).await?);
            let mut file = audio::wav_header(pieces.rate, 1, Some(data.len() as u32));
            file.extend_from_slice(&data);
            ([(header::CONTENT_TYPE, content_type)], file).into_response()
        }
        (StreamFormat::Audio, SpeechFormat::Pcm) => (
            [(header::CONTENT_TYPE, content_type)],
            chunked(pieces, first),
        )
            .into_response(),
        (StreamFormat::Audio, SpeechFormat::Flac) => {
            let samples = pieces.all(first).await?;
            let rate = pieces.rate;
            let file = tokio::task::spawn_blocking(move || audio::flac(&samples, rate))
                .await
                .map_err(|e| ApiError::internal(format!("FLAC encoding task: {e}")))?
                .map_err(ApiError::internal)?;
            ([(header::CONTENT_TYPE, content_type)], file).into_response()
        }
    };
    Ok((model, resp))
}

/// The audio bytes sent as each piece is made; a failure after the first piece ends the body
/// early (the status is already sent), and the node logs it.
fn chunked(mut pieces: Pieces, first: Option<Vec<f32>>) -> Body {
    let (tx, rx) = mpsc::unbounded_channel::<Result<Vec<u8>, std::io::Error>>();
    tokio::spawn(async move {
        let mut next = first;
        let _ = tx.send(Ok(pieces.preamble()));
        while let Some(samples) = next {
            let sent = pieces.bytes(&samples).map(|b| tx.send(Ok(b)));
            if sent.is_err() || tx.is_closed() {
                return;
            }
            next = match pieces.next().await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e.message, "speech stream ended early");
                    let _ = tx.send(Err(std::io::Error::other(e.message)));
                    return;
                }
            };
        }
    });
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (b, rx))
    }))
}

/// `speech.audio.delta` events (base64 audio, a `wav` header first) as pieces are made, then
/// `speech.audio.done` with the seconds of audio; a failure is an error event.
fn sse(mut pieces: Pieces, first: Option<Vec<f32>>) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<Event>();
    tokio::spawn(async move {
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let send = |v: serde_json::Value| tx.send(Event::default().data(v.to_string())).is_ok();
        let mut next = first;
        let mut head = pieces.preamble();
        while let Some(samples) = next {
            let bytes = match pieces.bytes(&samples) {
                Ok(b) => b,
                Err(e) => {
                    let _ = tx.send(Event::default().data(e.body_json()));
                    return;
                }
            };
            head.extend_from_slice(&bytes);
            if !send(
                json!({"type": "speech.audio.delta", "audio": b64(&std::mem::take(&mut head))}),
            ) {
                return;
            }
            next = match pieces.next().await {
                Ok(n) => n,
                Err(e) => {
                    let _ = tx.send(Event::default().data(e.body_json()));
                    return;
                }
            };
        }
        send(json!({
            "type": "speech.audio.done",
            "usage": {"type": "duration", "seconds": pieces.seconds},
        }));
    });
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|e| (Ok::<_, std::convert::Infallible>(e), rx))
    });
    Sse::new(events).into_response()
}
