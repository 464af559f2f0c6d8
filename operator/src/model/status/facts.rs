//! Model reconcile, status step (its input): everything the pure fold (`model::status::fold`
//! and the node reports' part in `status/reports.rs`) looks at for a Model that passed
//! validation — the selection, the Deployment after apply, the reports of pods on the current
//! config, the apply and deliver outcomes. The ModelPool reconcile fills it for a pool member.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;

use crate::model::apply::ApplyError;
use crate::model::deliver::{DeliverError, DeliveryProgress};
use crate::model::resolve::Resolution;
use crate::model::validate::ValidModel;
use crate::node_report::NodeReport;
use gantry_crd::Model;

/// Everything the fold looks at, for a Model that passed validation.
#[derive(Clone, Copy, Debug)]
pub struct Facts<'a> {
    pub model: &'a Model,
    pub valid: &'a ValidModel,
    pub architecture: Option<&'a str>,
    pub resolution: &'a Resolution,
    /// The Deployment after the apply step (`None`: no pods, by design or not yet).
    pub deployment: Option<&'a Deployment>,
    /// Reports of node pods running the current config.
    pub reports: &'a [&'a NodeReport],
    /// A refusal by the apiserver that retrying will not fix.
    pub apply_error: Option<&'a ApplyError>,
    /// The in-place plugin deliveries (deliver step), one per plugin.
    pub deliveries: &'a [DeliveryProgress],
    /// The apiserver refused a delivery's copy container.
    pub deliver_error: Option<&'a DeliverError>,
    pub now: Timestamp,
}
