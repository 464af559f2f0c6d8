//! Model reconcile, read step: everything the later steps need from the cluster — the owned
//! objects as they are, the EnginePlugin cache, and the node pods' status reports — all from
//! the controller's caches (`watch_cache`, `report_cache`). It makes no API request: the watches
//! keep the caches current, and a reconcile that finds nothing to change costs nothing but
//! CPU. The only network call is the status of a node pod that has never been asked yet.
//! (The node-token Secret is not cached, as Secrets are never listed or watched; the apply
//! step reads its metadata by name in every reconcile that builds it.)

use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use crate::context::Context;
use crate::node_report::NodeReport;
use crate::watch_cache::{self, Meta};
use gantry_crd::names::{cache_claim_name, owned_name};
use gantry_crd::{CacheType, EnginePlugin, Model};

/// What the cluster holds for one Model. Owned objects other than the Deployment are known by
/// their (trimmed) metadata alone: that is all the apply step compares.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub config_map: Option<ObjectMeta>,
    pub deployment: Option<Deployment>,
    pub service: Option<ObjectMeta>,
    pub pdb: Option<ObjectMeta>,
    pub hpa: Option<ObjectMeta>,
    pub pvc: Option<ObjectMeta>,
    /// The NetworkPolicy (looked up only with network policies on).
    pub network_policy: Option<ObjectMeta>,
    /// Status reports of the Model's running node pods, sorted by pod name.
    pub reports: Vec<NodeReport>,
    /// Every EnginePlugin that deserialized, sorted by name.
    pub plugins: Vec<EnginePlugin>,
}

fn meta<K>(m: Option<Arc<Meta<K>>>) -> Option<ObjectMeta> {
    m.map(|m| m.metadata.clone())
}

/// Read the owned objects, the plugins and the node reports of `model` from the caches.
pub async fn read(model: &Model, ctx: &Context) -> Observed {
    // The claim only matters while the spec asks for one; a claim left from an earlier spec
    // stays (it holds downloaded weights) until the Model is deleted.
    let wants_claim = model
        .spec
        .cache
        .as_ref()
        .is_some_and(|c| c.type_ == CacheType::PersistentVolumeClaim);
    read_objects(
        &model.namespace().unwrap_or_default(),
        &model.name_any(),
        wants_claim,
        ctx,
    )
    .await
}

/// [`read`] for the objects named after `name` in `ns` (a Model's name, or a pool's object
/// name), looking up the cache claim only when `wants_claim`.
pub async fn read_objects(ns: &str, name: &str, wants_claim: bool, ctx: &Context) -> Observed {
    let (ns, name) = (ns.to_string(), name.to_string());
    let owned = owned_name(&name);
    let c = &ctx.caches;
    let deployment = watch_cache::get(&c.deployments, &ns, &owned).map(|d| (*d).clone());
    // Without a Deployment there are no node pods to ask.
    let reports = if deployment.is_some() {
        ctx.reports.of(&c.node_pods(&ns, &name)).await
    } else {
        Vec::new()
    };
    Observed {
        config_map: meta(watch_cache::get(&c.config_maps, &ns, &owned)),
        deployment,
        service: meta(watch_cache::get(&c.services, &ns, &owned)),
        pdb: meta(watch_cache::get(&c.pdbs, &ns, &owned)),
        // Looked up in every mode: switching back from HPA to Builtin must find it to delete it.
        hpa: meta(watch_cache::get(&c.hpas, &ns, &owned)),
        pvc: wants_claim
            .then(|| meta(watch_cache::get(&c.pvcs, &ns, &cache_claim_name(&name))))
            .flatten(),
        network_policy: ctx
            .settings
            .network_policy
            .is_some()
            .then(|| meta(watch_cache::get(&c.network_policies, &ns, &owned)))
            .flatten(),
        reports,
        plugins: ctx.engine_plugins(),
    }
}
