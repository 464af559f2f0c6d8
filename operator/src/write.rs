//! Apply and status steps (both reconcilers): the only code that writes to the Kubernetes API.
//!
//! Every write is a server-side apply under [`FIELD_MANAGER`] (objects and
//! status alike), under [`AUTOSCALER_FIELD_MANAGER`] (a Deployment's replicas and
//! `Model.status.autoscaling`, nothing else), a delete, or the one write to an object the
//! operator does not own: an ephemeral container added to a node pod (an in-place plugin
//! delivery, a strategic-merge patch of the pod's `ephemeralcontainers` subresource), and
//! every write is counted in
//! `gantry_operator_writes_total`, so "zero writes at steady state" is
//! observable in production as well as asserted in tests.

use std::fmt::Debug;

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use k8s_openapi::api::apps::v1::Deployment;

use crate::metrics::Metrics;
use gantry_crd::names::{AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER};

/// After the apiserver refused a write, or a spec was refused, try again this late (someone
/// may fix RBAC, quota or the spec).
pub const RETRY_REFUSED: std::time::Duration = std::time::Duration::from_secs(300);

/// How a failed API call should be retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Conflicts, throttling, server errors, network: back off and try again.
    Transient,
    /// The apiserver refused the request as written (400, 403, 404, 422): trying again
    /// without a change will not help.
    Permanent,
}

/// Classify a kube error.
pub fn classify(e: &kube::Error) -> Retry {
    match e {
        kube::Error::Api(status) => match status.code {
            400 | 403 | 404 | 405 | 413 | 415 | 422 => Retry::Permanent,
            _ => Retry::Transient,
        },
        kube::Error::SerdeError(_) | kube::Error::BuildRequest(_) => Retry::Permanent,
        _ => Retry::Transient,
    }
}

/// The HTTP status of an API error (0 otherwise), for messages.
pub fn api_code(e: &kube::Error) -> u16 {
    match e {
        kube::Error::Api(status) => status.code,
        _ => 0,
    }
}

/// Server-side apply of a whole object we own, taking ownership of conflicting fields (`force`):
/// only the operator manages these objects' fields.
pub async fn apply<K>(
    api: &Api<K>,
    obj: &K,
    metrics: &Metrics,
    controller: &str,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let out = api
        .patch(&obj.name_any(), &params, &Patch::Apply(obj))
        .await;
    metrics.wrote(controller, &K::kind(&()), "apply");
    out
}

/// Server-side apply of a Deployment's `spec.replicas` alone under
/// [`AUTOSCALER_FIELD_MANAGER`]: the autoscaler's scale write, and the hand-over that makes the
/// autoscaler an owner of the field before the operator's own apply stops setting it.
pub async fn apply_replicas(
    api: &Api<Deployment>,
    name: &str,
    replicas: i32,
    metrics: &Metrics,
    controller: &str,
) -> Result<Deployment, kube::Error> {
    let body = serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": replicas},
    });
    let params = PatchParams::apply(AUTOSCALER_FIELD_MANAGER).force();
    let out = api.patch(name, &params, &Patch::Apply(&body)).await;
    metrics.wrote(controller, "Deployment", "apply_replicas");
    out
}

/// Server-side apply of `status` only, through the status subresource. `status` must be the
/// complete status this manager owns: fields it leaves out are removed.
pub async fn apply_status<K, S>(
    api: &Api<K>,
    name: &str,
    status: &S,
    metrics: &Metrics,
    controller: &str,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
    S: Serialize + Debug,
{
    apply_status_as(api, name, status, FIELD_MANAGER, metrics, controller).await
}

/// [`apply_status`] under another field manager: the autoscaler applies only
/// `status.autoscaling`, which the operator's own status apply leaves out.
pub async fn apply_status_as<K, S>(
    api: &Api<K>,
    name: &str,
    status: &S,
    manager: &str,
    metrics: &Metrics,
    controller: &str,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
    S: Serialize + Debug,
{
    let body = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": {"name": name},
        "status": status,
    });
    let params = PatchParams::apply(manager).force();
    let out = api.patch_status(name, &params, &Patch::Apply(&body)).await;
    metrics.wrote(controller, &K::kind(&()), "apply_status");
    out
}

/// Add `container` to node pod `name`'s ephemeral containers (strategic merge by name: the
/// pod's other ephemeral containers stay as they are).
pub async fn add_ephemeral_container(
    api: &Api<k8s_openapi::api::core::v1::Pod>,
    name: &str,
    container: &k8s_openapi::api::core::v1::EphemeralContainer,
    metrics: &Metrics,
    controller: &str,
) -> Result<k8s_openapi::api::core::v1::Pod, kube::Error> {
    let body = serde_json::json!({"spec": {"ephemeralContainers": [container]}});
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PatchParams::default()
    };
    let out = api
        .patch_ephemeral_containers(name, &params, &Patch::Strategic(&body))
        .await;
    metrics.wrote(controller, "Pod", "add_ephemeral_container");
    out
}

/// Delete an object we own; already gone counts as done.
pub async fn delete<K>(
    api: &Api<K>,
    name: &str,
    metrics: &Metrics,
    controller: &str,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
{
    // Background propagation: the Deployment's ReplicaSets and pods follow through the
    // garbage collector, without a foreground wait.
    let params = DeleteParams::background();
    let out = api.delete(name, &params).await;
    metrics.wrote(controller, &K::kind(&()), "delete");
    match out {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}
