//! Controller caches (the read step of every reconcile, the autoscaler and the node report
//! poller): a node pod as the pod store keeps it, read straight from the API server's JSON.
//!
//! `k8s_openapi`'s `Pod` is 2.4 KB before it holds anything (every field of the pod spec and
//! status is inline), and each init container it keeps is another 2.3 KB: 6 MB of a 1,000-pod
//! store for a few strings each. [`NodePod`] has the fields the operator reads, under the same
//! names and paths (so `pod.status.as_ref()?.pod_ip` reads as it does on a `Pod`), and nothing
//! else: the watch deserializes into it, so the rest of a pod never reaches memory. Writes to
//! pods (an ephemeral container of an in-place delivery) still use `Pod`.

use std::borrow::Cow;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::ContainerState;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// A node pod: metadata, and of its spec and status what readiness, reports and in-place
/// plugin deliveries read.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct NodePod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<NodePodSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<NodePodStatus>,
}

/// Of the pod spec, the containers that carry plugin images: the init containers (the copy a
/// pod started with) and the ephemeral containers (in-place deliveries since).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePodSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_containers: Option<Vec<ContainerImage>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral_containers: Option<Vec<ContainerImage>>,
}

/// A container's name and image.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct ContainerImage {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// Of the pod status: phase, IP, conditions (only `Ready` is kept) and the ephemeral
/// containers' states.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePodStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(rename = "podIP", default, skip_serializing_if = "Option::is_none")]
    pub pod_ip: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<PodReadiness>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral_container_statuses: Option<Vec<ContainerRun>>,
}

/// A pod condition's type and status.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct PodReadiness {
    #[serde(rename = "type", default)]
    pub type_: String,
    #[serde(default)]
    pub status: String,
}

/// A container's name, image and state.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct ContainerRun {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ContainerState>,
}

/// The pods' API (`v1`, `pods`, namespaced): a watch of `NodePod` is a watch of pods.
impl kube::Resource for NodePod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}
