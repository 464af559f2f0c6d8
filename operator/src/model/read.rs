//! Model reconcile, read step: everything the later steps need from the cluster — the owned
//! objects as they are, the EnginePlugin cache, and the node pods' status reports.
//!
//! Reads are plain GETs in a fixed order (ConfigMap, Deployment, Service,
//! PodDisruptionBudget, HorizontalPodAutoscaler, cache claim, node-token Secret, NetworkPolicy,
//! then the node pods), so a reconcile's requests are predictable and the mock-API tests can
//! state them exactly. The Secret and the NetworkPolicy are read only when the operator runs
//! with an install token and with network policies, as they are built only then.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::context::Context;
use crate::node_report::{self, NodeReport};
use crate::write::{Retry, classify};
use gantry_crd::names::{
    cache_claim_name, label_selector, node_token_secret_name, owned_name, selector_labels,
};
use gantry_crd::{CacheType, EnginePlugin, Model};

/// What the cluster holds for one Model.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub config_map: Option<ConfigMap>,
    pub deployment: Option<Deployment>,
    pub service: Option<Service>,
    pub pdb: Option<PodDisruptionBudget>,
    pub hpa: Option<HorizontalPodAutoscaler>,
    pub pvc: Option<PersistentVolumeClaim>,
    /// The node-token Secret (read only with an install token).
    pub node_token_secret: Option<Secret>,
    /// The NetworkPolicy (read only with network policies on).
    pub network_policy: Option<NetworkPolicy>,
    /// Status reports of the Model's running node pods, sorted by pod name.
    pub reports: Vec<NodeReport>,
    /// Every EnginePlugin that deserialized, sorted by name.
    pub plugins: Vec<EnginePlugin>,
}

/// Why the read step failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {kind} {name}: {source}")]
    Get {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot list the node pods of Model {model}: {source}")]
    ListPods {
        model: String,
        #[source]
        source: kube::Error,
    },
}

impl ReadError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ReadError::Get { .. } => "read_get",
            ReadError::ListPods { .. } => "read_list_pods",
        }
    }

    pub fn retry(&self) -> Retry {
        match self {
            ReadError::Get { source, .. } | ReadError::ListPods { source, .. } => classify(source),
        }
    }
}

async fn get<K>(api: &Api<K>, kind: &'static str, name: &str) -> Result<Option<K>, ReadError>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name).await.map_err(|source| ReadError::Get {
        kind,
        name: name.to_string(),
        source,
    })
}

/// Read the owned objects, the plugins and the node reports of `model`.
pub async fn read(model: &Model, ctx: &Context) -> Result<Observed, ReadError> {
    let ns = model.namespace().unwrap_or_default();
    let name = model.name_any();
    let owned = owned_name(&name);
    let client = ctx.client.clone();
    let config_map = get(
        &Api::<ConfigMap>::namespaced(client.clone(), &ns),
        "ConfigMap",
        &owned,
    )
    .await?;
    let deployment = get(
        &Api::<Deployment>::namespaced(client.clone(), &ns),
        "Deployment",
        &owned,
    )
    .await?;
    let service = get(
        &Api::<Service>::namespaced(client.clone(), &ns),
        "Service",
        &owned,
    )
    .await?;
    let pdb = get(
        &Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns),
        "PodDisruptionBudget",
        &owned,
    )
    .await?;
    // Read in every mode: switching back from HPA to Builtin must find the HPA to delete it.
    let hpa = get(
        &Api::<HorizontalPodAutoscaler>::namespaced(client.clone(), &ns),
        "HorizontalPodAutoscaler",
        &owned,
    )
    .await?;
    // The claim only matters while the spec asks for one; a claim left from an earlier spec
    // stays (it holds downloaded weights) until the Model is deleted.
    let wants_claim = model
        .spec
        .cache
        .as_ref()
        .is_some_and(|c| c.type_ == CacheType::PersistentVolumeClaim);
    let pvc = if wants_claim {
        get(
            &Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns),
            "PersistentVolumeClaim",
            &cache_claim_name(&name),
        )
        .await?
    } else {
        None
    };
    let node_token_secret = if ctx.settings.node_token.is_some() {
        get(
            &Api::<Secret>::namespaced(client.clone(), &ns),
            "Secret",
            &node_token_secret_name(&name),
        )
        .await?
    } else {
        None
    };
    let network_policy = if ctx.settings.network_policy.is_some() {
        get(
            &Api::<NetworkPolicy>::namespaced(client.clone(), &ns),
            "NetworkPolicy",
            &owned,
        )
        .await?
    } else {
        None
    };
    // Without a Deployment there are no node pods to ask.
    let reports = if deployment.is_some() {
        let pods = Api::<Pod>::namespaced(client, &ns)
            .list(&ListParams::default().labels(&label_selector(&selector_labels(&name))))
            .await
            .map_err(|source| ReadError::ListPods {
                model: format!("{ns}/{name}"),
                source,
            })?;
        node_report::collect(ctx.node_status.as_ref(), &pods.items).await
    } else {
        Vec::new()
    };
    Ok(Observed {
        config_map,
        deployment,
        service,
        pdb,
        hpa,
        pvc,
        node_token_secret,
        network_policy,
        reports,
        plugins: ctx.engine_plugins(),
    })
}
