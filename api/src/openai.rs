//! The OpenAI error body (the last step of every refused request, on the node and the gateway):
//! one function renders it, so a client sees one shape whoever refused the call.

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
