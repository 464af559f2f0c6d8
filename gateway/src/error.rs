//! Gateway errors (the edge of every gateway request): one type, one `IntoResponse`, OpenAI's
//! error shape.
//!
//! The body is `{"error": {"message", "type", "param", "code"}}`, the same shape the node's
//! `ApiError` (node-pod/src/error.rs) answers with (both render it through
//! `gantry_api::openai_error_json`), so a client sees one shape whether the gateway
//! or a node refused the call.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// A refusal or failure the gateway answers itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: &'static str,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl GatewayError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        GatewayError {
            status,
            kind,
            message,
            param: None,
            code,
            retry_after: None,
        }
    }

    /// 400: the body is not JSON, or not an object with a string `model`.
    pub fn invalid_body(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_value",
            message.into(),
        )
    }

    /// 400 naming the `model` field.
    pub fn invalid_model(message: impl Into<String>) -> Self {
        GatewayError {
            param: Some("model"),
            ..Self::invalid_body(message)
        }
    }

    /// 413: the body exceeds `--max-body-bytes`.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("request body must be <= {limit} bytes"),
        )
    }

    /// 404 for a model no Model serves (or one the key may not see).
    pub fn model_not_found(model: &str) -> Self {
        GatewayError {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("The model `{model}` does not exist"),
            )
        }
    }

    /// 404 for `<model>:<name>` of a model that serves no adapter `name`: the same error as
    /// an unknown model, saying which adapters the model has.
    pub fn adapter_not_found(id: &str, base: &str, name: &str, adapters: &[String]) -> Self {
        let known = if adapters.is_empty() {
            "it serves no adapters".to_string()
        } else {
            format!("its adapters: {}", adapters.join(", "))
        };
        GatewayError {
            message: format!(
                "The model `{id}` does not exist: the model `{base}` has no adapter `{name}` ({known})"
            ),
            ..Self::model_not_found(id)
        }
    }

    /// 400 for an adapter every replica of its model refused (a wrong rank or base model, an
    /// engine without adapters, a failed download): retrying will not help until the Model's
    /// spec or its node changes.
    pub fn adapter_refused(id: &str, base: &str, reason: Option<&str>, message: &str) -> Self {
        GatewayError {
            param: Some("model"),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "adapter_refused",
                format!(
                    "the adapter `{id}` of the model `{base}` cannot serve: every replica refused it ({}: {message}); see the Model's status.adapters",
                    reason.unwrap_or("refused")
                ),
            )
        }
    }

    /// 404 for a path the gateway does not serve.
    pub fn no_route() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            "no such route; see /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/audio/transcriptions, /v1/audio/translations, /v1/audio/speech"
                .to_string(),
        )
    }

    /// 401: no key, or a key that matches none.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            message.into(),
        )
    }

    /// 403: a valid key that may not use this model.
    pub fn forbidden(model: &str) -> Self {
        GatewayError {
            param: Some("model"),
            ..Self::new(
                StatusCode::FORBIDDEN,
                "invalid_request_error",
                "model_not_allowed",
                format!("this API key may not use the model `{model}`"),
            )
        }
    }

    /// 503 with `Retry-After`: held-request bound reached, hold timed out, or no replica.
    pub fn unavailable(message: impl Into<String>, retry_after: u64) -> Self {
        GatewayError {
            retry_after: Some(retry_after),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "unavailable",
                message.into(),
            )
        }
    }

    /// 502: the node failed after the request was sent, before any response byte.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "upstream_error",
            message.into(),
        )
    }

    /// The JSON body.
    pub fn body_json(&self) -> String {
        gantry_api::openai_error_json(&self.message, self.kind, self.param, Some(self.code))
    }
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        gantry_api::openai_error_response(self.status.as_u16(), self.body_json(), self.retry_after)
            .into_response()
    }
}
