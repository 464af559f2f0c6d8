//! The layers every request passes on the node and the gateway (the edge, around the routes):
//!
//! 1. **request id**: a caller's `X-Request-Id` (printable ASCII, at most 128 bytes) is kept,
//!    else one is generated; it is on the request (header and [`RequestId`] extension, so the
//!    gateway forwards it to the node), on the response, in the span of every log line the
//!    handler writes, and in one `request answered` line per request;
//! 2. **content type**: a body sent as anything but JSON (`application/json` or `*/*+json`)
//!    is a 415 (the audio routes, `/v1/audio/...`, take OpenAI's `multipart/form-data`
//!    uploads instead); a body with no `Content-Type` is read as JSON;
//! 3. **OpenAI shape**: any refusal that is not already JSON (axum's 405 for a wrong method,
//!    the 413 of the body limit, a 404 with no body) is rewritten into OpenAI's error shape,
//!    so a client sees one shape for every refusal. The probes (`/healthz`, `/readyz`) and
//!    `/metrics` keep their plain text.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, Method, StatusCode, header};
use tracing::Instrument;

/// The request-id header, on requests and responses.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The request's id, as a request extension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestId(pub String);

/// Wrap a server's routes in the edge layers. `max_body_bytes` is the limit a 413 names.
pub fn layers(router: Router, max_body_bytes: usize) -> Router {
    router
        .layer(from_fn_with_state(max_body_bytes, openai_shape))
        .layer(from_fn(content_type))
        .layer(from_fn(request_id))
}

fn plain_route(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/metrics")
}

/// A caller's id when it is usable in a header and a log line.
fn usable(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    (!s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .then(|| s.to_string())
}

/// A new id: 128 bits from the clock, a process-wide counter and the hasher's random keys.
fn new_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut h = KEYS.get_or_init(Default::default).build_hasher();
    h.write_u64(n);
    h.write_u64(t);
    format!("{:016x}{:016x}", h.finish(), t ^ n.rotate_left(48))
}

async fn request_id(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(usable)
        .unwrap_or_else(new_id);
    let value = HeaderValue::from_str(&id).unwrap_or_else(|_| HeaderValue::from_static("-"));
    req.headers_mut().insert(X_REQUEST_ID, value.clone());
    req.extensions_mut().insert(RequestId(id.clone()));
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let span = tracing::info_span!("request", request_id = %id, %method, %path);
    let start = Instant::now();
    let mut resp = next.run(req).instrument(span.clone()).await;
    resp.headers_mut().insert(X_REQUEST_ID, value);
    let status = resp.status().as_u16();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    span.in_scope(|| {
        if plain_route(&path) {
            tracing::debug!(status, ms, "request answered");
        } else {
            tracing::info!(status, ms, "request answered");
        }
    });
    resp
}

async fn content_type(req: Request, next: Next) -> Response {
    if matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH)
        && let Some(ct) = req.headers().get(header::CONTENT_TYPE)
    {
        let essence = ct
            .to_str()
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        let json =
            essence == "application/json" || (essence.ends_with("+json") && essence.contains('/'));
        let upload = essence == "multipart/form-data" && req.uri().path().starts_with("/v1/audio/");
        if !json && !upload {
            return refusal(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                &format!(
                    "the body must be JSON sent as `Content-Type: application/json`; got `{}`",
                    ct.to_str().unwrap_or("(not text)")
                ),
                Some("Content-Type"),
                "unsupported_media_type",
            );
        }
    }
    next.run(req).await
}

