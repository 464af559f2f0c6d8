//! Model reconcile, status step (pure part): what the node pods' reports say, folded into the
//! `EngineResolved`, `ArtifactReady` and `EngineHealthy` conditions, the download progress and
//! the load failure that `model::status::fold` weighs against the Deployment's state.
//!
//! Only reports of node pods running the current config reach here (`model::observe`).

use gantry_api::{ArtifactState, EngineVerdict, LoadState};
use kube::ResourceExt;

use super::facts::Facts;
use crate::model::resolve::Resolution;
use crate::node_report::{self, NodeReport};
use gantry_crd::conditions::{Decided, FALSE, TRUE, UNKNOWN, model as cond, reason};
use gantry_crd::{CandidateRejection, DownloadStatus, ResolvedEngine};

/// The engine part of the status: condition, resolved engine and rejected candidates.
///
/// Precedence: a node's verdict beats the operator's own selection, because the node knows
/// what it actually loaded; a single refusing node is enough for `False`.
pub(super) fn fold_engine(
    f: &Facts<'_>,
) -> (Decided, Option<ResolvedEngine>, Vec<CandidateRejection>) {
    let id = &f.valid.served_name;
    let verdicts = f
        .reports
        .iter()
        .filter_map(|r| Some((r, r.model(id)?.verdict.as_ref()?)));
    let mut confirmed = None;
    for (report, verdict) in verdicts {
        match verdict {
            // One refusing node is enough to say so: its pods cannot serve.
            EngineVerdict::Unsupported { rejections } => {
                let candidates: Vec<CandidateRejection> =
                    rejections.iter().map(Into::into).collect();
                let msg = format!(
                    "node pod {} found no loaded plugin that serves the model: {}",
                    report.pod,
                    summarize(&candidates)
                );
                return (
                    Decided::new(cond::ENGINE_RESOLVED, FALSE, reason::REJECTED_BY_NODE, msg),
                    None,
                    candidates,
                );
            }
            EngineVerdict::Supported { plugin, version } => {
                confirmed.get_or_insert((report, plugin, version));
            }
        }
    }
    if let Some((report, engine_id, version)) = confirmed {
        let object = f
            .resolution
            .mounted()
            .into_iter()
            .find(|p| &p.spec.engine_id == engine_id)
            .map(ResourceExt::name_any);
        let msg = format!(
            "engine {engine_id} {version}{} serves architecture {}; confirmed by node pod {}",
            object
                .as_ref()
                .map(|o| format!(" (EnginePlugin {o})"))
                .unwrap_or_default(),
            f.architecture.unwrap_or("unknown"),
            report.pod
        );
        return (
            Decided::new(cond::ENGINE_RESOLVED, TRUE, reason::RESOLVED, msg),
            Some(ResolvedEngine {
                id: engine_id.clone(),
                version: Some(version.clone()),
                plugin: object,
            }),
            Vec::new(),
        );
    }
    match f.resolution {
        Resolution::Resolved(p) => (
            Decided::new(
                cond::ENGINE_RESOLVED,
                TRUE,
                reason::RESOLVED,
                format!(
                    "EnginePlugin {} (engine {} {}) serves architecture {}",
                    p.name_any(),
                    p.spec.engine_id,
                    p.spec.version,
                    f.architecture.unwrap_or("unknown")
                ),
            ),
            Some(ResolvedEngine {
                id: p.spec.engine_id.clone(),
                version: Some(p.spec.version.clone()),
                plugin: Some(p.name_any()),
            }),
            Vec::new(),
        ),
        Resolution::Pending(ps) | Resolution::Measured(ps) => {
            let names = ps
                .iter()
                .map(ResourceExt::name_any)
                .collect::<Vec<_>>()
                .join(", ");
            let (why, msg) = if matches!(f.resolution, Resolution::Pending(_)) {
                (
                    reason::ARCHITECTURE_PENDING,
                    format!(
                        "the architecture is not known yet; mounted candidates {names}; the first node report decides (set spec.architecture to decide before pods start)"
                    ),
                )
            } else {
                (
                    reason::ENGINE_CHOICE_PENDING,
                    format!(
                        "several EnginePlugins serve architecture {}: {names}; all are mounted and the node pods measure them at load, the best serves (set spec.engine to pin one)",
                        f.architecture.unwrap_or("unknown")
                    ),
                )
            };
            (
                Decided::new(cond::ENGINE_RESOLVED, UNKNOWN, why, msg),
                None,
                Vec::new(),
            )
        }
        Resolution::Unresolved(rejections) => {
            let msg = format!(
                "no EnginePlugin serves format {}, architecture {}, backend {}{}: {}",
                f.valid.format.as_str(),
                f.architecture.unwrap_or("(not known yet)"),
                f.valid.backend.as_str(),
                f.valid
                    .pin
                    .as_ref()
                    .map(|p| format!(", engine pin {p}"))
                    .unwrap_or_default(),
                if rejections.is_empty() {
                    "no EnginePlugin objects exist".to_string()
                } else {
                    summarize(rejections)
                }
            );
            (
                Decided::new(
                    cond::ENGINE_RESOLVED,
                    FALSE,
                    reason::NO_MATCHING_ENGINE,
                    msg,
                ),
                None,
                rejections.clone(),
            )
        }
    }
}

