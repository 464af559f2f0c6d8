//! Custom resources, a Model's LoRA adapters: `spec.adapters` (the validate step checks them
//! and the render step puts them into the node config's `models[].adapters`) and
//! `status.adapters` (the status step folds them from the node pods' reports; the gateway
//! routes each served id to the Model's pods).
//!
//! ```yaml
//! spec:
//!   adapters:
//!     - name: pirate                        # served as `<servedName>:pirate`
//!       source: {uri: hf://org/smollm2-pirate-lora}
//!       scale: 0.8
//!     - name: legal
//!       source: {uri: pvc://loras/legal}
//!       servedName: legal-assistant         # served under its own id instead
//! status:
//!   adapters:
//!     - {name: pirate, id: "smollm2:pirate", state: Loaded, loadedReplicas: 2, readyReplicas: 2}
//!     - {name: legal, id: legal-assistant, state: Refused, reason: mismatch,
//!        message: "...", loadedReplicas: 0, readyReplicas: 2}
//! ```

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{SERVED_NAME_PATTERN, SOURCE_URI_PATTERN, SecretKeyRef};
use crate::schema::adapter_scale_schema;

/// `spec.adapters[].name`: a DNS label (`gantry_api::config::check_adapter_name`).
pub const ADAPTER_NAME_PATTERN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";

/// Most adapters one Model may list (the node's `gantry_api::config::MAX_ADAPTERS`).
pub const MAX_ADAPTERS: usize = gantry_api::config::MAX_ADAPTERS;

/// The largest `scale` (the node's own limit).
pub const MAX_ADAPTER_SCALE: f64 = 16.0;

/// `spec.adapters`: no two adapters name the same `servedName` (names are unique by the
/// list-map key already).
pub const ADAPTER_SERVED_NAMES_RULE: &str = "self.all(a, !has(a.servedName) || self.exists_one(b, has(b.servedName) && b.servedName == a.servedName))";

/// `spec`: no adapter is served under the Model's own `servedName` (the validate step also
/// checks the default, the Model's name, which a rule on `spec` cannot see).
pub const ADAPTER_NOT_BASE_RULE: &str = "!has(self.servedName) || !has(self.adapters) || self.adapters.all(a, !has(a.servedName) || a.servedName != self.servedName)";

/// One LoRA adapter served on top of the Model's weights, under a model id of its own.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Adapter {
    /// Unique among the Model's adapters: a DNS label (lowercase letters, digits and `-`, at
    /// most 63). The adapter is served as `<servedName>:<name>` unless `servedName` is set.
    #[schemars(regex(pattern = ADAPTER_NAME_PATTERN), length(min = 1, max = 63))]
    pub name: String,
    /// Where the adapter's files come from: a GGUF LoRA file, or a PEFT directory
    /// (`adapter_config.json` and `adapter_model.safetensors`).
    pub source: AdapterSource,
    /// Multiplies the adapter's delta (the adapter's own `alpha / rank` applies on top).
    /// Greater than 0, at most 16. Defaults to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "adapter_scale_schema")]
    pub scale: Option<f64>,
    /// The OpenAI model id clients send in `model` for this adapter. Defaults to
    /// `<servedName>:<name>`. Must not be the Model's own served name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = SERVED_NAME_PATTERN), length(max = 128))]
    pub served_name: Option<String>,
}

impl Adapter {
    /// The OpenAI model id of this adapter of the Model served as `base`.
    pub fn model_id(&self, base: &str) -> String {
        match &self.served_name {
            Some(s) => s.clone(),
            None => format!(
                "{base}{}{}",
                gantry_api::config::ADAPTER_SEPARATOR,
                self.name
            ),
        }
    }
}

/// Where an adapter's files come from: `spec.source` without `quantization` (an adapter is
/// one set of weights).
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdapterSource {
    /// Location of the adapter, in the schemes of `spec.source.uri`: `hf://org/repo[@revision]`,
    /// `https://host/path`, `pvc://claim/path` (mounted read-only), `file:///path`,
    /// `s3://bucket/prefix`.
    #[schemars(regex(pattern = SOURCE_URI_PATTERN), length(max = 2048))]
    pub uri: String,
    /// Files to fetch from the source, relative to it. Empty: what the base model's format
    /// needs (the GGUF file, or the PEFT pair).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub files: Vec<String>,
    /// The Secret of the token for the source. Node pods hold one source credential, the one
    /// of `spec.source.secretRef`: when set, this must name the same Secret and key (it then
    /// documents that the adapter needs it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
}

/// Where one adapter stands on the Model's node pods.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdapterStatus {
    /// The adapter's `spec.adapters[].name`.
    pub name: String,
    /// The OpenAI model id it is served under (`<servedName>:<name>`, or its `servedName`).
    pub id: String,
    /// `Refused` when a ready node pod refused it, else `Loaded` when one has it loaded, else
    /// `Downloaded` when one has its files, else `Pending`.
    pub state: AdapterState,
    /// With `Refused`: the node's stable label, `download`, `unsupported` (the engine serves no
    /// adapters), `mismatch` (wrong rank, shape or base model), `corrupt` or `memory`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// With `Refused`: the refusing node pod and its words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Ready node pods (those serving the base model) that have the adapter loaded.
    pub loaded_replicas: i32,
    /// Ready node pods: those on the current config that report the base model loaded.
    pub ready_replicas: i32,
}

/// Where an adapter stands: the node's `AdapterState` words, in the CRD's PascalCase.
#[derive(JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdapterState {
    /// Waiting for a ready node pod, its base model or its download.
    #[default]
    Pending,
    /// Its files are on a node pod, not yet in memory.
    Downloaded,
    /// In the engine of at least one node pod: requests use it at once.
    Loaded,
    /// A node pod refused it (`reason` says why); the base model keeps serving.
    Refused,
}

impl AdapterState {
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterState::Pending => "Pending",
            AdapterState::Downloaded => "Downloaded",
            AdapterState::Loaded => "Loaded",
            AdapterState::Refused => "Refused",
        }
    }
}

impl From<gantry_api::AdapterState> for AdapterState {
    fn from(s: gantry_api::AdapterState) -> Self {
        match s {
            gantry_api::AdapterState::Pending => AdapterState::Pending,
            gantry_api::AdapterState::Downloaded => AdapterState::Downloaded,
            gantry_api::AdapterState::Loaded => AdapterState::Loaded,
            gantry_api::AdapterState::Refused => AdapterState::Refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_state_has_the_same_word_in_pascal_case() {
        for s in [
            gantry_api::AdapterState::Pending,
            gantry_api::AdapterState::Downloaded,
            gantry_api::AdapterState::Loaded,
            gantry_api::AdapterState::Refused,
        ] {
            let ours = AdapterState::from(s);
            assert_eq!(ours.as_str().to_lowercase(), s.as_str());
            assert_eq!(
                serde_json::to_value(ours).expect("json"),
                serde_json::json!(ours.as_str())
            );
        }
    }

    #[test]
    fn an_adapter_is_served_as_base_colon_name_unless_it_names_its_own_id() {
        let mut a = Adapter {
            name: "pirate".into(),
            ..Adapter::default()
        };
        assert_eq!(a.model_id("smollm2"), "smollm2:pirate");
        a.served_name = Some("pirate-bot".into());
        assert_eq!(a.model_id("smollm2"), "pirate-bot");
    }
}
