//! Validation of `POST /v1/audio/speech` (HTTP edge, before the model is looked up): OpenAI's
//! fields and limits, each refusal naming its field.

use crate::error::ApiError;
use crate::request::SpeechRequest;

/// OpenAI's limit on `input`, in characters.
pub const MAX_INPUT_CHARS: usize = 4096;

/// The audio container of a speech answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpeechFormat {
    /// MPEG layer III at the voice's rate (OpenAI's default).
    Mp3,
    /// Opus in Ogg, fed at 24 kHz.
    Opus,
    /// 16-bit PCM in a RIFF/WAVE file at the voice's rate.
    Wav,
    /// Raw 16-bit little-endian PCM at 24 kHz, mono (OpenAI's `pcm`).
    Pcm,
    /// FLAC of the 16-bit samples at the voice's rate.
    Flac,
}

/// How the answer is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamFormat {
    /// The audio bytes themselves (chunked as they are made, for `pcm`).
    Audio,
    /// Server-sent events: `speech.audio.delta` with base64 audio, then `speech.audio.done`.
    Sse,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ValidSpeechRequest {
    pub model: String,
    pub input: String,
    pub voice: Option<String>,
    pub format: SpeechFormat,
    pub speed: f32,
    pub stream: StreamFormat,
}

pub fn speech(req: &SpeechRequest) -> Result<ValidSpeechRequest, ApiError> {
    if req.model.is_empty() {
        return Err(ApiError::invalid("model", "`model` is required"));
    }
    if req.input.trim().is_empty() {
        return Err(ApiError::invalid(
            "input",
            "`input` is empty: give the text to speak",
        ));
    }
    let chars = req.input.chars().count();
    if chars > MAX_INPUT_CHARS {
        return Err(ApiError::invalid(
            "input",
            format!("`input` is {chars} characters; the limit is {MAX_INPUT_CHARS}"),
        ));
    }
    let format = match req.response_format.as_deref() {
        None | Some("mp3") => SpeechFormat::Mp3,
        Some("opus") => SpeechFormat::Opus,
        Some("wav") => SpeechFormat::Wav,
        Some("pcm") => SpeechFormat::Pcm,
        Some("flac") => SpeechFormat::Flac,
        Some("aac") => {
            return Err(ApiError::unsupported(
                "response_format",
                "`response_format` \"aac\" is not encoded by this server; use mp3, opus, flac, \
                 wav or pcm",
            ));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "response_format",
                format!(
                    "`response_format` must be one of mp3, opus, aac, flac, wav, pcm; got {other:?}"
                ),
            ));
        }
    };
    let speed = req.speed.unwrap_or(1.0);
    if !(0.25..=4.0).contains(&speed) {
        return Err(ApiError::invalid(
            "speed",
            format!("`speed` must be within [0.25, 4.0], got {speed}"),
        ));
    }
    let stream = match req.stream_format.as_deref() {
        None | Some("audio") => StreamFormat::Audio,
        Some("sse") => StreamFormat::Sse,
        Some(other) => {
            return Err(ApiError::invalid(
                "stream_format",
                format!("`stream_format` must be \"audio\" or \"sse\", got {other:?}"),
            ));
        }
    };
    if stream == StreamFormat::Sse && format == SpeechFormat::Flac {
        return Err(ApiError::invalid(
            "stream_format",
            "`stream_format` \"sse\" sends pieces of mp3, opus, wav or pcm; a FLAC file is sent whole",
        ));
    }
    if req
        .instructions
        .as_deref()
        .is_some_and(|i| !i.trim().is_empty())
    {
        return Err(ApiError::unsupported(
            "instructions",
            "`instructions` needs a model that takes speaking instructions; Gantry's voices do not",
        ));
    }
    if req.voice.as_deref().is_some_and(str::is_empty) {
        return Err(ApiError::invalid("voice", "`voice` is empty"));
    }
    Ok(ValidSpeechRequest {
        model: req.model.clone(),
        input: req.input.clone(),
        voice: req.voice.clone(),
        format,
        speed: speed as f32,
        stream,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(body: serde_json::Value) -> Result<ValidSpeechRequest, ApiError> {
        speech(&crate::request::parse(body.to_string().as_bytes())?)
    }

    #[test]
    fn defaults_and_limits() {
        let ok = req(serde_json::json!({"model": "joe", "input": "Hi.", "voice": "joe"}))
            .expect("valid");
        assert_eq!(
            (ok.format, ok.speed, ok.stream),
            (SpeechFormat::Mp3, 1.0, StreamFormat::Audio)
        );
        let param = |body: serde_json::Value| req(body).expect_err("refused").param;
        let p = |f: &str| Some(f.to_string());
        assert_eq!(
            param(serde_json::json!({"model": "m", "input": " "})),
            p("input")
        );
        let long = "a".repeat(MAX_INPUT_CHARS + 1);
        assert_eq!(
            param(serde_json::json!({"model": "m", "input": long})),
            p("input")
        );
        assert_eq!(
            param(serde_json::json!({"model": "m", "input": "x", "speed": 5})),
            p("speed")
        );
        assert_eq!(
            param(serde_json::json!({"model": "m", "input": "x", "response_format": "aac"})),
            p("response_format")
        );
        assert_eq!(
            param(serde_json::json!({"model": "m", "input": "x", "stream_format": "x"})),
            p("stream_format")
        );
        assert_eq!(
            param(
                serde_json::json!({"model": "m", "input": "x", "stream_format": "sse", "response_format": "flac"})
            ),
            p("stream_format")
        );
        assert_eq!(
            param(serde_json::json!({"model": "m", "input": "x", "instructions": "calm"})),
            p("instructions")
        );
        assert_eq!(
            param(serde_json::json!({"model": "m", "input": "x", "pitch": 2})),
            p("pitch")
        );
    }
}
