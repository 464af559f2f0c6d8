//! Status step (both reconcilers; the gateway's discovery reads them back): condition types and
//! reasons as constants, and the one function that builds a condition while keeping
//! `lastTransitionTime` stable.
//!
//! Reasons are API: users, alerts and GitOps health checks match on them, so
//! they are `PascalCase` constants here and nowhere else, and docs/operator.md
//! lists every one. A condition's `lastTransitionTime` changes only when its
//! `status` changes; a new reason or message alone keeps the old time, so a
//! steady state produces byte-identical status and therefore no write.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Condition status values.
pub const TRUE: &str = "True";
pub const FALSE: &str = "False";
pub const UNKNOWN: &str = "Unknown";

/// Model condition types.
pub mod model {
    /// The model answers requests: enough node pods are ready and the engine is resolved.
    pub const READY: &str = "Ready";
    /// An EnginePlugin that fits format, architecture, backend and pin was chosen.
    pub const ENGINE_RESOLVED: &str = "EngineResolved";
    /// The weights are downloaded on the node pods.
    pub const ARTIFACT_READY: &str = "ArtifactReady";
    /// No node pod reports a recent crash of the model's engine (a worker process of a plugin
    /// in `process` isolation, which the node restarts).
    pub const ENGINE_HEALTHY: &str = "EngineHealthy";
    /// A rollout is under way.
    pub const PROGRESSING: &str = "Progressing";
    /// Something needs a human: invalid spec, no engine, failed download or load, a crashing
    /// engine, stuck rollout.
    pub const DEGRADED: &str = "Degraded";

    /// All Model condition types, in the order status lists them.
    pub const ALL: [&str; 6] = [
        READY,
        ENGINE_RESOLVED,
        ARTIFACT_READY,
        ENGINE_HEALTHY,
        PROGRESSING,
        DEGRADED,
    ];
}

/// ModelPool condition types: the Model's types of the same name, with the same meaning for
/// the pool's pods (`Progressing` and `Degraded` take the same rollout and in-place delivery
/// reasons as a Model's).
pub mod pool {
    pub use super::model::{DEGRADED, PROGRESSING, READY};

    /// All ModelPool condition types, in the order status lists them.
    pub const ALL: [&str; 3] = [READY, PROGRESSING, DEGRADED];
}

/// EnginePlugin condition types.
pub mod plugin {
    /// The spec is valid and its ABI is the one this operator's node image supports.
    pub const ACCEPTED: &str = "Accepted";
    /// Node pods that mount the plugin loaded it.
    pub const LOADED: &str = "Loaded";

    pub const ALL: [&str; 2] = [ACCEPTED, LOADED];
}

/// Condition reasons. Grouped by the condition that uses them; a few are shared.
pub mod reason {
    // Ready
    /// Ready=True: every desired node pod is ready.
    pub const READY: &str = "Ready";
    /// Ready=True: `replicas.min` is 0 and no pod runs; the gateway starts one on demand.
    pub const SCALED_TO_ZERO: &str = "ScaledToZero";
    /// Ready=False: fewer node pods ready than desired.
    pub const REPLICAS_NOT_READY: &str = "ReplicasNotReady";
    /// Ready=False / EngineResolved=False / Degraded=True: the spec cannot be served as written.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// Ready=False / Degraded=True: no engine can serve the model.
    pub const ENGINE_UNRESOLVED: &str = "EngineUnresolved";
    /// Ready=False / Degraded=True: `spec.pool` names no ModelPool in the Model's namespace.
    pub const POOL_NOT_FOUND: &str = "PoolNotFound";
    /// Ready=False / Degraded=True: the member's `resources.memory` is more than the pool's
    /// pods can ever hold; the pool leaves it out.
    pub const DOES_NOT_FIT: &str = "DoesNotFit";
    /// Ready=False / Degraded=True: an older member of the pool has the same served name.
    pub const SERVED_NAME_TAKEN: &str = "ServedNameTaken";
    /// ModelPool Ready=False: no Model can be served by the pool; it runs no pods.
    pub const NO_MEMBERS: &str = "NoMembers";

    // EngineResolved
    /// EngineResolved=True: one EnginePlugin fits and (once a node reports) the node agrees.
    pub const RESOLVED: &str = "Resolved";
    /// EngineResolved=Unknown: the architecture is not known yet; every fitting plugin is mounted
    /// and the first node report decides.
    pub const ARCHITECTURE_PENDING: &str = "ArchitecturePending";
    /// EngineResolved=Unknown: several EnginePlugins serve the model and `spec.engine` pins
    /// none; all are mounted and the node pods measure them at load (the best serves).
    pub const ENGINE_CHOICE_PENDING: &str = "EngineChoicePending";
    /// EngineResolved=False: no EnginePlugin passes every rule; `status.candidates` lists why.
    pub const NO_MATCHING_ENGINE: &str = "NoMatchingEngine";
    /// EngineResolved=False: a node pod found no loaded plugin that serves the model.
    pub const REJECTED_BY_NODE: &str = "RejectedByNode";

    // ArtifactReady
    /// ArtifactReady=True: the node pods have the weights.
    pub const DOWNLOADED: &str = "Downloaded";
    /// ArtifactReady=False: a download is in progress.
    pub const DOWNLOADING: &str = "Downloading";
    /// ArtifactReady=False / Degraded=True: a node pod reports the download failed.
    pub const DOWNLOAD_FAILED: &str = "DownloadFailed";
    /// ArtifactReady=Unknown / EngineHealthy=Unknown: no node pod has reported yet.
    pub const AWAITING_REPORT: &str = "AwaitingReport";

