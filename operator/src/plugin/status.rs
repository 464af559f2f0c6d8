//! EnginePlugin reconcile, status step: folds acceptance and the node pods' plugin reports into
//! `EnginePlugin.status` (pure), and writes it only when it changed, with Events on transitions.

use gantry_api::PluginStatus;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};

use super::controller::CONTROLLER;
use crate::acceptance::Refusal;
use crate::context::Context;
use crate::node_report::NodeReport;
use crate::write;
use gantry_crd::conditions::{self, Decided, FALSE, TRUE, UNKNOWN, plugin as cond, reason};
use gantry_crd::{
    EnginePlugin, EnginePluginStatus, LoadError, MAX_UPDATES, MAX_VERSION_ROWS, PendingUpdate,
    PluginVersion,
};
use std::collections::BTreeMap;

/// How many pods a `versions` row names.
const EXAMPLE_PODS: usize = 3;
/// The update state whose library is already in force, so it is not listed in `updates`.
const UPDATE_APPLIED: &str = "applied";

/// Why the status could not be written.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("cannot write the status of EnginePlugin {plugin}: {source}")]
    Patch {
        plugin: String,
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

/// The node's entry for this plugin: same engine id and backend.
fn entry<'a>(plugin: &EnginePlugin, report: &'a NodeReport) -> Option<&'a PluginStatus> {
    let status = report.status.as_ref().ok()?;
    status.plugins.iter().find(|p| {
        p.id == plugin.spec.engine_id
            && p.gpu_backend
                .as_deref()
                .is_none_or(|b| b == plugin.spec.gpu_backend.as_str())
    })
}

/// Orders versions as numbers where they are `MAJOR.MINOR.PATCH` (0.10.0 after 0.9.0), by
/// text otherwise, an absent version first.
type VersionKey = (Option<[u64; 3]>, Option<String>, String);

fn version_key(version: Option<&str>, isolation: &str) -> VersionKey {
    let numeric = version.and_then(|v| {
        let mut parts = v.split('.').map(|n| n.parse::<u64>().ok());
        let key = [parts.next()??, parts.next()??, parts.next()??];
        parts.next().is_none().then_some(key)
    });
    (numeric, version.map(str::to_string), isolation.to_string())
}

/// Pods per version and isolation of the loaded plugin, bounded: the `MAX_VERSION_ROWS` rows
/// with the most pods (ties: the lower version), sorted by version, and the pods left out.
#[derive(Default)]
struct Versions(BTreeMap<VersionKey, PluginVersion>);

impl Versions {
    fn add(&mut self, pod: &str, p: &PluginStatus) {
        let row = self
            .0
            .entry(version_key(p.version.as_deref(), &p.isolation))
            .or_insert_with(|| PluginVersion {
                version: p.version.clone(),
                isolation: p.isolation.clone(),
                pods: 0,
                example_pods: Vec::new(),
            });
        row.pods = row.pods.saturating_add(1);
        if row.example_pods.len() < EXAMPLE_PODS {
            row.example_pods.push(pod.to_string());
        }
    }

    fn finish(self) -> (Vec<PluginVersion>, i32) {
        let mut rows: Vec<(VersionKey, PluginVersion)> = self.0.into_iter().collect();
        if rows.len() <= MAX_VERSION_ROWS {
            return (rows.into_iter().map(|(_, r)| r).collect(), 0);
        }
        // Stable: among equal counts, the BTreeMap's version order stands.
        rows.sort_by_key(|(_, r)| std::cmp::Reverse(r.pods));
        let omitted = rows[MAX_VERSION_ROWS..]
            .iter()
            .fold(0i32, |n, (_, r)| n.saturating_add(r.pods));
        rows.truncate(MAX_VERSION_ROWS);
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        (rows.into_iter().map(|(_, r)| r).collect(), omitted)
    }
}

