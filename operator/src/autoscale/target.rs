//! The built-in autoscaler (beside the reconcile path), each interval's input: whose replica
//! count a target is (a Model's own Deployment or a pool's), its Deployment, its ready and
//! reachable node pods, and the gateway's scale-up request on the Deployment.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::str::FromStr;

use crate::node_pod::NodePod;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::decide::Policy;
use crate::model::validate::ValidModel;
use crate::node_report::{PodFacts, facts};
use gantry_crd::names::{ANNOTATION_SCALE_UP_REQUESTED, LABEL_MODEL, LABEL_NAME, NODE_APP_NAME};
use gantry_crd::{AutoscalingStatus, Model, ModelPool};

/// Whose replica count a target is: a Model's own Deployment, or a pool's.
#[derive(Clone, Copy, Debug)]
pub(super) enum Owner<'a> {
    Model(&'a Model),
    Pool(&'a ModelPool),
}

impl Owner<'_> {
    /// History and outcome key: `namespace/name` of a Model, `ModelPool/namespace/name` of a pool.
    pub(super) fn key(&self) -> String {
        match self {
            Owner::Model(m) => key(m),
            Owner::Pool(p) => format!(
                "{POOL_KEY_PREFIX}{}/{}",
                p.namespace().unwrap_or_default(),
                p.name_any()
            ),
        }
    }

    pub(super) fn namespace(&self) -> String {
        match self {
            Owner::Model(m) => m.namespace(),
            Owner::Pool(p) => p.namespace(),
        }
        .unwrap_or_default()
    }

    pub(super) fn name(&self) -> String {
        match self {
            Owner::Model(m) => m.name_any(),
            Owner::Pool(p) => p.name_any(),
        }
    }

    pub(super) fn stored(&self) -> Option<&AutoscalingStatus> {
        match self {
            Owner::Model(m) => m.status.as_ref().and_then(|s| s.autoscaling.as_ref()),
            Owner::Pool(p) => p.status.as_ref().and_then(|s| s.autoscaling.as_ref()),
        }
    }

    pub(super) fn mode(&self) -> &'static str {
        match self {
            Owner::Model(m) => m.spec.autoscaling.as_ref(),
            Owner::Pool(p) => p.spec.autoscaling.as_ref(),
        }
        .map(|a| a.mode)
        .unwrap_or_default()
        .as_str()
    }
}

/// Pool keys in the histories and outcomes start with this.
pub(super) const POOL_KEY_PREFIX: &str = "ModelPool/";

/// One Model (or pool) to look at this interval.
pub(super) struct Target<'a> {
    pub(super) owner: Owner<'a>,
    /// The Model's (or pool's) uid: a history kept for another object of the same name is
    /// started over.
    pub(super) uid: String,
    /// What the spec asks of the autoscaler. Only this is kept of the validated spec: a
    /// thousand validated Models held through an interval's requests cost megabytes.
    pub(super) policy: Policy,
    pub(super) deployment: &'a Deployment,
    /// Ready, reachable node pods: whom to ask.
    pub(super) ready: Vec<PodFacts>,
    /// The model whose queue counts; `None`: every model on the pod (a pool).
    pub(super) served: Option<String>,
}

pub(super) fn key(model: &Model) -> String {
    format!(
        "{}/{}",
        model.namespace().unwrap_or_default(),
        model.name_any()
    )
}

fn is_ready(pod: &NodePod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Deployments by namespace and name.
pub(super) fn by_name<D: Borrow<Deployment>>(
    deployments: &[D],
) -> BTreeMap<(String, String), &Deployment> {
    deployments
        .iter()
        .map(|d| {
            let d: &Deployment = d.borrow();
            ((d.namespace().unwrap_or_default(), d.name_any()), d)
        })
        .collect()
}

/// Node pods by namespace and the Model (or pool) they serve, from their labels: built once
/// per interval, so finding a target's pods does not scan every pod.
pub(super) fn by_model<P: Borrow<NodePod>>(
    pods: &[P],
) -> BTreeMap<(String, String), Vec<&NodePod>> {
    let mut out: BTreeMap<(String, String), Vec<&NodePod>> = BTreeMap::new();
    for p in pods.iter().map(|p| -> &NodePod { p.borrow() }) {
        if p.labels().get(LABEL_NAME).map(String::as_str) != Some(NODE_APP_NAME) {
            continue;
        }
        if let Some(model) = p.labels().get(LABEL_MODEL) {
            out.entry((p.namespace().unwrap_or_default(), model.clone()))
                .or_default()
                .push(p);
        }
    }
    out
}

/// The ready, reachable node pods labelled for `valid` (a Model or a pool template).
pub(super) fn ready_pods(
    pods: &BTreeMap<(String, String), Vec<&NodePod>>,
    valid: &ValidModel,
) -> Vec<PodFacts> {
    pods.get(&(valid.namespace.clone(), valid.name.clone()))
        .into_iter()
        .flatten()
        .filter(|p| is_ready(p))
        .filter_map(|p| facts(p))
        .collect()
}

/// The gateway's scale-up request, if present and a valid RFC 3339 time.
pub fn scale_up_requested_at(deployment: &Deployment) -> Option<Timestamp> {
    let raw = deployment
        .metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_SCALE_UP_REQUESTED)?;
    match Timestamp::from_str(raw) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(deployment = %deployment.name_any(), value = %raw, error = %e,
                "ignoring {ANNOTATION_SCALE_UP_REQUESTED}: not an RFC 3339 time");
            None
        }
    }
}
