//! EnginePlugin reconcile, status step: folds acceptance and the node pods' plugin reports into
//! `EnginePlugin.status` (pure), and writes it only when it changed, with Events on transitions.

use gantry_api::PluginStatus;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};

use super::CONTROLLER;
use crate::acceptance::Refusal;
use crate::context::Context;
use crate::node_report::NodeReport;
use crate::write;
use gantry_crd::conditions::{self, Decided, FALSE, TRUE, UNKNOWN, plugin as cond, reason};
use gantry_crd::{EnginePlugin, EnginePluginStatus, LoadError};

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
    for report in reports {
        if report.status.is_err() {
            // An unreachable pod says nothing about the plugin either way.
            silent += 1;
            continue;
        }
        match entry(plugin, report) {
            Some(p) if p.loaded => loaded_by.push(report.pod.clone()),
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
        if let Err(e) = ctx.recorder.publish(&event, &reference).await {
            tracing::warn!(plugin = %plugin.name_any(), error = %e, "cannot record event");
        }
        ctx.metrics.wrote(CONTROLLER, "Event", "create");
    }
    Ok(true)
}
