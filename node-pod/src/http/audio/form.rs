//! HTTP layer, speech recognition's form (the first step of `/v1/audio/transcriptions` and
//! `/translations`, before the model is looked up): the multipart fields read and checked on
//! their own — the format, timestamp granularities, temperature, `stream`, `include` — each
//! refusal a 400 naming its field.

use axum::extract::Multipart;

use crate::error::ApiError;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Format {
    Json,
    Text,
    VerboseJson,
    Srt,
    Vtt,
}

impl Format {
    /// Whether the answer carries times (the decoder then writes timestamps).
    pub(super) fn timed(self) -> bool {
        matches!(self, Format::VerboseJson | Format::Srt | Format::Vtt)
    }
}

/// The form, read.
pub(super) struct Form {
    pub(super) file: Option<(Vec<u8>, Option<String>)>,
    pub(super) model: Option<String>,
    pub(super) language: Option<String>,
    pub(super) prompt: Option<String>,
    pub(super) format: Format,
    pub(super) temperature: f32,
    pub(super) stream: bool,
    /// `include[]=logprobs`: each text token's log-probability in the answer.
    pub(super) logprobs: bool,
    /// `timestamp_granularities[]`: `verbose_json` lists the segments (asked for, or no
    /// granularity given) and the words (asked for).
    pub(super) segments: bool,
    pub(super) words: bool,
}

pub(super) async fn read_form(mut mp: Multipart) -> Result<Form, ApiError> {
    // `timestamp_granularities[]`: checked below.
    let mut granularities = Vec::new();
    let mut f = Form {
        file: None,
        model: None,
        language: None,
        prompt: None,
        format: Format::Json,
        temperature: 0.0,
        stream: false,
        logprobs: false,
        segments: true,
        words: false,
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
            "prompt" if !text.trim().is_empty() => f.prompt = Some(text),
            "response_format" => {
                f.format = match text.as_str() {
                    "json" => Format::Json,
                    "text" => Format::Text,
                    "verbose_json" => Format::VerboseJson,
                    "srt" => Format::Srt,
                    "vtt" => Format::Vtt,
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
            "stream" => {
                f.stream = match text.trim() {
                    "true" => true,
                    "false" => false,
                    other => {
                        return Err(ApiError::invalid(
                            "stream",
                            format!("`stream` must be true or false, got `{other}`"),
                        ));
                    }
                }
            }
            "timestamp_granularities[]" | "timestamp_granularities" => {
                granularities.push(text.trim().to_string());
            }
            "include[]" | "include" => match text.trim() {
                "logprobs" => f.logprobs = true,
                other => {
                    return Err(ApiError::invalid(
                        "include",
                        format!("`include` takes `logprobs`, got `{other}`"),
                    ));
                }
            },
            // Other fields (`chunking_strategy`, ...) change nothing here.
            _ => {}
        }
    }
    if !granularities.is_empty() {
        f.segments = granularities.iter().any(|g| g == "segment");
        f.words = granularities.iter().any(|g| g == "word");
    }
    for g in &granularities {
        match g.as_str() {
            "segment" | "word" => {}
            other => {
                return Err(ApiError::invalid(
                    "timestamp_granularities",
                    format!("`timestamp_granularities` are `segment` or `word`, got `{other}`"),
                ));
            }
        }
    }
    if !granularities.is_empty() && f.format != Format::VerboseJson {
        return Err(ApiError::invalid(
            "timestamp_granularities",
            "`timestamp_granularities` need `response_format` verbose_json",
        ));
    }
    if f.logprobs && f.format != Format::Json {
        return Err(ApiError::invalid(
            "include",
            "`include` logprobs needs `response_format` json, as OpenAI's API has it",
        ));
    }
    if f.stream && !matches!(f.format, Format::Json | Format::Text) {
        return Err(ApiError::invalid(
            "stream",
            "a streamed transcription is text: `response_format` json or text",
        ));
    }
    Ok(f)
}