    // EngineHealthy
    /// EngineHealthy=True: no node pod reports a crash of the model's engine worker in the last
    /// minute, nor a restart waiting out its backoff.
    pub const NO_RECENT_CRASH: &str = "NoRecentCrash";
    /// EngineHealthy=False / Degraded=True: a node pod reports the model's engine worker crashed
    /// or hung within the last minute, or its restart is waiting out the backoff.
    pub const ENGINE_CRASHED: &str = "EngineCrashed";

    // Progressing
    /// Progressing=True: the Deployment is rolling out or scaling.
    pub const ROLLING_OUT: &str = "RollingOut";
    /// Progressing=False: the Deployment is at its desired state.
    pub const ROLLOUT_COMPLETE: &str = "RolloutComplete";
    /// Progressing=False: no Deployment (invalid spec or no engine; a pool: no member).
    pub const NOT_DEPLOYED: &str = "NotDeployed";
    /// Progressing=False / Degraded=True: the Deployment exceeded its progress deadline.
    pub const PROGRESS_DEADLINE_EXCEEDED: &str = "ProgressDeadlineExceeded";
    /// Progressing=True: a new EnginePlugin version is being delivered to the running node
    /// pods in place (no rollout), a Model's or a ModelPool's.
    pub const PLUGIN_UPDATING: &str = "PluginUpdating";
    /// Progressing=False / Degraded=True: an in-place plugin delivery stopped: a node pod
    /// refused the new version, its copy failed, or the apiserver refused the copy container.
    pub const PLUGIN_UPDATE_HALTED: &str = "PluginUpdateHalted";

    // Degraded
    /// Degraded=False: nothing needs attention.
    pub const AS_EXPECTED: &str = "AsExpected";
    /// Degraded=True: the apiserver refused an owned object.
    pub const APPLY_FAILED: &str = "ApplyFailed";
    /// Degraded=True: a node pod failed to load the model.
    pub const LOAD_FAILED: &str = "LoadFailed";

    // EnginePlugin Accepted
    /// Accepted=True.
    pub const VALID: &str = "Valid";
    /// Accepted=False: the plugin's ABI major is not the node image's.
    pub const ABI_MISMATCH: &str = "AbiMismatch";
    /// Accepted=False: another EnginePlugin (earlier by name) provides the same engine id and backend.
    pub const ENGINE_ID_CONFLICT: &str = "EngineIdConflict";

    // EnginePlugin Loaded
    /// Loaded=True: every node pod that mounts the plugin loaded it.
    pub const LOADED: &str = "Loaded";
    /// Loaded=False: at least one node pod refused it; `status.loadErrors` says why.
    pub const LOAD_ERRORS: &str = "LoadErrors";
    /// Loaded=Unknown: no running node pod mounts the plugin.
    pub const NOT_MOUNTED: &str = "NotMounted";
}

/// A condition as the status step decides it, before times are attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decided {
    pub type_: &'static str,
    pub status: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl Decided {
    pub fn new(
        type_: &'static str,
        status: &'static str,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Decided {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }
}

/// Turn decided conditions into API conditions. `lastTransitionTime` comes from `previous`
/// when the status of that type is unchanged, otherwise it is `now`.
pub fn with_times(
    decided: &[Decided],
    previous: &[Condition],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    decided
        .iter()
        .map(|d| {
            let last = previous
                .iter()
                .find(|c| c.type_ == d.type_ && c.status == d.status)
                .map(|c| c.last_transition_time.clone());
            Condition {
                type_: d.type_.to_string(),
                status: d.status.to_string(),
                reason: d.reason.to_string(),
                message: d.message.clone(),
                observed_generation: generation,
                last_transition_time: last.unwrap_or(Time(now)),
            }
        })
        .collect()
}

/// Conditions whose status changed (or that are new) between `previous` and `current`.
pub fn transitions<'a>(previous: &[Condition], current: &'a [Condition]) -> Vec<&'a Condition> {
    current
        .iter()
        .filter(|c| {
            !previous
                .iter()
                .any(|p| p.type_ == c.type_ && p.status == c.status)
        })
        .collect()
}

/// The condition of `type_`, if present.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).expect("valid timestamp")
    }

    #[test]
    fn last_transition_time_moves_only_when_status_changes() {
        let first = with_times(
            &[Decided::new(
                model::READY,
                FALSE,
                reason::REPLICAS_NOT_READY,
                "0/1",
            )],
            &[],
            Some(1),
            t(100),
        );
        assert_eq!(first[0].last_transition_time, Time(t(100)));
        // Same status, new reason and message: the time stays.
        let second = with_times(
            &[Decided::new(
                model::READY,
                FALSE,
                reason::ENGINE_UNRESOLVED,
                "x",
            )],
            &first,
            Some(2),
            t(200),
        );
        assert_eq!(second[0].last_transition_time, Time(t(100)));
        assert!(transitions(&first, &second).is_empty());
        // Status flips: the time moves and it counts as a transition.
        let third = with_times(
            &[Decided::new(model::READY, TRUE, reason::READY, "1/1")],
            &second,
            Some(2),
            t(300),
        );
        assert_eq!(third[0].last_transition_time, Time(t(300)));
        assert_eq!(transitions(&second, &third).len(), 1);
    }
}
