//! Model reconcile, status step: folds the validation outcome, engine selection, the Deployment
//! and the node pods' reports (engine verdicts, downloads, loads, engine worker crashes) into
//! `Model.status` (pure), then writes it only if it changed and records an Event for each
//! notable condition transition.
//!
//! Nothing in the status changes on its own: no timestamps besides
//! `lastTransitionTime` (kept when the condition's status is unchanged), no
//! rates, no counters. So when the world is still, the folded status equals
//! the stored one and the reconcile writes nothing.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};

use super::CONTROLLER;
use super::apply::ApplyError;
use super::deliver::{DeliverError, Progress};
use super::resolve::Resolution;
use super::validate::{self, Invalid, ValidModel};
use crate::context::Context;
use crate::node_report::NodeReport;
use crate::write;
use gantry_crd::conditions::{self, Decided, FALSE, TRUE, UNKNOWN, model as cond, reason};
use gantry_crd::names::{NODE_PORT, owned_name};
use gantry_crd::{Model, ModelStatus, ReplicaStatus};

mod reports;

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

/// Everything the fold looks at, for a Model that passed validation.
#[derive(Clone, Copy, Debug)]
pub struct Facts<'a> {
    pub model: &'a Model,
    pub valid: &'a ValidModel,
    pub architecture: Option<&'a str>,
    pub resolution: &'a Resolution,
    /// The Deployment after the apply step (`None`: no pods, by design or not yet).
    pub deployment: Option<&'a Deployment>,
    /// Reports of node pods running the current config.
    pub reports: &'a [&'a NodeReport],
    /// A refusal by the apiserver that retrying will not fix.
    pub apply_error: Option<&'a ApplyError>,
    /// The in-place plugin deliveries (deliver step), one per plugin.
    pub deliveries: &'a [Progress],
    /// The apiserver refused a delivery's copy container.
    pub deliver_error: Option<&'a DeliverError>,
    pub now: Timestamp,
}

/// The in-place plugin delivery that needs saying: a halt (Degraded), else one in progress
/// (Progressing).
fn fold_delivery(f: &Facts<'_>) -> Option<Decided> {
    if let Some(e) = f.deliver_error {
        return Some(Decided::new(
            cond::DEGRADED,
            TRUE,
            reason::PLUGIN_UPDATE_HALTED,
            e.to_string(),
        ));
    }
    if let Some(p) = f.deliveries.iter().find(|p| p.halted.is_some()) {
        let (pod, why) = p.halted.clone().unwrap_or_default();
        return Some(Decided::new(
            cond::DEGRADED,
            TRUE,
            reason::PLUGIN_UPDATE_HALTED,
            format!(
                "EnginePlugin {} {}: node pod {pod}: {why}; the delivery is halted and {} of {} \
                 node pods run it, the others keep the version they run",
                p.plugin, p.version, p.done, p.pods
            ),
        ));
    }
    f.deliveries.iter().find(|p| p.delivering()).map(|p| {
        Decided::new(
            cond::PROGRESSING,
            TRUE,
            reason::PLUGIN_UPDATING,
            format!(
                "EnginePlugin {} {} delivered in place: {} of {} node pods run it",
                p.plugin, p.version, p.done, p.pods
            ),
        )
    })
}

/// Status for a Model whose spec failed validation. Observations unrelated to the spec
/// (replicas, engine, endpoint) are kept: the last good objects keep running.
pub fn fold_invalid(model: &Model, problems: &[Invalid], now: Timestamp) -> ModelStatus {
    let previous = model.status.clone().unwrap_or_default();
    let msg = format!(
        "the spec cannot be served as written: {}",
        validate::message(problems)
    );
    let keep = |type_: &'static str| {
        conditions::find(&previous.conditions, type_)
            .and_then(|c| {
                let status = [TRUE, FALSE, UNKNOWN]
                    .into_iter()
                    .find(|s| *s == c.status)?;
                // Reasons are always ours (constants), but the stored copy is a String; keep
                // it only when it is one we know, otherwise fall back to InvalidSpec.
                let reason = known_reason(&c.reason)?;
                Some(Decided::new(type_, status, reason, c.message.clone()))
            })
            .unwrap_or_else(|| {
                Decided::new(type_, UNKNOWN, reason::INVALID_SPEC, "the spec is invalid")
            })
    };
    let decided = [
        Decided::new(cond::READY, FALSE, reason::INVALID_SPEC, msg.clone()),
        keep(cond::ENGINE_RESOLVED),
        keep(cond::ARTIFACT_READY),
        keep(cond::ENGINE_HEALTHY),
        keep(cond::PROGRESSING),
        Decided::new(cond::DEGRADED, TRUE, reason::INVALID_SPEC, msg),
    ];
    ModelStatus {
        observed_generation: model.metadata.generation,
        conditions: conditions::with_times(
            &decided,
            &previous.conditions,
            model.metadata.generation,
            now,
        ),
        // The autoscaler's field: never part of what this manager applies.
        autoscaling: None,
        ..previous
    }
}