fn summarize(candidates: &[CandidateRejection]) -> String {
    candidates
        .iter()
        .map(|c| format!("{}: {}", c.plugin, c.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Artifact condition and download progress from the reports.
pub(super) fn fold_artifact(f: &Facts<'_>) -> (Decided, Option<DownloadStatus>) {
    let entries: Vec<(&NodeReport, &gantry_api::ModelStatus)> = f
        .reports
        .iter()
        .filter_map(|r| Some((*r, r.model(&f.valid.served_name)?)))
        .collect();
    // DeliveryProgress of the pod furthest behind: the model is ready only when all are.
    let download = entries
        .iter()
        .map(|(_, m)| &m.artifact)
        .filter(|a| a.bytes_total > 0 || a.bytes_done > 0)
        .min_by(|a, b| {
            let frac = |x: &gantry_api::ArtifactStatus| {
                if x.bytes_total == 0 {
                    0.0
                } else {
                    x.bytes_done as f64 / x.bytes_total as f64
                }
            };
            frac(a).total_cmp(&frac(b))
        })
        .map(|a| DownloadStatus {
            bytes_done: i64::try_from(a.bytes_done).unwrap_or(i64::MAX),
            bytes_total: i64::try_from(a.bytes_total).unwrap_or(i64::MAX),
        });
    if let Some((r, m)) = entries
        .iter()
        .find(|(_, m)| m.artifact.state == ArtifactState::Failed)
    {
        let msg = format!(
            "node pod {}: {}",
            r.pod,
            m.artifact.message.as_deref().unwrap_or("download failed")
        );
        return (
            Decided::new(cond::ARTIFACT_READY, FALSE, reason::DOWNLOAD_FAILED, msg),
            download,
        );
    }
    if entries.is_empty() {
        let msg = if f.deployment.is_some() {
            "waiting for a node pod to report"
        } else {
            "no node pod runs"
        };
        return (
            Decided::new(cond::ARTIFACT_READY, UNKNOWN, reason::AWAITING_REPORT, msg),
            None,
        );
    }
    if entries
        .iter()
        .all(|(_, m)| m.artifact.state == ArtifactState::Ready)
    {
        return (
            Decided::new(
                cond::ARTIFACT_READY,
                TRUE,
                reason::DOWNLOADED,
                format!("weights present on {} node pod(s)", entries.len()),
            ),
            download,
        );
    }
    let msg = match &download {
        Some(d) if d.bytes_total > 0 => format!(
            "{} of {} bytes ({}%)",
            d.bytes_done,
            d.bytes_total,
            d.bytes_done.saturating_mul(100) / d.bytes_total
        ),
        _ => "download starting".to_string(),
    };
    (
        Decided::new(cond::ARTIFACT_READY, FALSE, reason::DOWNLOADING, msg),
        download,
    )
}

/// The first load failure a node pod reports, as a message.
pub(super) fn fold_load(f: &Facts<'_>) -> Option<String> {
    f.reports.iter().find_map(|r| {
        let m = r.model(&f.valid.served_name)?;
        (m.load.state == LoadState::Failed).then(|| {
            format!(
                "node pod {}: {}",
                r.pod,
                m.load.message.as_deref().unwrap_or("model load failed")
            )
        })
    })
}

/// `EngineHealthy` from the reports' crash records (engine workers of plugins in `process`
/// isolation; an in-process plugin's crash ends the node pod, which Kubernetes restarts).
///
/// `False` while some node pod's record is recent (`node_report::crash_is_recent`), naming the
/// first such pod. The message holds only what changes with a crash or a restart (the node's
/// words for the last crash, which name the plugin, the signal or exit code and the pid; the
/// counts; whether a restart waits), never the running seconds, so a still world folds to the
/// same status.
pub(super) fn fold_health(f: &Facts<'_>) -> Decided {
    let crashes: Vec<(&NodeReport, &gantry_api::CrashStatus)> = f
        .reports
        .iter()
        .filter_map(|r| Some((*r, r.model(&f.valid.served_name)?.crashes.as_ref()?)))
        .collect();
    let recent: Vec<_> = crashes
        .iter()
        .filter(|(_, c)| node_report::crash_is_recent(c))
        .collect();
    if let Some((report, c)) = recent.first() {
        let restart = if c.restart_in_seconds > 0 {
            "its restart waits out the backoff"
        } else {
            "the node restarted it"
        };
        let others = match recent.len() - 1 {
            0 => String::new(),
            1 => " (and 1 more node pod)".to_string(),
            n => format!(" (and {n} more node pods)"),
        };
        let msg = format!(
            "node pod {}{others}: {} ({}); {} crash(es) since the node started, {} in a row; {restart}",
            report.pod,
            c.message,
            signal_or_code(c),
            c.count,
            c.consecutive,
        );
        return Decided::new(cond::ENGINE_HEALTHY, FALSE, reason::ENGINE_CRASHED, msg);
    }
    if let Some((report, c)) = crashes.first() {
        let msg = format!(
            "no engine crash in the last minute; node pod {} counts {} since it started, the last: {} ({})",
            report.pod,
            c.count,
            c.message,
            signal_or_code(c),
        );
        return Decided::new(cond::ENGINE_HEALTHY, TRUE, reason::NO_RECENT_CRASH, msg);
    }
    if f.reports
        .iter()
        .any(|r| r.model(&f.valid.served_name).is_some())
    {
        return Decided::new(
            cond::ENGINE_HEALTHY,
            TRUE,
            reason::NO_RECENT_CRASH,
            "no node pod reports a crash of the model's engine",
        );
    }
    let msg = if f.deployment.is_some() {
        "waiting for a node pod to report"
    } else {
        "no node pod runs"
    };
    Decided::new(cond::ENGINE_HEALTHY, UNKNOWN, reason::AWAITING_REPORT, msg)
}

/// The crash's kind and cause in the node's terms: `crashed, SIGSEGV`, `hung, SIGKILL`,
/// `crashed, exit code 3`.
fn signal_or_code(c: &gantry_api::CrashStatus) -> String {
    match (&c.signal, c.exit_code) {
        (Some(signal), _) => format!("{}, {signal}", c.reason),
        (None, Some(code)) => format!("{}, exit code {code}", c.reason),
        (None, None) => c.reason.clone(),
    }
}
