//! The gateway's own HTTP routes (the entry of the request path): the proxied OpenAI routes
//! of [`crate::proxy`], `/v1/models` ([`crate::models`]), `/healthz`, `/readyz` (discovery has
//! synced) and `/metrics`, inside the edge layers (connection limits, body limit) shared with
//! the node.
//!
//! Not the route table (model id to replicas): that is [`crate::route_table`].

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};

use crate::state::GatewayState;
use crate::{models, proxy};

/// The gateway's router over `state`.
pub fn router(state: Arc<GatewayState>) -> Router {
    let max_body = state.settings.max_body_bytes;
    let routes = Router::new()
        .route("/v1/models", get(models::list))
        .route(
            "/v1/chat/completions",
            post(|s, h, b| proxy::proxy(s, "/v1/chat/completions", h, b)),
        )
        .route(
            "/v1/completions",
            post(|s, h, b| proxy::proxy(s, "/v1/completions", h, b)),
        )
        .route(
            "/v1/embeddings",
            post(|s, h, b| proxy::proxy(s, "/v1/embeddings", h, b)),
        )
        .route(
            "/v1/audio/transcriptions",
            post(|s, h, b| proxy::proxy(s, "/v1/audio/transcriptions", h, b)),
        )
        .route(
            "/v1/audio/translations",
            post(|s, h, b| proxy::proxy(s, "/v1/audio/translations", h, b)),
        )
        .route(
            "/v1/audio/speech",
            post(|s, h, b| proxy::proxy(s, "/v1/audio/speech", h, b)),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async { crate::error::GatewayError::no_route() })
        .with_state(state);
    gantry_edge::layers(routes, max_body)
}

async fn readyz(State(s): State<Arc<GatewayState>>) -> impl IntoResponse {
    if s.table.is_synced() {
        (StatusCode::OK, "ready")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "discovery has not synced yet",
        )
    }
}

async fn metrics(State(s): State<Arc<GatewayState>>) -> impl IntoResponse {
    s.metrics
        .placements
        .set(i64::try_from(s.table.placements()).unwrap_or(i64::MAX));
    match s.metrics.encode() {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            text,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            e.to_string(),
        ),
    }
}
