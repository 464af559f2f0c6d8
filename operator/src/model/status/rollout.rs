//! Model and ModelPool reconcile, status step (pure part): the Deployment's rollout and the
//! in-place plugin deliveries of the deliver step, folded into `Progressing` and the cause for
//! `Degraded` they call for. The Model's fold (`model::status::fold`) and the pool's
//! (`pool::status::fold`) both call [`fold_rollout`], so the two say the same with the same
//! reasons.

use k8s_openapi::api::apps::v1::Deployment;

use crate::model::deliver::{DeliverError, DeliveryProgress};
use gantry_crd::conditions::{Decided, FALSE, TRUE, model as cond, reason};

/// What the rollout and the deliveries say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rollout {
    /// The Deployment's rollout, or, once it is complete, an in-place delivery in progress
    /// (`PluginUpdating`) or halted (`PluginUpdateHalted`).
    pub progressing: Decided,
    /// `Degraded=True` as this part sees it: a stuck rollout, else a halted delivery. The
    /// caller weighs it after its own, more actionable causes.
    pub degraded: Option<Decided>,
}

/// Fold the Deployment after the apply step (`None`: no pods) and the deliver step's outcome.
/// `owner` names what runs the pods in a message (`Model`, `pool`).
pub fn fold_rollout(
    deployment: Option<&Deployment>,
    deliveries: &[DeliveryProgress],
    deliver_error: Option<&DeliverError>,
    owner: &str,
) -> Rollout {
    let (mut progressing, stuck) = fold_progress(deployment, owner);
    let delivery = fold_delivery(deliveries, deliver_error);
    // A rollout says more than an in-place delivery; a halt ends the progress.
    if progressing.reason == reason::ROLLOUT_COMPLETE
        && let Some(d) = &delivery
    {
        progressing = if d.type_ == cond::PROGRESSING {
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
    let degraded = if stuck {
        Some(Decided::new(
            cond::DEGRADED,
            TRUE,
            reason::PROGRESS_DEADLINE_EXCEEDED,
            progressing.message.clone(),
        ))
    } else {
        delivery.filter(|d| d.type_ == cond::DEGRADED)
    };
    Rollout {
        progressing,
        degraded,
    }
}

/// The in-place plugin delivery that needs saying: a halt (Degraded), else one in progress
/// (Progressing).
fn fold_delivery(
    deliveries: &[DeliveryProgress],
    deliver_error: Option<&DeliverError>,
) -> Option<Decided> {
    if let Some(e) = deliver_error {
        return Some(Decided::new(
            cond::DEGRADED,
            TRUE,
            reason::PLUGIN_UPDATE_HALTED,
            e.to_string(),
        ));
    }
    if let Some(p) = deliveries.iter().find(|p| p.halted.is_some()) {
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
    deliveries.iter().find(|p| p.delivering()).map(|p| {
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

/// Rollout state of the Deployment: (Progressing condition, stuck?).
fn fold_progress(deployment: Option<&Deployment>, owner: &str) -> (Decided, bool) {
    let Some(d) = deployment else {
        return (
            Decided::new(
                cond::PROGRESSING,
                FALSE,
                reason::NOT_DEPLOYED,
                format!("no Deployment: the {owner} runs no node pods"),
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
