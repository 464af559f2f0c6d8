//! Validation of `POST /v1/embeddings` (HTTP edge, before the model is looked up): the
//! encoding and every input's content, each refusal naming its field.

use super::{ValidPrompt, token_ids};
use crate::error::ApiError;
use crate::request::{EmbeddingInput, EmbeddingRequest};

/// An embeddings request, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidEmbeddingRequest {
    pub model: String,
    /// At least one.
    pub inputs: Vec<ValidPrompt>,
    /// `encoding_format: "base64"`.
    pub base64: bool,
    pub dimensions: Option<i64>,
}

/// Check an embeddings request: the encoding, and that every input has something to embed.
pub fn embedding(req: &EmbeddingRequest) -> Result<ValidEmbeddingRequest, ApiError> {
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` must be \"float\" or \"base64\", got {other:?}"),
            ));
        }
    };
    let text = |i: usize, t: &str| -> Result<ValidPrompt, ApiError> {
        if t.trim().is_empty() {
            return Err(ApiError::invalid(
                "input",
                format!("`input[{i}]` is empty or whitespace"),
            ));
        }
        Ok(ValidPrompt::Text(t.to_string()))
    };
    let inputs: Vec<ValidPrompt> = match &req.input {
        EmbeddingInput::Text(t) => vec![text(0, t)?],
        EmbeddingInput::Texts(v) => v
            .iter()
            .enumerate()
            .map(|(i, t)| text(i, t))
            .collect::<Result<_, _>>()?,
        EmbeddingInput::Tokens(ids) => vec![token_ids(ids)?],
        EmbeddingInput::TokenLists(l) => l
            .iter()
            .map(|ids| token_ids(ids))
            .collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid("input", "`input` holds nothing to embed"));
    }
    Ok(ValidEmbeddingRequest {
        model: req.model.clone(),
        inputs,
        base64,
        dimensions: req.dimensions,
    })
}
