//! The proxied OpenAI routes (the gateway's request path): auth → body (size-limited) →
//! `model` → route (a model, or a LoRA adapter of one: [`RouteTable::resolve`]) → replica
//! (held while none is ready) → upstream call (retried on another replica before the first
//! response byte) → response relayed chunk by chunk.
//!
//! The upstream body is never buffered: each chunk the node writes is handed to the client's
//! connection as it arrives. When the client goes away, the server drops the relayed body and
//! with it the upstream response, which closes the node connection; the node sees the
//! disconnect and frees the sequence at its next step. Retries happen only before a response
//! exists: on a refused connection (the request never reached a node) and on a 503 (the node
//! refused it whole). Any other failure after sending is a 502: the node may have started work.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use backon::BackoffBuilder;
use futures::StreamExt;

use gantry_api::node_token::NODE_TOKEN_HEADER;

use crate::affinity::{RouteKey, route_key};
use crate::auth::Caller;
use crate::body::{form_boundary, model_of, model_of_form, read_body};
use crate::error::GatewayError;
use crate::route_table::{Lease, ModelRoute, NoReplica, Target};
use crate::state::GatewayState;

/// Longest `Retry-After` honoured when skipping a replica that answered 503.
const MAX_REPLICA_BACKOFF: Duration = Duration::from_secs(30);
/// `Retry-After` the gateway sends when it refuses to hold a request.
const RETRY_AFTER_SECONDS: u64 = 5;

/// Authenticate from `Authorization: Bearer <key>` when keys are configured.
pub fn authenticate(
    state: &GatewayState,
    headers: &HeaderMap,
) -> Result<Option<Caller>, GatewayError> {
    let Some(keys) = &state.keys else {
        return Ok(None);
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            GatewayError::unauthorized("missing API key: send it as `Authorization: Bearer <key>`")
        })?;
    keys.check(presented)
        .map(Some)
        .ok_or_else(|| GatewayError::unauthorized("invalid API key"))
}

/// Counts a held request (total and per model) while alive.
struct Held<'a> {
    state: &'a GatewayState,
    model: &'a str,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.state.held.fetch_sub(1, Ordering::Relaxed);
        self.state
            .metrics
            .held
            .with_label_values(&[self.model])
            .dec();
    }
}

/// What one request is for: the model id it named, the model whose replicas serve it, and the
/// adapter of that model when it named one.
#[derive(Clone, Copy, Debug)]
struct Served<'a> {
    /// The requested id (metrics and messages).
    id: &'a str,
    /// The base model's id (its route).
    model: &'a str,
    adapter: Option<&'a str>,
}

impl Served<'_> {
    fn route(&self, state: &GatewayState) -> Result<Arc<ModelRoute>, GatewayError> {
        state
            .table
            .get(self.model)
            .ok_or_else(|| GatewayError::model_not_found(self.id))
    }

    /// The error for a pick that found no replica for good.
    fn refused(&self, route: &ModelRoute, why: NoReplica) -> Option<GatewayError> {
        match (why, self.adapter) {
            (NoReplica::Failed, _) => Some(failed(self.id)),
            (NoReplica::AdapterRefused, Some(adapter)) => {
                let report = route
                    .adapter_reports(adapter)
                    .into_iter()
                    .find(|a| a.state == gantry_api::AdapterState::Refused);
                Some(GatewayError::adapter_refused(
                    self.id,
                    self.model,
                    report.as_ref().and_then(|a| a.reason.as_deref()),
                    report
                        .as_ref()
                        .and_then(|a| a.message.as_deref())
                        .unwrap_or("the node refused it"),
                ))
            }
            _ => None,
        }
    }
}

