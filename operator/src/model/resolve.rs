//! Model reconcile, engine selection (pure, between validate and build): which EnginePlugins a
//! Model's node pods mount, by the node registry's own rules.
//!
//! Mirrors `EngineRegistry::resolve` in node-pod/src/engine_host/mod.rs:
//! candidates in engine-id order (then EnginePlugin name), each checked in the
//! order pin → accepted (ABI, spec, id conflict) → backend → format →
//! architecture; the first that passes wins; a pin is never overridden and
//! there is no fallback to another format. When nothing passes, every
//! candidate is listed with its reason.
//!
//! The one difference: the operator may not know the architecture yet (see
//! docs/operator.md, "Engine selection"). Then every candidate that passes the
//! other rules is mounted, and the first node report decides.

use kube::ResourceExt;

use crate::crd::{CandidateRejection, EnginePlugin, RejectionCategory};
use crate::model::validate::ValidModel;
use crate::plugin::validate::accept;

/// The outcome of engine selection.
#[derive(Clone, Debug, PartialEq)]
pub enum Resolution {
    /// The architecture is known and this plugin serves it.
    Resolved(Box<EnginePlugin>),
    /// The architecture is not known yet; these plugins pass every other rule (engine-id order).
    Pending(Vec<EnginePlugin>),
    /// No plugin can serve the model; every candidate with its reason.
    Unresolved(Vec<CandidateRejection>),
}

impl Resolution {
    /// The plugins to mount into node pods (none when unresolved).
    pub fn mounted(&self) -> Vec<&EnginePlugin> {
        match self {
            Resolution::Resolved(p) => vec![p],
            Resolution::Pending(ps) => ps.iter().collect(),
            Resolution::Unresolved(_) => Vec::new(),
        }
    }
}

/// Choose the plugin(s) for `model` among `plugins`, knowing `architecture` or not.
pub fn resolve(
    model: &ValidModel,
    architecture: Option<&str>,
    plugins: &[EnginePlugin],
    abi_major: u32,
) -> Resolution {
    let mut candidates: Vec<&EnginePlugin> = plugins.iter().collect();
    candidates.sort_by(|a, b| {
        (a.spec.engine_id.as_str(), a.name_any()).cmp(&(b.spec.engine_id.as_str(), b.name_any()))
    });
    let mut rejections = Vec::new();
    let mut passing = Vec::new();
    for plugin in candidates {
        let reject = |kind, reason: String| CandidateRejection {
            plugin: plugin.name_any(),
            kind,
            reason,
        };
        let spec = &plugin.spec;
        if let Some(pin) = &model.pin
            && pin != &spec.engine_id
        {
            rejections.push(reject(
                RejectionCategory::Pin,
                format!("model is pinned to engine {pin}"),
            ));
            continue;
        }
        if let Err(refusal) = accept(plugin, plugins, abi_major) {
            rejections.push(reject(
                refusal.rejection(),
                format!("plugin not accepted: {refusal}"),
            ));
            continue;
        }
        if spec.gpu_backend != model.backend {
            rejections.push(reject(
                RejectionCategory::Backend,
                format!(
                    "plugin is built for {}, the model runs on {} (resources.gpus = {})",
                    spec.gpu_backend.as_str(),
                    model.backend.as_str(),
                    model.gpus
                ),
            ));
            continue;
        }
        if !spec.formats.contains(&model.format) {
            let formats: Vec<&str> = spec.formats.iter().map(|f| f.as_str()).collect();
            rejections.push(reject(
                RejectionCategory::Format,
                format!(
                    "format {} not supported (plugin formats: {})",
                    model.format.as_str(),
                    formats.join(", ")
                ),
            ));
            continue;
        }
        match architecture {
            Some(arch) if !spec.architectures.iter().any(|a| a == arch) => {
                rejections.push(reject(
                    RejectionCategory::Architecture,
                    format!("architecture {arch} is not in the plugin's list"),
                ));
            }
            // Known and supported: the first such candidate wins, as on the node.
            Some(_) => return Resolution::Resolved(Box::new(plugin.clone())),
            None => passing.push(plugin.clone()),
        }
    }
    if !passing.is_empty() {
        return Resolution::Pending(passing);
    }
    if let Some(pin) = &model.pin
        && !plugins.iter().any(|p| &p.spec.engine_id == pin)
    {
        rejections.push(CandidateRejection {
            plugin: pin.clone(),
            kind: RejectionCategory::Pin,
            reason: format!("pinned engine {pin} is not provided by any EnginePlugin"),
        });
    }
    Resolution::Unresolved(rejections)
}
