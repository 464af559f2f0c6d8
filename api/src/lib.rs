//! Shared wire types (node ⇄ operator): the JSON the node's status endpoint serves and the operator reads.
//!
//! The node's engine registry produces [`EngineVerdict`]s and the operator
//! folds them into `Model` status; both sides use these exact types so the
//! document cannot drift between them.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// Why one candidate plugin cannot serve a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rejection {
    /// Plugin id (or the manifest path when the manifest could not be read).
    pub plugin: String,
    /// Stable machine-readable kind: `format`, `architecture`, `backend`,
    /// `abi`, `pin`, `load_error`.
    pub kind: RejectionKind,
    /// Human-readable reason.
    pub reason: String,
}

/// Stable categories of rejection, used as status reasons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectionKind {
    Format,
    Architecture,
    Backend,
    Abi,
    Pin,
    LoadError,
}

/// The registry's answer for one model: supported by one plugin, or not
/// supported with every candidate's reason. There is no third state and no
/// fallback to another format or engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "camelCase")]
pub enum EngineVerdict {
    #[serde(rename_all = "camelCase")]
    Supported { plugin: String, version: String },
    #[serde(rename_all = "camelCase")]
    Unsupported { rejections: Vec<Rejection> },
}

impl EngineVerdict {
    pub fn is_supported(&self) -> bool {
        matches!(self, EngineVerdict::Supported { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_json_is_tagged_and_camel_case() {
        let v = EngineVerdict::Unsupported {
            rejections: vec![Rejection {
                plugin: "llama_cpp".into(),
                kind: RejectionKind::LoadError,
                reason: "x".into(),
            }],
        };
        let j = serde_json::to_value(&v).expect("json");
        assert_eq!(j["verdict"], "unsupported");
        assert_eq!(j["rejections"][0]["kind"], "load_error");
        let back: EngineVerdict = serde_json::from_value(j).expect("roundtrip");
        assert_eq!(back, v);
        let s = serde_json::to_value(EngineVerdict::Supported {
            plugin: "a".into(),
            version: "1.0.0".into(),
        })
        .expect("json");
        assert_eq!(
            s,
            serde_json::json!({"verdict": "supported", "plugin": "a", "version": "1.0.0"})
        );
    }
}