/// Fold acceptance and the reports of the pods that mount `plugin` into its status.
pub fn fold(
    plugin: &EnginePlugin,
    accepted: &Result<(), Refusal>,
    reports: &[NodeReport],
    abi_major: u32,
    now: Timestamp,
) -> EnginePluginStatus {
    let previous = plugin.status.clone().unwrap_or_default();
    let generation = plugin.metadata.generation;
    let accepted_cond = match accepted {
        Ok(()) => Decided::new(
            cond::ACCEPTED,
            TRUE,
            reason::VALID,
            format!(
                "engine {} {} for {}, ABI {abi_major} as the node image",
                plugin.spec.engine_id,
                plugin.spec.version,
                plugin.spec.gpu_backend.as_str()
            ),
        ),
        Err(r) => Decided::new(cond::ACCEPTED, FALSE, r.condition_reason(), r.to_string()),
    };

    // Reports arrive sorted by pod, so loadedBy and loadErrors are stable between reconciles
    // and an unchanged fleet produces an unchanged status.
    let mut loaded_by = Vec::new();
    let mut load_errors = Vec::new();
    let mut silent = 0;
    let mut versions = Versions::default();
    let mut updates = Vec::new();
    let mut updates_omitted = 0i32;
    for report in reports {
        if report.status.is_err() {
            // An unreachable pod says nothing about the plugin either way.
            silent += 1;
            continue;
        }
        let found = entry(plugin, report);
        if let Some(u) = found.and_then(|p| p.update.as_ref())
            && u.state != UPDATE_APPLIED
        {
            if updates.len() < MAX_UPDATES {
                // Not its age (`secondsAgo`): a count that only goes up would rewrite the status.
                updates.push(PendingUpdate {
                    pod: report.pod.clone(),
                    version: u.version.clone(),
                    state: u.state.clone(),
                    message: u.message.clone(),
                });
            } else {
                updates_omitted = updates_omitted.saturating_add(1);
            }
        }
        match found {
            Some(p) if p.loaded => {
                versions.add(&report.pod, p);
                loaded_by.push(report.pod.clone());
            }
            Some(p) => load_errors.push(LoadError {
                pod: report.pod.clone(),
                reason: p.reason.clone().unwrap_or_else(|| "refused".to_string()),
                message: p.message.clone().unwrap_or_default(),
            }),
            // Mounted but not discovered: the copy failed or libraryPath points elsewhere.
            None => load_errors.push(LoadError {
                pod: report.pod.clone(),
                reason: "not_discovered".to_string(),
                message: format!(
                    "the node found no manifest under {}/{}/{}",
                    gantry_crd::names::NODE_PLUGINS_DIR,
                    plugin.spec.engine_id,
                    plugin.spec.gpu_backend.as_str()
                ),
            }),
        }
    }
    let loaded_cond = if let Some(first) = load_errors.first() {
        Decided::new(
            cond::LOADED,
            FALSE,
            reason::LOAD_ERRORS,
            format!(
                "{} of {} reporting node pods refused the plugin; {}: {} ({})",
                load_errors.len(),
                load_errors.len() + loaded_by.len(),
                first.pod,
                first.message,
                first.reason
            ),
        )
    } else if !loaded_by.is_empty() {
        Decided::new(
            cond::LOADED,
            TRUE,
            reason::LOADED,
            format!("loaded by {} node pod(s)", loaded_by.len()),
        )
    } else {
        let msg = if silent > 0 {
            format!("{silent} node pod(s) mount the plugin but none has reported yet")
        } else {
            "no running node pod mounts this plugin".to_string()
        };
        Decided::new(cond::LOADED, UNKNOWN, reason::NOT_MOUNTED, msg)
    };
    let (versions, versions_omitted) = versions.finish();
    EnginePluginStatus {
        observed_generation: generation,
        conditions: conditions::with_times(
            &[accepted_cond, loaded_cond],
            &previous.conditions,
            generation,
            now,
        ),
        loaded_by,
        load_errors,
        versions,
        versions_omitted,
        updates,
        updates_omitted,
    }
}

/// Write `status` if it changed; Events for transitions of `Accepted` and `Loaded`.
pub async fn publish(
    plugin: &EnginePlugin,
    status: EnginePluginStatus,
    ctx: &Context,
) -> Result<bool, StatusError> {
    let previous = plugin.status.clone().unwrap_or_default();
    if serde_json::to_value(&previous).ok() == serde_json::to_value(&status).ok() {
        return Ok(false);
    }
    let api = Api::<EnginePlugin>::all(ctx.client.clone());
    write::apply_status(&api, &plugin.name_any(), &status, &ctx.metrics, CONTROLLER)
        .await
        .map_err(|source| StatusError::Patch {
            plugin: plugin.name_any(),
            source,
        })?;
    let reference = plugin.object_ref(&());
    for c in conditions::transitions(&previous.conditions, &status.conditions) {
        let type_ = match (c.type_.as_str(), c.status.as_str()) {
            (_, FALSE) => EventType::Warning,
            (_, TRUE) => EventType::Normal,
            _ => continue,
        };
        let event = Event {
            type_,
            reason: c.reason.clone(),
            note: (!c.message.is_empty()).then(|| c.message.clone()),
            action: c.type_.clone(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder().publish(&event, &reference).await {
            tracing::warn!(plugin = %plugin.name_any(), error = %e, "cannot record event");
        }
        ctx.metrics.wrote(CONTROLLER, "Event", "create");
    }
    Ok(true)
}