async fn openai_shape(State(limit): State<usize>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) || plain_route(&path) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let (message, code) = match status {
        StatusCode::PAYLOAD_TOO_LARGE => (
            format!("the request body exceeds the limit of {limit} bytes"),
            "request_too_large",
        ),
        StatusCode::METHOD_NOT_ALLOWED => (
            format!("{method} is not allowed on {path}"),
            "method_not_allowed",
        ),
        StatusCode::NOT_FOUND => (format!("no such route: {path}"), "not_found"),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => (
            "the body must be JSON sent as `Content-Type: application/json`".to_string(),
            "unsupported_media_type",
        ),
        s => {
            let (_, body) = resp.into_parts();
            let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
            let text = String::from_utf8_lossy(&text).trim().to_string();
            let message = if text.is_empty() {
                s.canonical_reason().unwrap_or("error").to_string()
            } else {
                text
            };
            let code = if s.is_server_error() {
                "server_error"
            } else {
                "invalid_request"
            };
            return refusal(s, &message, None, code);
        }
    };
    let mut out = refusal(status, &message, None, code);
    if let Some(allow) = resp.headers().get(header::ALLOW) {
        out.headers_mut().insert(header::ALLOW, allow.clone());
    }
    out
}

fn refusal(status: StatusCode, message: &str, param: Option<&str>, code: &str) -> Response {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let body = gantry_api::openai_error_json(message, kind, param, Some(code));
    let resp = gantry_api::openai_error_response(status.as_u16(), body, None);
    resp.map(Body::from).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use tower::ServiceExt;

    fn app() -> Router {
        let routes = Router::new().route("/v1/x", post(|| async { "ok" })).route(
            "/healthz",
            get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "hung\n") }),
        );
        layers(routes, 100)
    }

    async fn call(req: http::Request<Body>) -> (StatusCode, http::HeaderMap, String) {
        let resp = app().oneshot(req).await.expect("infallible");
        let (parts, body) = resp.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.expect("body");
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }

    fn req(method: &str, path: &str, ct: Option<&str>) -> http::Request<Body> {
        let mut b = http::Request::builder().method(method).uri(path);
        if let Some(ct) = ct {
            b = b.header(header::CONTENT_TYPE, ct);
        }
        b.body(Body::from("{}")).expect("request")
    }

    fn error(body: &str) -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        v["error"].clone()
    }

    #[tokio::test]
    async fn refusals_no_handler_writes_get_openai_shape() {
        let (s, h, b) = call(req("GET", "/v1/x", None)).await;
        assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(error(&b)["code"], "method_not_allowed");
        assert!(h.get(header::ALLOW).is_some_and(|v| v == "POST"));
        let (s, _, b) = call(req("GET", "/nope", None)).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert_eq!(error(&b)["code"], "not_found");
        let (s, _, b) = call(req("POST", "/v1/x", Some("text/plain"))).await;
        assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(error(&b)["param"], "Content-Type");
        for ok in [
            None,
            Some("application/json"),
            Some("application/json; charset=utf-8"),
            Some("application/vnd.api+json"),
        ] {
            let (s, _, b) = call(req("POST", "/v1/x", ok)).await;
            assert_eq!((s, b.as_str()), (StatusCode::OK, "ok"), "{ok:?}");
        }
        // Probes keep their plain text for the kubelet and people.
        let (s, _, b) = call(req("GET", "/healthz", None)).await;
        assert_eq!((s, b.as_str()), (StatusCode::SERVICE_UNAVAILABLE, "hung\n"));
    }

    #[tokio::test]
    async fn every_response_carries_a_request_id() {
        let (_, h, _) = call(req("POST", "/v1/x", None)).await;
        let id = h.get(&X_REQUEST_ID).expect("id").to_str().expect("ascii");
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
        let (_, h2, _) = call(req("POST", "/v1/x", None)).await;
        assert_ne!(h2.get(&X_REQUEST_ID).expect("id"), id);
        let mut mine = req("GET", "/nope", None);
        mine.headers_mut()
            .insert(X_REQUEST_ID, HeaderValue::from_static("caller-7"));
        let (_, h, _) = call(mine).await;
        assert_eq!(h.get(&X_REQUEST_ID).expect("id"), "caller-7");
        let mut bad = req("GET", "/nope", None);
        bad.headers_mut()
            .insert(X_REQUEST_ID, HeaderValue::from_static("has space"));
        let (_, h, _) = call(bad).await;
        assert_ne!(h.get(&X_REQUEST_ID).expect("id"), "has space");
    }
}
