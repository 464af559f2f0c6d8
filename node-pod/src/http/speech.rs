//! HTTP layer, speech synthesis (entered once per request, from the router):
//! `POST /v1/audio/speech`, as OpenAI's API has it.
//!
//! The request path: the JSON body checked (`openai::validate::speech`: input length, format,
//! speed, stream format) → the ready model, which must declare the speech modality (ABI 1.10)
//! and know the `voice` → one scheduler job (`Job::Speech`), which the engine turns into
//! pieces (a sentence each) between the steps of anything else on the replica → the pieces
//! encoded (`audio::encode`): `mp3` (OpenAI's default), `opus` (in Ogg) and `pcm` (24 kHz as
//! OpenAI's) sent as each piece is made; `wav` and `flac` as one file once all is made; or,
//! with `stream_format: "sse"`, the bytes of each piece as a `speech.audio.delta` event and
//! then `speech.audio.done`.

use std::time::Instant;

use axum::body::Body;
use axum::http::header;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::json;
use tokio::sync::mpsc;

use super::{AppState, InflightGuard};
use crate::audio::encode;
use crate::error::ApiError;
use crate::scheduler::{Job, SpeechEvent, SpeechJob};
use gantry_openai::validate::speech::{SpeechFormat, StreamFormat, ValidSpeechRequest};

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

/// The pieces of one speech as they come.
struct Pieces {
    rx: mpsc::UnboundedReceiver<SpeechEvent>,
    rate: u32,
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
}

/// The bytes of a streamed answer, piece by piece: encoding (resampling, LAME, libopus) runs
/// on the blocking pool, off the threads that serve requests.
struct Encoded {
    pieces: Pieces,
    stream: Option<encode::Stream>,
    next: Option<Vec<f32>>,
    started: bool,
    done: bool,
}

impl Encoded {
    async fn blocking<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut encode::Stream) -> Result<T, String> + Send + 'static,
    ) -> Result<T, ApiError> {
        let mut stream = self
            .stream
            .take()
            .ok_or_else(|| ApiError::internal("the speech encoder was lost"))?;
        let (stream, r) = tokio::task::spawn_blocking(move || {
            let r = f(&mut stream);
            (stream, r)
        })
        .await
        .map_err(|e| ApiError::internal(format!("speech encoding task: {e}")))?;
        self.stream = Some(stream);
        r.map_err(ApiError::internal)
    }

    /// The next bytes to send: the header with the first piece, each piece as soon as it is
    /// encoded, the encoder's tail once the last piece is known to be the last; `None` once
    /// all is sent.
    async fn bytes(&mut self) -> Result<Option<Vec<u8>>, ApiError> {
        if self.done {
            return Ok(None);
        }
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            out = self.blocking(|s| s.start()).await?;
        }
        let next = match self.next.take() {
            Some(first) => Some(first),
            None => self.pieces.next().await?,
        };
        match next {
            Some(samples) => out.extend(self.blocking(move |s| s.piece(&samples)).await?),
            None => {
                out.extend(self.blocking(|s| s.finish()).await?);
                self.done = true;
            }
        }
        Ok(Some(out))
    }
}

/// The next bytes of `encoded`, or `None` when the client has gone (`closed` resolves): the
/// wait for the next piece ends then, and dropping the pieces abandons the speech in the
/// scheduler.
async fn next_or_gone(
    encoded: &mut Encoded,
    closed: impl std::future::Future<Output = ()>,
) -> Option<Result<Option<Vec<u8>>, ApiError>> {
    tokio::select! {
        r = encoded.bytes() => Some(r),
        () = closed => None,
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
    let rate = pieces.rate;
    let content_type = match valid.format {
        SpeechFormat::Mp3 => "audio/mpeg",
        SpeechFormat::Opus => "audio/ogg",
        SpeechFormat::Wav => "audio/wav",
        SpeechFormat::Pcm => "audio/pcm",
        SpeechFormat::Flac => "audio/flac",
    };
    let resp = match (valid.stream, valid.format) {
        (StreamFormat::Audio, SpeechFormat::Wav) => {
            // One file with its exact length once every piece is made.
            let file = encode::wav(&pieces.all(first).await?, rate);
            ([(header::CONTENT_TYPE, content_type)], file).into_response()
        }
        (StreamFormat::Audio, SpeechFormat::Flac) => {
            let samples = pieces.all(first).await?;
            let file = tokio::task::spawn_blocking(move || encode::flac(&samples, rate))
                .await
                .map_err(|e| ApiError::internal(format!("FLAC encoding task: {e}")))?
                .map_err(ApiError::internal)?;
            ([(header::CONTENT_TYPE, content_type)], file).into_response()
        }
        (stream, format) => {
            let encoded = Encoded {
                pieces,
                stream: Some(encode::Stream::new(format, rate).map_err(ApiError::internal)?),
                next: first,
                started: false,
                done: false,
            };
            match stream {
                StreamFormat::Sse => sse(encoded),
                StreamFormat::Audio => {
                    ([(header::CONTENT_TYPE, content_type)], chunked(encoded)).into_response()
                }
            }
        }
    };
    Ok((model, resp))
}

/// The audio bytes sent as each piece is made; a failure after the first piece ends the body
/// early (the status is already sent), and the node logs it.
fn chunked(mut encoded: Encoded) -> Body {
    let (tx, rx) = mpsc::unbounded_channel::<Result<Vec<u8>, std::io::Error>>();
    tokio::spawn(async move {
        loop {
            match next_or_gone(&mut encoded, tx.closed()).await {
                Some(Ok(Some(b))) => {
                    if tx.send(Ok(b)).is_err() {
                        return;
                    }
                }
                None | Some(Ok(None)) => return,
                Some(Err(e)) => {
                    tracing::warn!(error = %e.message, "speech stream ended early");
                    let _ = tx.send(Err(std::io::Error::other(e.message)));
                    return;
                }
            }
        }
    });
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (b, rx))
    }))
}

/// `speech.audio.delta` events (base64 of the format's bytes, its header first) as pieces are
/// made, then `speech.audio.done` with the seconds of audio; a failure is an error event.
fn sse(mut encoded: Encoded) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<Event>();
    tokio::spawn(async move {
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let send = |v: serde_json::Value| tx.send(Event::default().data(v.to_string())).is_ok();
        loop {
            match next_or_gone(&mut encoded, tx.closed()).await {
                // A piece shorter than an encoder's frame leaves nothing yet.
                Some(Ok(Some(b))) if b.is_empty() => {}
                Some(Ok(Some(b))) => {
                    if !send(json!({"type": "speech.audio.delta", "audio": b64(&b)})) {
                        return;
                    }
                }
                Some(Ok(None)) => break,
                None => return,
                Some(Err(e)) => {
                    let _ = tx.send(Event::default().data(e.body_json()));
                    return;
                }
            }
        }
        send(json!({
            "type": "speech.audio.done",
            "usage": {"type": "duration", "seconds": encoded.pieces.seconds},
        }));
    });
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|e| (Ok::<_, std::convert::Infallible>(e), rx))
    });
    Sse::new(events).into_response()
}
