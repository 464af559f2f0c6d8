//! HTTP layer (first step of the request path): routes, health, metrics, status and graceful shutdown.
//!
//! JSON exists only in this module tree: handlers parse bodies into
//! `http::openai` types, validate them into `Valid*` values, and hand the
//! rest of the node plain Rust types. Errors leave through `ApiError`.

pub mod audio;
pub mod generate;
pub mod limits;
pub mod node_auth;
pub mod response;
pub mod speech;

pub use gantry_openai::{request as openai, tool_reply, validate};

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::error::ApiError;
use crate::node::{ModelState, Node};
use crate::scheduler::{EmbedJob, Job};
use openai::{EmbeddingRequest, TokenizeRequest};

#[derive(Clone)]
pub struct AppState {
    pub node: Arc<Node>,
}

impl AppState {
    /// Count a request by model, endpoint and HTTP status.
    pub fn count(&self, model: &str, endpoint: &str, code: u16) {
        self.node
            .metrics
            .requests
            .with_label_values(&[model, endpoint, &code.to_string()])
            .inc();
    }
}

/// Counts a request as in flight until dropped (graceful shutdown waits for zero).
pub struct InflightGuard(Arc<Node>, Option<crate::node::AdapterLease>);

impl InflightGuard {
    pub fn new(node: Arc<Node>) -> Self {
        node.inflight.fetch_add(1, Ordering::SeqCst);
        Self(node, None)
    }

    /// Hold the request's adapter as long as the request: an adapter in use is not evicted.
    pub fn holding(mut self, adapter: Option<crate::node::AdapterLease>) -> Self {
        self.1 = adapter;
        self
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The node's routes inside the edge layers (request id, content type, OpenAI-shaped refusals);
/// bodies above `max_body_bytes` are refused with 413.
pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    let routes = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(|State(s): State<AppState>, body| generate::chat(s, body)))
        .route("/v1/completions", post(|State(s): State<AppState>, body| generate::completion(s, body)))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/audio/transcriptions", post(|State(s): State<AppState>, mp| audio::transcriptions(s, mp, audio::Task::Transcribe)))
        .route("/v1/audio/translations", post(|State(s): State<AppState>, mp| audio::transcriptions(s, mp, audio::Task::Translate)))
        .route("/v1/audio/speech", post(|State(s): State<AppState>, body| speech::speech(s, body)))
        .route("/v1/tokenize", post(tokenize))
        .route(gantry_api::NODE_STATUS_PATH, get(status))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError {
                status: 404,
                kind: "invalid_request_error",
                message: "no such route; see /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings".into(),
                param: None,
                code: Some("not_found".into()),
                retry_after: None,
            }
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(state.clone(), node_auth::require))
        .with_state(state);
    gantry_edge::layers(routes, max_body_bytes)
}

async fn healthz(State(s): State<AppState>) -> Response {
    if s.node.is_live() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "engine hung: a step overran the watchdog\n",
        )
            .into_response()
    }
}

async fn readyz(State(s): State<AppState>) -> Response {
    if s.node.is_ready() {
        return (StatusCode::OK, "ready\n").into_response();
    }
    let why: Vec<String> = s
        .node
        .status()
        .models
        .iter()
        .filter(|m| m.load.state != gantry_api::LoadState::Loaded)
        .map(|m| {
            let artifact = match m.artifact.state {
                gantry_api::ArtifactState::Ready => String::new(),
                st => format!(
                    " artifacts {st:?} {}/{} bytes{}",
                    m.artifact.bytes_done,
                    m.artifact.bytes_total,
                    m.artifact
                        .message
                        .as_deref()
                        .map(|x| format!(": {x}"))
                        .unwrap_or_default()
                ),
            };
            format!(
                "{}: {:?}{artifact}{}",
                m.id,
                m.load.state,
                m.load
                    .message
                    .as_deref()
                    .map(|x| format!(" ({x})"))
                    .unwrap_or_default()
            )
        })
        .collect();
    let draining = if s.node.draining.load(Ordering::SeqCst) {
        "draining\n"
    } else {
        ""
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("not ready\n{draining}{}\n", why.join("\n")),
    )
        .into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.node.metrics.render_with(&s.node.lora_info()),
    )
        .into_response()
}

async fn status(State(s): State<AppState>) -> Response {
    axum::Json(s.node.status()).into_response()
}