fn known_reason(r: &str) -> Option<&'static str> {
    const ALL: [&str; 22] = [
        reason::READY,
        reason::SCALED_TO_ZERO,
        reason::REPLICAS_NOT_READY,
        reason::INVALID_SPEC,
        reason::ENGINE_UNRESOLVED,
        reason::RESOLVED,
        reason::ARCHITECTURE_PENDING,
        reason::ENGINE_CHOICE_PENDING,
        reason::NO_MATCHING_ENGINE,
        reason::REJECTED_BY_NODE,
        reason::DOWNLOADED,
        reason::DOWNLOADING,
        reason::DOWNLOAD_FAILED,
        reason::AWAITING_REPORT,
        reason::NO_RECENT_CRASH,
        reason::ENGINE_CRASHED,
        reason::ROLLING_OUT,
        reason::ROLLOUT_COMPLETE,
        reason::NOT_DEPLOYED,
        reason::PROGRESS_DEADLINE_EXCEEDED,
        reason::PLUGIN_UPDATING,
        reason::PLUGIN_UPDATE_HALTED,
    ];
    ALL.into_iter().find(|k| *k == r)
}

/// Rollout state of the Deployment: (Progressing condition, stuck?).
fn fold_progress(deployment: Option<&Deployment>) -> (Decided, bool) {
    let Some(d) = deployment else {
        return (
            Decided::new(
                cond::PROGRESSING,
                FALSE,
                reason::NOT_DEPLOYED,
                "no Deployment: the Model runs no node pods",
            ),
            false,
        );
    };
    let status = d.status.clone().unwrap_or_default();
    let stuck = status.conditions.iter().flatten().any(|c| {
        c.type_.as_deref() == Some("Progressing")
            && c.status.as_deref() == Some("False")
            && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
    });
    if stuck {
        return (
            Decided::new(
                cond::PROGRESSING,
                FALSE,
                reason::PROGRESS_DEADLINE_EXCEEDED,
                "the Deployment exceeded its progress deadline; see its pods' events",
            ),
            true,
        );
    }
    let want = d.spec.replicas.unwrap_or(1);
    let generation_seen = status.observed_generation >= d.metadata.generation;
    let updated = status.updated_replicas.unwrap_or(0);
    let ready = status.ready_replicas.unwrap_or(0);
    let total = status.replicas.unwrap_or(0);
    if !generation_seen || updated < want || ready < want || total > want {
        return (
            Decided::new(
                cond::PROGRESSING,
                TRUE,
                reason::ROLLING_OUT,
                format!("{updated} of {want} node pods updated, {ready} ready"),
            ),
            false,
        );
    }
    (
        Decided::new(
            cond::PROGRESSING,
            FALSE,
            reason::ROLLOUT_COMPLETE,
            format!("{want} node pod(s) at the current revision"),
        ),
        false,
    )
}

