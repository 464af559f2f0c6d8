//! `GET /v1/models` (a gateway route beside the proxied ones, after auth): the models that
//! serve now or can scale up, each followed by its LoRA adapters, all filtered by what the
//! caller's key may use.
//!
//! An adapter is its own model object with `"parent": "<base id>"` (the OpenAI-style extension
//! vLLM uses for its LoRA adapters). Its ids come from the route table: declared by the
//! discovery source or reported by the replicas. An adapter every replica refused is left
//! out, and so is an adapter id that is also a model's (the model wins, as in routing).

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use gantry_api::{AdapterState, LoadState};

use crate::proxy::authenticate;
use crate::route_table::ModelRoute;
use crate::state::GatewayState;

/// `GET /v1/models`.
pub async fn list(State(state): State<Arc<GatewayState>>, headers: HeaderMap) -> Response {
    let caller = match authenticate(&state, &headers) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let may_use = |id: &str| caller.as_ref().is_none_or(|c| c.may_use(id));
    let snapshot = state.table.snapshot();
    let mut routes: Vec<&Arc<ModelRoute>> =
        snapshot.values().filter(|route| route.listable()).collect();
    routes.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
    let mut data = Vec::new();
    for route in routes {
        let id = &route.spec.id;
        if may_use(id) {
            data.push(model_card(id, route));
        }
        for adapter in route.adapter_ids() {
            if may_use(&adapter)
                && !snapshot.contains_key(&adapter)
                && let Some(card) = adapter_card(&adapter, route)
            {
                data.push(card);
            }
        }
    }
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// One model's entry: OpenAI's fields, then what the Model's replicas report (the same fields
/// a node's own `/v1/models` has, where its status carries them).
fn model_card(id: &str, route: &ModelRoute) -> serde_json::Value {
    let reports: Vec<gantry_api::ModelStatus> = route
        .replicas
        .iter()
        .filter_map(|r| r.reported(id))
        .collect();
    let loaded: Vec<&gantry_api::ModelStatus> = reports
        .iter()
        .filter(|m| m.load.state == LoadState::Loaded)
        .collect();
    let any = loaded.first().copied().or(reports.first());
    serde_json::json!({
        "id": id,
        "object": "model",
        "created": route.spec.created,
        "owned_by": "gantry",
        "format": any.map(|m| m.format.clone()),
        "architecture": any.and_then(|m| m.architecture.clone()),
        "engine": loaded.first().and_then(|m| m.load.plugin.clone()),
        "ready": !loaded.is_empty(),
        "replicas_ready": loaded.len(),
    })
}

/// One adapter's entry, `None` when every replica that reports it refused it: its base model
/// as `parent`, and how many replicas have it loaded.
fn adapter_card(id: &str, route: &ModelRoute) -> Option<serde_json::Value> {
    if route.refusal(id).is_some() {
        return None;
    }
    let loaded = route
        .adapter_reports(id)
        .iter()
        .filter(|a| a.state == AdapterState::Loaded)
        .count();
    Some(serde_json::json!({
        "id": id,
        "object": "model",
        "created": route.spec.created,
        "owned_by": "gantry",
        "parent": route.spec.id,
        "ready": loaded > 0,
        "replicas_ready": loaded,
    }))
}
