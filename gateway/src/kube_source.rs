//! Kubernetes discovery (feeds the routing table in a cluster): reflectors on Models and on the
//! EndpointSlices of the Services the operator creates, folded into one snapshot per change.
//!
//! A Model's id is `spec.servedName` or its name, and each of its `spec.adapters` is served as
//! its `servedName` or `<id>:<name>` by the same replicas; its replicas are the endpoints of the
//! EndpointSlices labelled `kubernetes.io/service-name=<owned_name(model)>` in its namespace
//! (for a pool member, `<pool_object_name(spec.pool)>`: the pool's pods serve it),
//! on the port named `http`, ready per the slice's `conditions.ready`. A Model whose status says
//! it cannot serve (invalid spec, no engine, download failed) is marked failed: refused at once
//! rather than held. Calls: list+watch `models.gantry.dev` and `endpointslices.discovery.k8s.io`
//! (cluster-wide, or in `--watch-namespace`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gantry_api::node_token::InstallToken;
use gantry_crd::Model;
use gantry_crd::conditions::{self, reason};
use gantry_crd::names::{self, FIELD_MANAGER, LABEL_MANAGED_BY, NODE_PORT_NAME};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};

use crate::route_table::{ModelSpec, RouteTable, ScaleTarget};

/// The label the EndpointSlice controller puts on every slice of a Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// Whether a Model's status says it cannot serve (not merely "not ready yet").
fn failed(model: &Model) -> bool {
    let Some(status) = &model.status else {
        return false;
    };
    status.conditions.iter().any(|c| {
        c.status == conditions::FALSE
            && ((c.type_ == conditions::model::READY
                && (c.reason == reason::INVALID_SPEC || c.reason == reason::ENGINE_UNRESOLVED))
                || (c.type_ == conditions::model::ARTIFACT_READY
                    && c.reason == reason::DOWNLOAD_FAILED))
    })
}

fn endpoint_urls(slice: &EndpointSlice) -> Vec<(String, bool)> {
    let Some(port) = slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(NODE_PORT_NAME))
        .and_then(|p| p.port)
    else {
        return Vec::new();
    };
    let v6 = slice.address_type == "IPv6";
    slice
        .endpoints
        .iter()
        .flatten()
        .filter_map(|e| {
            // Unset `ready` means ready (EndpointSlice API contract); terminating pods are not.
            let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            e.addresses.first().map(|a| {
                let host = if v6 { format!("[{a}]") } else { a.clone() };
                (format!("http://{host}:{port}"), ready)
            })
        })
        .collect()
}

/// Fold Models and EndpointSlices into routes (pure: the mock-API test drives it too). With an
/// install token, each Model's replicas get the Model's derived node token.
pub fn routes_from(
    models: &[Arc<Model>],
    slices: &[Arc<EndpointSlice>],
    install: Option<&InstallToken>,
) -> Vec<ModelSpec> {
    let mut by_service: HashMap<(String, String), Vec<(String, bool)>> = HashMap::new();
    for s in slices {
        let (Some(ns), Some(svc)) = (s.namespace(), s.labels().get(LABEL_SERVICE_NAME).cloned())
        else {
            continue;
        };
        by_service
            .entry((ns, svc))
            .or_default()
            .extend(endpoint_urls(s));
    }
    // Oldest first, so that of two Models claiming one id the older keeps it.
    let mut sorted: Vec<&Arc<Model>> = models.iter().collect();
    sorted.sort_by(|a, b| {
        (a.creation_timestamp(), a.namespace(), a.name_any()).cmp(&(
            b.creation_timestamp(),
            b.namespace(),
            b.name_any(),
        ))
    });
    sorted
        .into_iter()
        .map(|m| {
            let ns = m.namespace().unwrap_or_default();
            let name = m.name_any();
            // A pool member is served by its pool's pods: their Service, their token, and the
            // pool's Deployment to wake.
            let owner = match &m.spec.pool {
                Some(pool) => names::pool_object_name(pool),
                None => name.clone(),
            };
            let deployment = names::owned_name(&owner);
            // Cloned, not taken: every member of a pool shares its Service.
            let mut endpoints = by_service
                .get(&(ns.clone(), deployment.clone()))
                .cloned()
                .unwrap_or_default();
            endpoints.sort();
            endpoints.dedup_by(|a, b| a.0 == b.0);
            let replicas = m.spec.replicas.clone().unwrap_or_default();
            let id = m.spec.served_name.clone().unwrap_or_else(|| name.clone());
            ModelSpec {
                adapters: m.spec.adapters.iter().map(|a| a.model_id(&id)).collect(),
                id,
                endpoints,
                min_replicas: replicas.min,
                max_replicas: replicas.max,
                failed: failed(m),
                node_token: install.map(|t| t.for_model(&ns, &owner)),
                target: Some(ScaleTarget {
                    namespace: ns,
                    deployment,
                }),
                created: m
                    .creation_timestamp()
                    .map_or(0, |t| t.0.as_second().max(0) as u64),
            }
        })
        .collect()
}

fn valid_models(store: &Store<DeserializeGuard<Model>>) -> Vec<Arc<Model>> {
    store
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok().map(|m| Arc::new(m.clone())))
        .collect()
}

/// Watch Models and EndpointSlices and keep `table` current, forever. The table is first
/// replaced once both lists are in (until then `/readyz` says not synced).
pub async fn run(
    client: kube::Client,
    namespace: Option<String>,
    table: Arc<RouteTable>,
    install: Option<InstallToken>,
) {
    let (models_api, slices_api) = match &namespace {
        Some(ns) => (
            Api::<DeserializeGuard<Model>>::namespaced(client.clone(), ns),
            Api::<EndpointSlice>::namespaced(client.clone(), ns),
        ),
        None => (
            Api::<DeserializeGuard<Model>>::all(client.clone()),
            Api::<EndpointSlice>::all(client.clone()),
        ),
    };
    let (model_store, model_writer) = reflector::store();
    let (slice_store, slice_writer) = reflector::store();
    let changed = Arc::new(tokio::sync::Notify::new());
    let models = reflector::reflector(
        model_writer,
        watcher(models_api, watcher::Config::default()),
    )
    .default_backoff()
    .map(|e| e.map(|_| ()));
    // The EndpointSlice controller copies the Service's labels onto its slices.
    let slice_config =
        watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}"));
    let slices = reflector::reflector(slice_writer, watcher(slices_api, slice_config))
        .default_backoff()
        .map(|e| e.map(|_| ()));
    let notify = changed.clone();
    let events = tokio::spawn(async move {
        let mut merged = std::pin::pin!(futures::stream::select(models, slices));
        while let Some(e) = merged.next().await {
            match e {
                Ok(()) => notify.notify_one(),
                Err(e) => tracing::warn!(error = %e, "gateway discovery watch"),
            }
        }
    });
    if model_store.wait_until_ready().await.is_err()
        || slice_store.wait_until_ready().await.is_err()
    {
        tracing::error!("gateway discovery watch ended before listing");
        return;
    }
    loop {
        table.replace(routes_from(
            &valid_models(&model_store),
            &slice_store.state(),
            install.as_ref(),
        ));
        changed.notified().await;
        // Coalesce a burst of events (a rollout touches many slices) into one rebuild.
        tokio::time::sleep(Duration::from_millis(50)).await;
        if events.is_finished() {
            tracing::error!("gateway discovery watch ended");
            return;
        }
    }
}
