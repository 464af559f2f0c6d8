//! Model reconcile, status step: folds the validation outcome, engine selection, the Deployment
//! and the node pods' reports (engine verdicts, downloads, loads, engine worker crashes) into
//! `Model.status` (pure), then writes it only if it changed and records an Event for each
//! notable condition transition.
//!
//! Nothing in the status changes on its own: no timestamps besides
//! `lastTransitionTime` (kept when the condition's status is unchanged), no
//! rates, no counters. So when the world is still, the folded status equals
//! the stored one and the reconcile writes nothing.
//!
//! This file holds the step's write ([`publish`], with its Events); the pure fold is in `fold`
//! (the whole status, an invalid spec), `rollout` (the Deployment's rollout and the in-place
//! deliveries, which the pool's fold shares), `reports` (the node reports' part) and
//! `adapters` (each LoRA adapter's state on the pods), over the [`Facts`] of `facts`.

mod adapters;
mod draft;
pub mod facts;
pub mod fold;
mod reports;
pub mod rollout;

use kube::api::Api;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};

use super::controller::CONTROLLER;
use crate::context::Context;
use crate::write;
use gantry_crd::conditions::{self, FALSE, TRUE, model as cond, reason};
use gantry_crd::{Model, ModelStatus};

pub use facts::Facts;
pub use fold::{endpoint, fold, fold_invalid, replica_counts, scaled_to_zero};
pub use rollout::{Rollout, fold_rollout};

/// Why the status could not be written.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("cannot write the status of Model {model}: {source}")]
    Patch {
        model: String,
        #[source]
        source: kube::Error,
    },
}

impl StatusError {
    pub fn metric_label(&self) -> &'static str {
        "status_patch"
    }

    pub fn retry(&self) -> write::Retry {
        match self {
            StatusError::Patch { source, .. } => write::classify(source),
        }
    }
}

/// The recent-write kind of a Model's status.
const STATUS_KIND: &str = "Model/status";

pub(crate) fn status_digest(document: Option<&serde_json::Value>) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    document.map(ToString::to_string).hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Write `status` if it differs from the stored one (and from the one this operator wrote in
/// the last moments, whose watch event may not have arrived), then record Events for its
/// transitions. Returns whether anything was written.
pub async fn publish(
    model: &Model,
    status: ModelStatus,
    ctx: &Context,
) -> Result<bool, StatusError> {
    let previous = model.status.clone().unwrap_or_default();
    // Compare as JSON: the same document is the same status, whatever the Rust representation.
    // `autoscaling` belongs to the autoscaler's field manager and is not compared.
    let ours = ModelStatus {
        autoscaling: None,
        ..previous.clone()
    };
    let document = serde_json::to_value(&status).ok();
    if serde_json::to_value(&ours).ok() == document {
        return Ok(false);
    }
    let ns = model.namespace().unwrap_or_default();
    // The same status written a moment ago, its watch event not here yet: already done.
    let digest = status_digest(document.as_ref());
    if ctx
        .caches
        .recent
        .holds(STATUS_KIND, &ns, &model.name_any(), &digest)
    {
        return Ok(false);
    }
    let api = Api::<Model>::namespaced(ctx.client.clone(), &ns);
    write::apply_status(&api, &model.name_any(), &status, &ctx.metrics, CONTROLLER)
        .await
        .map_err(|source| StatusError::Patch {
            model: format!("{ns}/{}", model.name_any()),
            source,
        })?;
    ctx.caches
        .recent
        .wrote(STATUS_KIND, &ns, &model.name_any(), &digest);
    let reference = model.object_ref(&());
    let recorder = ctx.recorder();
    for event in events(&previous, &status) {
        // Events are best effort: the status already says everything they say.
        if let Err(e) = recorder.publish(&event, &reference).await {
            tracing::warn!(model = %model.name_any(), error = %e, "cannot record event");
        }
        ctx.metrics.wrote(CONTROLLER, "Event", "create");
    }
    Ok(true)
}

/// The Events a status change deserves: one per notable condition transition.
pub fn events(previous: &ModelStatus, current: &ModelStatus) -> Vec<Event> {
    let mut out = Vec::new();
    for c in conditions::transitions(&previous.conditions, &current.conditions) {
        let was = conditions::find(&previous.conditions, &c.type_).map(|p| p.status.as_str());
        let (type_, reason) = match (c.type_.as_str(), c.status.as_str()) {
            (cond::READY, TRUE) => (EventType::Normal, c.reason.clone()),
            (cond::READY, FALSE) if was == Some(TRUE) => (EventType::Warning, c.reason.clone()),
            (cond::ENGINE_RESOLVED, TRUE) => (EventType::Normal, "EngineResolved".to_string()),
            (cond::ENGINE_RESOLVED, FALSE) => (EventType::Warning, c.reason.clone()),
            (cond::ARTIFACT_READY, TRUE) => (EventType::Normal, c.reason.clone()),
            (cond::ARTIFACT_READY, FALSE) if c.reason == reason::DOWNLOAD_FAILED => {
                (EventType::Warning, c.reason.clone())
            }
            (cond::DEGRADED, TRUE) => (EventType::Warning, c.reason.clone()),
            (cond::DEGRADED, FALSE) if was == Some(TRUE) => {
                (EventType::Normal, "Recovered".to_string())
            }
            _ => continue,
        };
        let mut note = c.message.clone();
        // Events carry at most 1 kB of note.
        if note.len() > 1000 {
            let mut cut = 1000;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            note.truncate(cut);
        }
        out.push(Event {
            type_,
            reason,
            note: (!note.is_empty()).then_some(note),
            action: c.type_.clone(),
            secondary: None,
        });
    }
    out
}
