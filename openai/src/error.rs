//! Errors at the HTTP edge (last step of every request): one type, one `IntoResponse`, OpenAI's shape.
//!
//! Every failure a client can see — validation, engine status codes, a worker crash, queue
//! and readiness refusals (the node's, converted there) — becomes an [`ApiError`] and leaves through the
//! single `IntoResponse` below as
//! `{"error": {"message", "type", "param", "code"}}`. Engine codes map to HTTP
//! through `Status::http_status` (the specification's table) and nowhere else.

use axum::response::{IntoResponse, Response};
use gantry_chat::template::TemplateError;
use gantry_engine_abi::{EngineError, Status};
use gantry_scheduler::GenError;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<String>,
    /// Seconds for a `Retry-After` header (503s).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400 naming the offending field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.into()),
            code: Some("invalid_value".into()),
            retry_after: None,
        }
    }

    /// 400 for a parameter Gantry or the model cannot honour.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: Some("unsupported_parameter".into()),
            ..Self::invalid(param, message)
        }
    }

    pub fn not_found_model(model: &str) -> Self {
        Self {
            status: 404,
            kind: "invalid_request_error",
            message: format!("The model `{model}` does not exist on this node"),
            param: Some("model".into()),
            code: Some("model_not_found".into()),
            retry_after: None,
        }
    }

    pub fn unavailable(message: impl Into<String>, retry_after: u64) -> Self {
        Self {
            status: 503,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: Some("unavailable".into()),
            retry_after: Some(retry_after),
        }
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self::from(EngineError::new(Status::Timeout, message))
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::from(EngineError::internal(message))
    }

    /// A stable label for the requests-by-outcome metric.
    pub fn metric_label(&self) -> String {
        self.status.to_string()
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let kind = match e.status {
            Status::Unsupported => "invalid_request_error",
            Status::Cancelled => "cancelled",
            Status::Timeout => "timeout",
            Status::OomRam | Status::OomVram => "insufficient_storage",
            _ => "server_error",
        };
        Self {
            status: e.status.http_status(),
            kind,
            message: e.message,
            param: None,
            code: Some(e.status.name().to_ascii_lowercase()),
            retry_after: None,
        }
    }
}

/// A failed generation or embedding: the engine's own status, or 503 `engine_crashed` when
/// the model's worker process died under the request (the model restarts, so the request
/// may be sent again shortly).
impl From<GenError> for ApiError {
    fn from(e: GenError) -> Self {
        match e {
            GenError::Engine(e) => ApiError::from(e),
            GenError::Crashed(crash) => Self {
                code: Some("engine_crashed".into()),
                ..ApiError::unavailable(crash.message(), 2)
            },
        }
    }
}

/// A conversation the chat template cannot render is the request's fault: a
/// 400 on `messages`, with the template's own message when it raised one.
impl From<TemplateError> for ApiError {
    fn from(e: TemplateError) -> Self {
        match e {
            TemplateError::Raised(msg) => ApiError::invalid("messages", msg),
            other => ApiError::invalid("messages", other.to_string()),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}

impl ApiError {
    /// The JSON body, also used inside an SSE stream when a stream fails midway.
    pub fn body_json(&self) -> String {
        gantry_api::openai_error_json(
            &self.message,
            self.kind,
            self.param.as_deref(),
            self.code.as_deref(),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        gantry_api::openai_error_response(self.status, self.body_json(), self.retry_after)
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_codes_map_through_the_specification_table() {
        let cases = [
            (Status::OomVram, 507),
            (Status::OomRam, 507),
            (Status::Timeout, 504),
            (Status::Cancelled, 499),
            (Status::Unsupported, 400),
            (Status::Internal, 500),
            (Status::ModelCorrupt, 500),
            (Status::LoadFailed, 500),
            (Status::AbiMismatch, 500),
        ];
        for (s, http) in cases {
            assert_eq!(ApiError::from(EngineError::new(s, "x")).status, http, "{s}");
        }
    }

    #[test]
    fn the_body_has_openai_shape() {
        let e = ApiError::invalid("temperature", "`temperature` must be <= 2, got 3");
        let v: serde_json::Value = serde_json::from_str(&e.body_json()).expect("json");
        assert_eq!(v["error"]["param"], "temperature");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "`temperature` must be <= 2, got 3");
    }
}
