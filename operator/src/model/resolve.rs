//! Model reconcile, resolve step (pure, between observe and build): which EnginePlugins a
//! Model's node pods mount.
//!
//! The rules are the node's own, by construction: both sides call
//! `gantry_api::selection::select` (candidates in engine-id order, then EnginePlugin name; pin →
//! accepted → backend → format → architecture; the first that passes wins; no fallback). This
//! step only describes each EnginePlugin as a candidate, with its acceptance
//! (`crate::acceptance`) as the refusal.
//!
//! The one difference: the operator may not know the architecture yet (see
//! docs/operator.md, "Engine selection"). Then every candidate that passes the
//! other rules is mounted, and the first node report decides.
//!
//! With the architecture known and no pin, when several plugins pass every rule they are all
//! mounted too (`Measured`): the node pods benchmark them at load and the best serves
//! (docs/engines.md, "Engine choice by measurement"); the node's verdict names the winner.

use gantry_api::selection::{Candidate, Selection, Wanted, passing, select};
use kube::ResourceExt;

use crate::acceptance::accept;
use crate::model::validate::ValidModel;
use gantry_crd::{CandidateRejection, EnginePlugin};

/// The outcome of engine selection.
#[derive(Clone, Debug, PartialEq)]
pub enum Resolution {
    /// The architecture is known and this plugin serves it.
    Resolved(Box<EnginePlugin>),
    /// The architecture is not known yet; these plugins pass every other rule (engine-id order).
    Pending(Vec<EnginePlugin>),
    /// Several plugins pass every rule and none is pinned: the node pods measure them.
    Measured(Vec<EnginePlugin>),
    /// No plugin can serve the model; every candidate with its reason.
    Unresolved(Vec<CandidateRejection>),
}

impl Resolution {
    /// The plugins to mount into node pods (none when unresolved).
    pub fn mounted(&self) -> Vec<&EnginePlugin> {
        match self {
            Resolution::Resolved(p) => vec![p],
            Resolution::Pending(ps) | Resolution::Measured(ps) => ps.iter().collect(),
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
    let names: Vec<String> = plugins.iter().map(|p| p.name_any()).collect();
    let modalities: Vec<Vec<String>> = plugins
        .iter()
        .map(|p| {
            p.spec
                .modalities
                .iter()
                .map(|m| m.as_str().to_string())
                .collect()
        })
        .collect();
    let formats: Vec<Vec<String>> = plugins
        .iter()
        .map(|p| {
            p.spec
                .formats
                .iter()
                .map(|f| f.as_str().to_string())
                .collect()
        })
        .collect();
    let candidates: Vec<Candidate<'_>> = plugins
        .iter()
        .enumerate()
        .map(|(i, p)| Candidate {
            name: &names[i],
            engine_id: &p.spec.engine_id,
            refused: accept(p, plugins, abi_major)
                .err()
                .map(|r| (r.rejection(), format!("plugin not accepted: {r}"))),
            gpu_backend: p.spec.gpu_backend.as_str(),
            formats: &formats[i],
            modalities: &modalities[i],
            architectures: &p.spec.architectures,
        })
        .collect();
    let note = format!(" (resources.gpus = {})", model.gpus);
    let want = Wanted {
        format: model.format.as_str(),
        modalities: &model.modalities,
        architecture,
        pin: model.pin.as_deref(),
        backend: model.backend.as_str(),
        backend_note: &note,
        pin_scope: "provided by any EnginePlugin",
    };
    // Several engines fit a known architecture and none is pinned: the node pods measure them.
    if want.pin.is_none() && want.architecture.is_some() {
        let fitting = passing(&candidates, &want);
        if fitting.len() > 1 {
            return Resolution::Measured(fitting.into_iter().map(|j| plugins[j].clone()).collect());
        }
    }
    match select(&candidates, &want) {
        Selection::Chosen(i) => Resolution::Resolved(Box::new(plugins[i].clone())),
        Selection::Pending(ids) => {
            Resolution::Pending(ids.into_iter().map(|i| plugins[i].clone()).collect())
        }
        Selection::Rejected(rejections) => {
            Resolution::Unresolved(rejections.iter().map(CandidateRejection::from).collect())
        }
    }
}
