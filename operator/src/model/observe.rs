//! Model reconcile, observe step (pure, no client; after render, before resolve): which node
//! reports speak for the Model's current config, and the architecture engine selection goes by.
//!
//! Only pods whose template carries the rendered config's hash speak for the Model: a pod still
//! running the previous config may report an architecture or a verdict that no longer applies.

use crate::model::validate::ValidModel;
use crate::node_report::NodeReport;
use gantry_crd::ModelStatus;

/// What the node pods say about the Model as it is now specified.
#[derive(Clone, Debug)]
pub struct Observation<'a> {
    /// Reports of node pods running the current config, in the read step's order.
    pub current: Vec<&'a NodeReport>,
    /// See [`observed_architecture`].
    pub architecture: Option<String>,
}

/// Keep the reports of pods running the config hashed `config_hash` and find the architecture.
pub fn observe<'a>(
    valid: &ValidModel,
    config_hash: &str,
    reports: &'a [NodeReport],
    previous: Option<&ModelStatus>,
) -> Observation<'a> {
    let current: Vec<&NodeReport> = reports
        .iter()
        .filter(|r| r.config_hash.as_deref() == Some(config_hash))
        .collect();
    let architecture = observed_architecture(valid, &current, previous);
    Observation {
        current,
        architecture,
    }
}

/// The architecture to select by: a node pod's report, else `spec.architecture`, else what an
/// earlier report found for the same source.
pub fn observed_architecture(
    valid: &ValidModel,
    reports: &[&NodeReport],
    previous: Option<&ModelStatus>,
) -> Option<String> {
    let reported = reports
        .iter()
        .filter_map(|r| r.model(&valid.served_name))
        .find_map(|m| m.architecture.clone());
    reported
        .or_else(|| valid.declared_architecture.clone())
        .or_else(|| {
            previous
                .filter(|p| p.observed_source.as_deref() == Some(valid.source.key().as_str()))
                .and_then(|p| p.architecture.clone())
        })
}
