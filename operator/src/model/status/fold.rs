//! Model reconcile, status step (pure part): the validation outcome, the Deployment's rollout
//! and the in-place plugin deliveries (through `status/rollout.rs`, shared with the pool's
//! fold) and the node pods' reports (through `status/reports.rs` and `status/adapters.rs`),
//! folded into `ModelStatus` with its conditions, replica counts, endpoint, adapters and draft model. The
//! write is `model::status::publish`.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;

use super::adapters::fold_adapters;
use super::draft::fold_draft;
use super::facts::Facts;
use super::reports;
use super::rollout::fold_rollout;
use crate::model::validate::{self, Invalid, ValidModel};
use gantry_crd::conditions::{self, Decided, FALSE, TRUE, UNKNOWN, model as cond, reason};
use gantry_crd::names::{NODE_PORT, owned_name};
use gantry_crd::{Model, ModelStatus, ReplicaStatus};

/// Status for a Model whose spec failed validation. Observations unrelated to the spec
/// (replicas, engine, endpoint) are kept: the last good objects keep running.
pub fn fold_invalid(model: &Model, problems: &[Invalid], now: Timestamp) -> ModelStatus {
    let previous = model.status.clone().unwrap_or_default();
    let msg = format!(
        "the spec cannot be served as written: {}",
        validate::message(problems)
    );
    let keep = |type_: &'static str| kept(&previous.conditions, type_);
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

/// The stored condition of `type_` as it is, for a status that cannot judge it anew (an
/// invalid spec): `Unknown, InvalidSpec` when there is none, or it is not one of ours.
pub(crate) fn kept(previous: &[Condition], type_: &'static str) -> Decided {
    conditions::find(previous, type_)
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
    let rollout = fold_rollout(f.deployment, f.deliveries, f.deliver_error, "Model");
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
    } else if let Some(d) = rollout.degraded {
        // A stuck rollout, else a halted in-place delivery.
        d
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
        rollout.progressing,
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
        // A pool member's reconcile adds where it is (pool/member.rs).
        pool: None,
        adapters: fold_adapters(f),
        draft: fold_draft(f),
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