async fn models(State(s): State<AppState>) -> Response {
    let created = s.node.started.elapsed().as_secs();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs().saturating_sub(created));
    let mut data: Vec<Value> = Vec::new();
    for m in s.node.models().values() {
        let base = models_entry(m, created);
        // Each adapter is a model of its own, with its base as `parent` (as vLLM lists LoRA
        // adapters), right after it.
        let adapters = m.adapter_statuses();
        let entries = adapters.into_iter().map(|a| {
            let mut e = base.clone();
            e["id"] = json!(a.id);
            e["parent"] = json!(m.config.id);
            e["adapter"] = json!({"name": a.name, "state": a.state.as_str(), "reason": a.reason});
            e["ready"] =
                json!(base["ready"] == json!(true) && a.state != gantry_api::AdapterState::Refused);
            e
        });
        data.push(base.clone());
        data.extend(entries);
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// One model's `/v1/models` entry.
fn models_entry(m: &crate::node::ServedModel, created: u64) -> Value {
    let state = m.state();
    // A chat template and a context length mean something for a text model only; a speech
    // model lists its voices instead.
    let (ready, template, ctx, engine, voices) = match &state {
        ModelState::Ready(r) => {
            let info = r.shared.info();
            let text = info.supports_completion() || info.supports_embedding();
            (
                true,
                text.then(|| r.template_source().as_str()),
                text.then(|| r.scheduler.context_length()),
                Some(r.plugin.clone()),
                info.supports_speech().then(|| info.voices.clone()),
            )
        }
        _ => (false, None, None, None, None),
    };
    let mut entry = json!({
        "id": m.config.id,
        "object": "model",
        "created": created,
        "owned_by": "gantry",
        "format": m.format.as_str(),
        "ready": ready,
        "engine": engine,
        "context_length": ctx,
        "chat_template": template,
    });
    if let Some(v) = voices {
        entry["voices"] = json!(v);
    }
    entry
}

async fn tokenize(State(s): State<AppState>, body: axum::body::Bytes) -> Response {
    let r = async {
        let req: TokenizeRequest = openai::parse(&body)?;
        let (_, ready) = s.node.ready_model(&req.model).await?;
        let tokens =
            ready
                .tokenizer
                .encode(&req.content, req.add_special.unwrap_or(false), true)?;
        Ok::<_, ApiError>(json!({"tokens": tokens}))
    }
    .await;
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn embeddings(State(s): State<AppState>, body: axum::body::Bytes) -> Response {
    let r = embed_inner(&s, &body).await;
    let (model, code) = match &r {
        Ok((m, _)) => (m.clone(), 200),
        Err(e) => ("-".to_string(), e.status),
    };
    s.count(&model, "embeddings", code);
    match r {
        Ok((_, v)) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn embed_inner(s: &AppState, body: &[u8]) -> Result<(String, Value), ApiError> {
    let req: EmbeddingRequest = openai::parse(body)?;
    let valid = validate::embedding(&req)?;
    let (_m, ready) = s.node.ready_model(&valid.model).await?;
    let inputs = limits::embedding(&ready, &valid)?;
    let _guard = InflightGuard::new(s.node.clone());
    let lengths: Vec<usize> = inputs.iter().map(Vec::len).collect();
    let total: usize = lengths.iter().sum();
    // The inputs go to the engine in runs of at most a prompt chunk's tokens, each one call
    // (ABI 1.8 `embed_batch`); all are queued at once and answered in order. A request that
    // ends early (the client left, a run failed) drops its receivers, and the scheduler skips
    // the runs nobody waits for.
    let budget = s.node.config.scheduler.prefill_chunk_tokens as usize;
    let mut inputs = inputs.into_iter();
    let mut pending = Vec::new();
    for run in crate::scheduler::batch::embed_batches(&lengths, budget) {
        let (tx, rx) = oneshot::channel();
        let batch: Vec<Vec<i32>> = inputs.by_ref().take(run.len()).collect();
        ready.scheduler.submit(Job::Embed(EmbedJob {
            inputs: batch,
            reply: tx,
        }))?;
        pending.push((run, rx));
    }
    let mut data = Vec::with_capacity(lengths.len());
    for (run, rx) in pending {
        let vectors = rx
            .await
            .map_err(|_| ApiError::internal("the scheduler dropped the embedding"))?
            .map_err(|e| {
                // The engine numbers a run's inputs from 0: say where the run starts.
                let mut e = ApiError::from(e);
                if run.start > 0 {
                    e.message = format!("(inputs from index {} on) {}", run.start, e.message);
                }
                e
            })?;
        if vectors.len() != run.len() {
            return Err(ApiError::internal(format!(
                "the engine returned {} embeddings for {} inputs",
                vectors.len(),
                run.len()
            )));
        }
        for v in vectors {
            let embedding = if valid.base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            let i = data.len();
            data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
        }
    }
    Ok((
        valid.model.clone(),
        json!({"object": "list", "data": data, "model": valid.model, "usage": {"prompt_tokens": total, "total_tokens": total}}),
    ))
}

/// Serve until SIGTERM/SIGINT, then drain: `/readyz` fails at once, new
/// inference requests get 503, in-flight streams finish within the grace
/// period, then the listener closes and the process exits. Connections are
/// capped and timed out by the edge (`gantry_edge::serve`, `edge` limits).
pub async fn serve(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    edge: gantry_edge::EdgeArgs,
) -> std::io::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!(%addr, "gantry-node listening");
    let app = router(AppState { node: node.clone() }, edge.max_body_bytes);
    let edge_metrics = Some(node.metrics.edge.clone());
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let drain_node = node.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        drain_node.draining.store(true, Ordering::SeqCst);
        let grace = Duration::from_secs(drain_node.config.scheduler.shutdown_grace_seconds);
        tracing::info!(
            inflight = drain_node.inflight.load(Ordering::SeqCst),
            grace_s = grace.as_secs(),
            "draining"
        );
        let deadline = tokio::time::Instant::now() + grace;
        while drain_node.inflight.load(Ordering::SeqCst) > 0
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left = drain_node.inflight.load(Ordering::SeqCst);
        if left > 0 {
            tracing::warn!(left, "grace period over; closing with requests in flight");
        }
        let _ = stop_tx.send(());
    });
    gantry_edge::serve(listener, app, edge, edge_metrics, async move {
        let _ = stop_rx.await;
    })
    .await
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}