/// A replica for `served`, holding the request while none is ready (scale from zero, a
/// restart) up to the hold timeout and within the held-request bounds. Returns the lease and
/// the time spent held.
async fn acquire(
    state: &GatewayState,
    served: Served<'_>,
    key: Option<RouteKey>,
) -> Result<(Lease, Duration), GatewayError> {
    let id = served.id;
    let route = served.route(state)?;
    match pick(state, &route, served, &[], key) {
        Ok(lease) => return Ok((lease, Duration::ZERO)),
        Err(why) => {
            if let Some(e) = served.refused(&route, why) {
                return Err(e);
            }
        }
    }
    // Hold, within bounds.
    let s = &state.settings;
    let gauge = state.metrics.held.with_label_values(&[id]);
    let total = state.held.fetch_add(1, Ordering::Relaxed) + 1;
    gauge.inc();
    let _held = Held { state, model: id };
    if total > s.max_held || gauge.get() > s.max_held_per_model as i64 {
        return Err(GatewayError::unavailable(
            format!(
                "too many requests waiting for a replica of `{id}` (at most {} per model, {} in all)",
                s.max_held_per_model, s.max_held
            ),
            RETRY_AFTER_SECONDS,
        ));
    }
    let start = Instant::now();
    let deadline = start + s.hold_timeout;
    let mut changed = state.table.subscribe();
    let mut route = route;
    loop {
        if route.spec.min_replicas == 0 {
            state.scale.request(id, route.spec.target.clone());
        }
        changed.borrow_and_update();
        match pick(state, &route, served, &[], key) {
            Ok(lease) => {
                let waited = start.elapsed();
                state
                    .metrics
                    .hold
                    .with_label_values(&["served"])
                    .observe(waited.as_secs_f64());
                return Ok((lease, waited));
            }
            Err(why) => {
                if let Some(e) = served.refused(&route, why) {
                    return Err(e);
                }
            }
        }
        let now = Instant::now();
        if now >= deadline {
            state
                .metrics
                .hold
                .with_label_values(&["timeout"])
                .observe(start.elapsed().as_secs_f64());
            return Err(GatewayError::unavailable(
                format!(
                    "no replica of `{id}` became ready within {} s",
                    s.hold_timeout.as_secs()
                ),
                RETRY_AFTER_SECONDS,
            ));
        }
        // Wake on any table change, and at least every scale-up interval to ask again.
        let wait = (deadline - now).min(crate::scale::SCALE_UP_MIN_INTERVAL);
        let _ = tokio::time::timeout(wait, changed.changed()).await;
        route = served.route(state)?;
    }
}

/// The table's pick by `key` under the gateway's load factor, counted by rule under the
/// requested id (an adapter's own).
fn pick(
    state: &GatewayState,
    route: &ModelRoute,
    served: Served<'_>,
    exclude: &[String],
    key: Option<RouteKey>,
) -> Result<Lease, NoReplica> {
    let (lease, rule) = state.table.pick_served(
        route,
        served.adapter,
        exclude,
        key,
        state.settings.affinity.bound,
    )?;
    state
        .metrics
        .routed
        .with_label_values(&[served.id, rule.as_str()])
        .inc();
    Ok(lease)
}

fn failed(id: &str) -> GatewayError {
    GatewayError::unavailable(
        format!("the model `{id}` cannot serve: see its Model status"),
        30,
    )
}

fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn relay_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !HOP_BY_HOP.contains(&name.as_str()) {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Request headers passed to the node: content type (JSON, or the caller's multipart form with
/// its boundary) and accept, and a request id if any.
/// The caller's `Authorization` stays at the gateway, and so does any `X-Gantry-Node-Token` a
/// caller sends: only the gateway's own (added per replica) ever reaches a node.
fn upstream_headers(from: &HeaderMap) -> HeaderMap {
    let mut h = HeaderMap::new();
    let content_type = match (form_boundary(from), from.get(header::CONTENT_TYPE)) {
        (Some(_), Some(ct)) => ct.clone(),
        _ => HeaderValue::from_static("application/json"),
    };
    h.insert(header::CONTENT_TYPE, content_type);
    for name in [header::ACCEPT, HeaderName::from_static("x-request-id")] {
        if let Some(v) = from.get(&name) {
            h.insert(name, v.clone());
        }
    }
    h
}

/// One proxied POST to `path`.
pub async fn proxy(
    State(state): State<Arc<GatewayState>>,
    path: &'static str,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let t0 = Instant::now();
    let mut model_label = String::new();
    let resp = match forward(&state, path, &headers, body, t0, &mut model_label).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    state
        .metrics
        .requests
        .with_label_values(&[model_label.as_str(), resp.status().as_str()])
        .inc();
    resp
}

async fn forward(
    state: &GatewayState,
    path: &'static str,
    headers: &HeaderMap,
    body: Body,
    t0: Instant,
    model_label: &mut String,
) -> Result<Response, GatewayError> {
    let caller = authenticate(state, headers)?;
    let bytes = read_body(body, headers, state.settings.max_body_bytes).await?;
    let id = match form_boundary(headers) {
        Some(boundary) => model_of_form(&bytes, &boundary).await?,
        None => model_of(&bytes)?,
    };
    if let Some(c) = &caller
        && !c.may_use(&id)
    {
        return Err(GatewayError::forbidden(&id));
    }
    // Exact ids first (a model's, then an adapter's), then `<model>:<name>`.
    let (model, adapter) = match state.table.resolve(&id) {
        Target::Model(route) => (route.spec.id.clone(), None),
        Target::Adapter { route, id: adapter } => {
            if let Some(refusal) = route.refusal(&adapter) {
                return Err(GatewayError::adapter_refused(
                    &id,
                    &route.spec.id,
                    refusal.reason.as_deref(),
                    refusal.message.as_deref().unwrap_or("the node refused it"),
                ));
            }
            (route.spec.id.clone(), Some(adapter))
        }
        Target::UnknownAdapter { route, name } => {
            // Only the adapters this caller may use are named.
            let usable: Vec<String> = route
                .adapter_ids()
                .into_iter()
                .filter(|a| caller.as_ref().is_none_or(|c| c.may_use(a)))
                .collect();
            return Err(GatewayError::adapter_not_found(
                &id,
                &route.spec.id,
                &name,
                &usable,
            ));
        }
        Target::NotFound => return Err(GatewayError::model_not_found(&id)),
    };
    let served = Served {
        id: &id,
        model: &model,
        adapter: adapter.as_deref(),
    };
    // A known model or adapter from here on: label metrics with it (unknown ids would grow
    // the series).
    model_label.push_str(&id);
    let key = route_key(&bytes, headers, &state.settings.affinity);
    let (mut lease, held) = acquire(state, served, key).await?;
    let mut tried: Vec<String> = Vec::new();
    let mut delays = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(20))
        .with_max_delay(Duration::from_millis(500))
        .with_max_times(state.settings.max_retries)
        .with_jitter()
        .build();
    let up_headers = upstream_headers(headers);
    let mut waited = held;
    loop {
        let replica = Arc::clone(&lease.replica);
        let sent_at = Instant::now();
        let mut request = state
            .client
            .post(format!("{}{path}", replica.url))
            .headers(up_headers.clone());
        if let Some(token) = replica.node_token() {
            request = request.header(NODE_TOKEN_HEADER, token.clone());
        }
        let result = request.body(bytes.clone()).send().await;
        let answered_at = Instant::now();
        let (kind, unavailable) = match result {
            Ok(resp) if resp.status() == StatusCode::SERVICE_UNAVAILABLE => {
                let after = retry_after(resp.headers())
                    .unwrap_or(Duration::from_secs(1))
                    .min(MAX_REPLICA_BACKOFF);
                state.table.back_off(&replica, after);
                ("unavailable", Some(resp))
            }
            Ok(resp) => {
                let overhead = sent_at.duration_since(t0).saturating_sub(waited);
                return Ok(relay(state, resp, lease, &id, overhead, answered_at));
            }
            Err(e) if e.is_connect() => {
                tracing::debug!(model = %id, replica = %replica.url, error = %e, "connect failed");
                state.table.connect_failed(&replica);
                ("connect", None)
            }
            Err(e) => {
                state
                    .metrics
                    .upstream_errors
                    .with_label_values(&[id.as_str(), "request"])
                    .inc();
                return Err(GatewayError::bad_gateway(format!(
                    "the node serving `{id}` failed before answering: {e}"
                )));
            }
        };
        state
            .metrics
            .upstream_errors
            .with_label_values(&[id.as_str(), kind])
            .inc();
        tried.push(replica.url.clone());
        drop(lease);
        let next = state
            .table
            .get(&model)
            .and_then(|route: Arc<ModelRoute>| pick(state, &route, served, &tried, key).ok());
        let delay = delays.next();
        match (next, delay) {
            (Some(l), Some(d)) => {
                state
                    .metrics
                    .retries
                    .with_label_values(&[id.as_str()])
                    .inc();
                tokio::time::sleep(d).await;
                waited += d;
                lease = l;
            }
            _ => {
                return match unavailable {
                    // The node's own 503 (with its Retry-After) goes to the client as is.
                    Some(resp) => {
                        let overhead = sent_at.duration_since(t0).saturating_sub(waited);
                        Ok(relay_unleased(state, resp, &id, overhead, answered_at))
                    }
                    None => Err(GatewayError::unavailable(
                        format!("no replica of `{id}` accepted a connection"),
                        1,
                    )),
                };
            }
        }
    }
}

fn response_head(resp: &reqwest::Response) -> Response {
    let mut out = Response::new(Body::empty());
    *out.status_mut() = resp.status();
    relay_headers(resp.headers(), out.headers_mut());
    out
}

/// Relay the upstream response: headers now, body chunk by chunk as it arrives. The lease
/// (outstanding count) lives until the body ends or the client drops it.
fn relay(
    state: &GatewayState,
    resp: reqwest::Response,
    lease: Lease,
    id: &str,
    before_send: Duration,
    answered_at: Instant,
) -> Response {
    let mut out = response_head(&resp);
    let errors = state
        .metrics
        .upstream_errors
        .with_label_values(&[id, "body"]);
    let body = resp.bytes_stream().map(move |chunk| {
        let _outstanding = &lease;
        chunk.inspect_err(|_| errors.inc())
    });
    *out.body_mut() = Body::from_stream(body);
    state
        .metrics
        .overhead
        .observe((before_send + answered_at.elapsed()).as_secs_f64());
    out
}

fn relay_unleased(
    state: &GatewayState,
    resp: reqwest::Response,
    id: &str,
    before_send: Duration,
    answered_at: Instant,
) -> Response {
    let mut out = response_head(&resp);
    let errors = state
        .metrics
        .upstream_errors
        .with_label_values(&[id, "body"]);
    *out.body_mut() = Body::from_stream(
        resp.bytes_stream()
            .map(move |chunk| chunk.inspect_err(|_| errors.inc())),
    );
    state
        .metrics
        .overhead
        .observe((before_send + answered_at.elapsed()).as_secs_f64());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callers_node_token_and_authorization_never_reach_the_node() {
        let mut from = HeaderMap::new();
        from.insert(NODE_TOKEN_HEADER, HeaderValue::from_static("forged"));
        from.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer sk"));
        from.insert(
            header::ACCEPT,
            HeaderValue::from_static("text/event-stream"),
        );
        let up = upstream_headers(&from);
        assert!(up.get(NODE_TOKEN_HEADER).is_none());
        assert!(up.get(header::AUTHORIZATION).is_none());
        assert_eq!(up.get(header::ACCEPT), from.get(header::ACCEPT));
    }
}