/// Fold a validated Model's facts into its status.
///
/// `Degraded` takes the most actionable cause first (apply refused, no engine, download,
/// load, a crashing engine, stuck rollout); `Ready` is `False` whenever the engine is
/// unresolved, even with pods running, because those pods cannot serve the model. A crashing
/// engine leaves `Ready` to the pods: the node restarts the worker and serves meanwhile.
pub fn fold(f: &Facts<'_>) -> ModelStatus {
    let previous = f.model.status.clone().unwrap_or_default();
    let generation = f.model.metadata.generation;
    let (engine_cond, engine, candidates) = reports::fold_engine(f);
    let (artifact_cond, download) = reports::fold_artifact(f);
    let health_cond = reports::fold_health(f);
    let (mut progress_cond, stuck) = fold_progress(f.deployment);
    let delivery = fold_delivery(f);
    // A rollout says more than an in-place delivery; a halt ends the progress.
    if progress_cond.reason == reason::ROLLOUT_COMPLETE
        && let Some(d) = &delivery
    {
        progress_cond = if d.type_ == cond::PROGRESSING {
            d.clone()
        } else {
            Decided::new(
                cond::PROGRESSING,
                FALSE,
                reason::PLUGIN_UPDATE_HALTED,
                d.message.clone(),
            )
        };
    }
    let engine_failed = engine_cond.status == FALSE;

    let replicas = replica_counts(f.deployment);

    let load_failure = reports::fold_load(f);
    let degraded = if let Some(e) = f.apply_error {
        Decided::new(cond::DEGRADED, TRUE, reason::APPLY_FAILED, e.to_string())
    } else if engine_failed {
        Decided::new(
            cond::DEGRADED,
            TRUE,
            reason::ENGINE_UNRESOLVED,
            engine_cond.message.clone(),
        )
    } else if artifact_cond.reason == reason::DOWNLOAD_FAILED {
        Decided::new(
            cond::DEGRADED,
            TRUE,
            reason::DOWNLOAD_FAILED,
            artifact_cond.message.clone(),
        )
    } else if let Some(msg) = load_failure {
        Decided::new(cond::DEGRADED, TRUE, reason::LOAD_FAILED, msg)
    } else if health_cond.status == FALSE {
        Decided::new(
            cond::DEGRADED,
            TRUE,
            reason::ENGINE_CRASHED,
            health_cond.message.clone(),
        )
    } else if stuck {
        Decided::new(
            cond::DEGRADED,
            TRUE,
            reason::PROGRESS_DEADLINE_EXCEEDED,
            progress_cond.message.clone(),
        )
    } else if let Some(halt) = delivery.filter(|d| d.type_ == cond::DEGRADED) {
        halt
    } else {
        Decided::new(cond::DEGRADED, FALSE, reason::AS_EXPECTED, "")
    };

    let ready = if engine_failed {
        Decided::new(
            cond::READY,
            FALSE,
            reason::ENGINE_UNRESOLVED,
            engine_cond.message.clone(),
        )
    } else if f.deployment.is_some() && replicas.desired == 0 {
        scaled_to_zero()
    } else if f.deployment.is_some()
        // The autoscaler adds pods under load: while they start, the Model still serves. Ready
        // needs the desired count, or `replicas.min` (at least 1) when more are wanted.
        && replicas.ready >= replicas.desired.min(f.valid.replicas.min.max(1))
    {
        Decided::new(
            cond::READY,
            TRUE,
            reason::READY,
            format!("{}/{} node pods ready", replicas.ready, replicas.desired),
        )
    } else {
        Decided::new(
            cond::READY,
            FALSE,
            reason::REPLICAS_NOT_READY,
            format!("{}/{} node pods ready", replicas.ready, replicas.desired),
        )
    };

    let decided = [
        ready,
        engine_cond,
        artifact_cond,
        health_cond,
        progress_cond,
        degraded,
    ];
    ModelStatus {
        observed_generation: generation,
        conditions: conditions::with_times(&decided, &previous.conditions, generation, f.now),
        engine,
        // The first reporting pod's measurement, when several engines serve the model.
        engine_choice: f
            .reports
            .iter()
            .find_map(|r| r.model(&f.valid.served_name)?.engine_choice.clone()),
        architecture: f.architecture.map(str::to_string),
        observed_source: Some(f.valid.source.key()),
        replicas: Some(replicas),
        // `status.autoscaling` is owned by the autoscaler's field manager; leaving it out of
        // this apply leaves it as the autoscaler wrote it.
        autoscaling: None,
        download,
        endpoint: f.deployment.is_some().then(|| endpoint(f.valid)),
        candidates,
        // A pool member's reconcile adds where it is (pool/mod.rs).
        pool: None,
    }
}

/// Node pod counts from the Deployment, never from the reports: a silent pod still exists.
pub fn replica_counts(deployment: Option<&Deployment>) -> ReplicaStatus {
    match deployment {
        Some(d) => {
            let s = d.status.clone().unwrap_or_default();
            ReplicaStatus {
                desired: d.spec.replicas.unwrap_or(1),
                current: s.replicas.unwrap_or(0),
                ready: s.ready_replicas.unwrap_or(0),
            }
        }
        None => ReplicaStatus::default(),
    }
}

/// `Ready=True/ScaledToZero`, for a Model or a pool whose Deployment wants no pod.
pub fn scaled_to_zero() -> Decided {
    Decided::new(
        cond::READY,
        TRUE,
        reason::SCALED_TO_ZERO,
        "scaled to zero (replicas.min is 0); the gateway starts a node pod on the first request",
    )
}

/// The in-cluster base URL of a Model's node pods.
pub fn endpoint(model: &ValidModel) -> String {
    format!(
        "http://{}.{}.svc:{NODE_PORT}/v1",
        owned_name(&model.name),
        model.namespace
    )
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
    for event in events(&previous, &status) {
        // Events are best effort: the status already says everything they say.
        if let Err(e) = ctx.recorder.publish(&event, &reference).await {
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
