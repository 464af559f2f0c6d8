//! Both reconcilers, before the pipeline: objects that do not deserialize into the Rust types
//! (a CRD older or newer than this operator, a hand-edited object). They are logged, counted
//! and given a Warning Event; the reconcile then waits for the object to change, and every
//! other object keeps reconciling.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::events::{Event, EventType};

use crate::context::Context;
use gantry_crd::names::{API_GROUP, API_VERSION};

/// Report one malformed object of `kind`.
pub async fn report(ctx: &Context, controller: &'static str, kind: &str, invalid: &InvalidObject) {
    let meta = &invalid.metadata;
    let name = meta.name.clone().unwrap_or_default();
    tracing::warn!(%kind, %name, error = %invalid.error, "object does not match the CRD types; waiting for a change");
    ctx.metrics.reconcile_failed(controller, "malformed_object");
    let reference = ObjectReference {
        api_version: Some(format!("{API_GROUP}/{API_VERSION}")),
        kind: Some(kind.to_string()),
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
        ..ObjectReference::default()
    };
    let event = Event {
        type_: EventType::Warning,
        reason: "Malformed".to_string(),
        note: Some(format!(
            "the object does not match the {kind} schema this operator expects: {}",
            invalid.error
        )),
        action: "Reconcile".to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder().publish(&event, &reference).await {
        tracing::warn!(%kind, %name, error = %e, "cannot record event");
    }
    ctx.metrics.wrote(controller, "Event", "create");
}
