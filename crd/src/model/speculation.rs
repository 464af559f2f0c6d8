//! Custom resources, a Model's speculative decoding (`spec.engineConfig.speculation`; the
//! operator checks it with the node's own ranges and renders it into the node config).

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How a model speculates; every field defaults to the node's default.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.ngramMin) || !has(self.ngramMax) || self.ngramMin <= self.ngramMax").message("speculation.ngramMin must not exceed ngramMax"))]
#[x_kube(validation = Rule::new("self.method != 'DraftModel' || has(self.draftModel)").message("speculation.draftModel is required when method is DraftModel"))]
pub struct Speculation {
    /// `PromptLookup` (default), `DraftModel` or `Off`.
    #[serde(default)]
    pub method: SpeculationMethod,
    /// With `DraftModel`: the served name of another Model of the same ModelPool (a smaller
    /// model with the same tokenizer). The pool's node pods load a private copy of it next to
    /// each replica of this Model; a draft they cannot use leaves this Model decoding without
    /// drafts, with the reason in the node's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub draft_model: Option<String>,
    /// Most drafted tokens verified per sequence and step (default 15 for `PromptLookup`, 3
    /// for `DraftModel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub draft_tokens: Option<i32>,
    /// Shortest tail of the text looked up (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 8))]
    pub ngram_min: Option<i32>,
    /// Longest tail looked up, tried first (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 8))]
    pub ngram_max: Option<i32>,
    /// No drafts while more sequences than this decode together (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_batch: Option<i32>,
    /// With `PromptLookup`: each step verifies as many drafted tokens as make the most tokens
    /// per second, from how often the sequence's drafts were kept and what the model's steps
    /// cost by size (default true); false verifies `draftTokens` whenever the lookup finds
    /// that many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<bool>,
}

/// What proposes the drafts.
#[derive(JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpeculationMethod {
    /// n-gram drafts from the request's own text.
    #[default]
    PromptLookup,
    /// Drafts decoded by a smaller model of the same ModelPool (`draftModel`).
    DraftModel,
    /// No speculation.
    Off,
}
