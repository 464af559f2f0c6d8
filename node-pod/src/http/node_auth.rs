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
//! The comparison is over SHA-256 digests with a constant-time equality, so the time taken says
//! nothing about how much of a guess, or how long a prefix of it, was right.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use gantry_api::node_token::{MIN_INSTALL_TOKEN_LEN, NODE_TOKEN_ENV, NODE_TOKEN_HEADER};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::AppState;
use crate::error::ApiError;

/// Paths answered without a token: the kubelet's probes and Prometheus' scrape.
pub const OPEN_PATHS: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

/// The token this node requires, kept only as its digest. `Debug` never prints it.
#[derive(Clone)]
pub struct NodeToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for NodeToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeToken(<redacted>)")
    }
}

/// Why the configured token was refused at start-up.
#[derive(Debug, thiserror::Error)]
pub enum NodeTokenError {
    #[error(
        "{NODE_TOKEN_ENV} must be at least {MIN_INSTALL_TOKEN_LEN} visible ASCII characters \
         (got {0}); unset it to serve without a token"
    )]
    Weak(usize),
}

impl NodeToken {
    /// The `--node-token` setting: `None` serves without a check. A token that is set but empty
    /// or short is refused (a broken Secret must not open the node).
    pub fn from_setting(value: Option<&str>) -> Result<Option<Self>, NodeTokenError> {
        let Some(value) = value else {
            return Ok(None);
        };
        let token = value.trim();
        if token.len() < MIN_INSTALL_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(NodeTokenError::Weak(token.len()));
        }
        Ok(Some(NodeToken {
            digest: Sha256::digest(token.as_bytes()).into(),
        }))
    }

    /// Whether `presented` is the token, in time independent of where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let d: [u8; 32] = Sha256::digest(presented).into();
        bool::from(self.digest.ct_eq(&d))
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_matches_only_itself_and_a_weak_one_is_refused() {
        let t = NodeToken::from_setting(Some("0123456789abcdef0123456789abcdef\n"))
            .expect("valid")
            .expect("set");
        assert!(t.matches(b"0123456789abcdef0123456789abcdef"));
        assert!(!t.matches(b"0123456789abcdef0123456789abcde"));
        assert!(!t.matches(b""));
        assert!(!format!("{t:?}").contains("0123"));
        assert!(NodeToken::from_setting(None).expect("unset").is_none());
        assert!(NodeToken::from_setting(Some("")).is_err());
        assert!(NodeToken::from_setting(Some("short")).is_err());
    }
}
