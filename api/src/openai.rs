//! The OpenAI error (the last step of every refused request, on the node and the gateway): one
//! function renders the body and one the HTTP response, so a client sees one shape whoever
//! refused the call.

use serde::Serialize;

/// The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`. The node's
/// `ApiError` and the gateway's `GatewayError` both answer with it.
pub fn openai_error_json(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> String {
    #[derive(Serialize)]
    struct Body<'a> {
        error: Inner<'a>,
    }
    #[derive(Serialize)]
    struct Inner<'a> {
        message: &'a str,
        #[serde(rename = "type")]
        kind: &'a str,
        param: Option<&'a str>,
        code: Option<&'a str>,
    }
    serde_json::to_string(&Body {
        error: Inner {
            message,
            kind,
            param,
            code,
        },
    })
    .unwrap_or_else(|_| "{\"error\":{\"message\":\"unserializable error\"}}".into())
}

/// The HTTP response for an OpenAI error: `status` (500 when it is not a valid code), the JSON
/// `body` from [`openai_error_json`], and `Retry-After` when the caller may come back later.
pub fn openai_error_response(
    status: u16,
    body: String,
    retry_after: Option<u64>,
) -> http::Response<String> {
    let mut resp = http::Response::new(body);
    *resp.status_mut() =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    if let Some(s) = retry_after {
        h.insert(http::header::RETRY_AFTER, http::HeaderValue::from(s));
    }
    resp
}
