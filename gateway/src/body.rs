//! The gateway's reading of a request body (the proxy's first step, before routing): the body
//! within the size limit, and the model it names — the `model` field of a JSON body, or of a
//! `multipart/form-data` upload on the audio routes.

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};
use serde::Deserialize;

use crate::error::GatewayError;

/// The one field the gateway reads; serde still checks that the whole body is JSON.
#[derive(Deserialize)]
struct Peek {
    model: Option<serde_json::Value>,
}

/// The body, refused with 413 past `limit` bytes (declared or read).
pub(crate) async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
) -> Result<Bytes, GatewayError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(GatewayError::too_large(limit));
    }
    match axum::body::to_bytes(body, limit).await {
        Ok(b) => Ok(b),
        Err(e) => {
            let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(s) = src {
                if s.is::<http_body_util::LengthLimitError>() {
                    return Err(GatewayError::too_large(limit));
                }
                src = s.source();
            }
            Err(GatewayError::invalid_body(format!(
                "cannot read the request body: {e}"
            )))
        }
    }
}

/// The multipart boundary of an upload (`multipart/form-data`: the audio routes), `None` for
/// a JSON body.
pub(crate) fn form_boundary(headers: &HeaderMap) -> Option<String> {
    let ct = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    multer::parse_boundary(ct).ok()
}

/// The `model` field of a multipart upload (OpenAI's audio routes send one), read from the
/// buffered body without copying the file field.
pub(crate) async fn model_of_form(body: &Bytes, boundary: &str) -> Result<String, GatewayError> {
    let bytes = body.clone();
    let stream = futures::stream::once(async move { Ok::<Bytes, std::io::Error>(bytes) });
    let mut form = multer::Multipart::new(stream, boundary);
    let unreadable = |e: multer::Error| {
        GatewayError::invalid_body(format!("the multipart form cannot be read: {e}"))
    };
    while let Some(field) = form.next_field().await.map_err(unreadable)? {
        if field.name() == Some("model") {
            let m = field.text().await.map_err(unreadable)?;
            if m.is_empty() {
                return Err(GatewayError::invalid_model("`model` must not be empty"));
            }
            return Ok(m);
        }
    }
    Err(GatewayError::invalid_model("`model` is required"))
}

pub(crate) fn model_of(body: &[u8]) -> Result<String, GatewayError> {
    let peek: Peek = serde_json::from_slice(body).map_err(|e| {
        GatewayError::invalid_body(format!("the request body is not valid JSON: {e}"))
    })?;
    match peek.model {
        Some(serde_json::Value::String(m)) if !m.is_empty() => Ok(m),
        Some(serde_json::Value::String(_)) => {
            Err(GatewayError::invalid_model("`model` must not be empty"))
        }
        Some(_) => Err(GatewayError::invalid_model("`model` must be a string")),
        None => Err(GatewayError::invalid_model("`model` is required")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_is_read_from_the_body_with_a_field_naming_error() {
        assert_eq!(
            model_of(br#"{"model":"m","x":[1]}"#).ok().as_deref(),
            Some("m")
        );
        let e = model_of(br#"{"messages":[]}"#).expect_err("missing");
        assert_eq!((e.status.as_u16(), e.param), (400, Some("model")));
        let e = model_of(br#"{"model":3}"#).expect_err("number");
        assert!(e.message.contains("string"));
        let e = model_of(b"{not json").expect_err("junk");
        assert_eq!((e.status.as_u16(), e.param), (400, None));
    }

    #[tokio::test]
    async fn the_model_of_an_upload_is_its_form_field() {
        let body = Bytes::from_static(
            b"--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF...\r\n--x\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--x--\r\n",
        );
        assert_eq!(
            model_of_form(&body, "x").await.ok().as_deref(),
            Some("whisper")
        );
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "multipart/form-data; boundary=x".parse().expect("header"),
        );
        assert_eq!(form_boundary(&h).as_deref(), Some("x"));
        h.insert(
            header::CONTENT_TYPE,
            "application/json".parse().expect("header"),
        );
        assert_eq!(form_boundary(&h), None);
        let none = Bytes::from_static(
            b"--x\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n1\r\n--x--\r\n",
        );
        let e = model_of_form(&none, "x").await.expect_err("no model");
        assert_eq!((e.status.as_u16(), e.param), (400, Some("model")));
    }
}
