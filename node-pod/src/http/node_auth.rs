//! Node token check (HTTP layer, the first thing every request meets, before the body is read):
//! a node pod answers only callers that present its token in `X-Gantry-Node-Token`, so a pod IP
//! is not an open model endpoint for every workload in the cluster.
//!
//! The token is the Model's, derived from the install token by the operator
//! (`gantry_api::node_token`), and reaches the node as `GANTRY_NODE_TOKEN` from a Secret. The
//! gateway and the operator send it; `/healthz`, `/readyz` and `/metrics` stay open for the
//! kubelet's probes and Prometheus, which send no headers. Without a token (a node run by hand,
//! `scripts/serve.sh`, the tests) nothing is checked and start-up says so once.
//!
//! The token itself and its comparison are `node_token.rs`.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use gantry_api::node_token::NODE_TOKEN_HEADER;

use super::AppState;
use crate::error::ApiError;

/// Paths answered without a token: the kubelet's probes and Prometheus' scrape.
pub const OPEN_PATHS: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

fn refusal(code: &str, message: &str) -> Response {
    ApiError {
        status: 401,
        kind: "invalid_request_error",
        message: message.to_string(),
        param: None,
        code: Some(code.to_string()),
        retry_after: None,
    }
    .into_response()
}

/// Axum middleware: pass the request on when the node has no token, the path is open, or the
/// header carries the token; otherwise 401 in OpenAI's error shape.
pub async fn require(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let Some(expected) = s.node.node_token.as_ref() else {
        return next.run(req).await;
    };
    if OPEN_PATHS.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    match req.headers().get(NODE_TOKEN_HEADER) {
        None => refusal(
            "node_token_required",
            "this node serves only the Gantry gateway: send requests to the gateway, not to a \
             node pod (missing X-Gantry-Node-Token)",
        ),
        Some(v) if expected.matches(v.as_bytes()) => next.run(req).await,
        Some(_) => {
            tracing::debug!(path = %req.uri().path(), "wrong node token");
            refusal("invalid_node_token", "invalid X-Gantry-Node-Token")
        }
    }
}
