//! Controller caches (the read step of every reconcile, the autoscaler and the node report
//! poller read them; `controller::run` fills them): one reflector store per kind the operator
//! owns or reads, trimmed before anything reaches a store, and the triggers that turn a
//! relevant change of an owned object or a node pod into a reconcile of its Model.
//!
//! What is cached, and how lean:
//! - ConfigMaps, Services, PDBs, HPAs, cache claims, NetworkPolicies: metadata only (a watch of
//!   `PartialObjectMeta`), and of that only the name, namespace, owner references and Gantry's
//!   own annotations: the apply step needs nothing else (it compares the
//!   `gantry.dev/applied-hash` annotation and checks the controller reference).
//! - Node-token Secrets are not cached: the operator never lists or watches Secrets (a list
//!   permission would read every Secret's data). The read step gets the Model's one by name,
//!   and only when the reconcile may have to write it (see `model::read`).
//! - Deployments: spec and pod template dropped (only `spec.replicas` is read), status kept,
//!   managed fields reduced to the managers that own `spec.replicas` (the hand-over check).
//! - Node pods: read into [`NodePod`], which holds of the spec only the names and images of
//!   init and ephemeral containers (the plugin versions an in-place delivery compares) and of
//!   the status the phase, pod IP, the Ready condition and the ephemeral containers' states.
//!
//! Every watch is label-selected (`app.kubernetes.io/managed-by=gantry-operator`, node pods
//! also `app.kubernetes.io/name=gantry-node`), so objects of other controllers never reach a
//! store. A change triggers a reconcile only when a field the reconcile reads changed
//! (resourceVersion and managed fields are ignored): a status-only update of a ConfigMap's
//! owner, a node pod's probe timestamps or a Deployment's `status.conditions[].lastUpdateTime`
//! make no reconcile at all.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::channel::mpsc;
use futures::{SinkExt, Stream, StreamExt};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta};
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::reflector::store::Writer;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::Serialize;

use crate::model::applied::{OWNS_REPLICAS, applied_hash, owns_replicas};
use crate::node_pod::NodePod;
use gantry_crd::Model;
use gantry_crd::names::{API_GROUP, LABEL_MODEL, LABEL_NAME};

/// A reconcile request for one Model, as the Model controller takes it.
pub type ModelRef = ObjectRef<DeserializeGuard<Model>>;

/// Metadata-only cache entry of an owned kind.
pub type Meta<K> = PartialObjectMeta<K>;

/// The stores every reconcile reads. Cloning shares them.
#[derive(Clone)]
pub struct Caches {
    pub config_maps: Store<Meta<ConfigMap>>,
    pub services: Store<Meta<Service>>,
    pub pdbs: Store<Meta<PodDisruptionBudget>>,
    pub hpas: Store<Meta<HorizontalPodAutoscaler>>,
    pub pvcs: Store<Meta<PersistentVolumeClaim>>,
    pub network_policies: Store<Meta<NetworkPolicy>>,
    pub deployments: Store<Deployment>,
    pub pods: Store<NodePod>,
    /// Objects this operator wrote whose watch event has not arrived yet.
    pub recent: Arc<RecentWrites>,
}

/// The writing halves of [`Caches`]: the watches own them in production, tests fill them.
pub struct Writers {
    pub config_maps: Writer<Meta<ConfigMap>>,
    pub services: Writer<Meta<Service>>,
    pub pdbs: Writer<Meta<PodDisruptionBudget>>,
    pub hpas: Writer<Meta<HorizontalPodAutoscaler>>,
    pub pvcs: Writer<Meta<PersistentVolumeClaim>>,
    pub network_policies: Writer<Meta<NetworkPolicy>>,
    pub deployments: Writer<Deployment>,
    pub pods: Writer<NodePod>,
}

/// Empty caches and their writers.
pub fn caches() -> (Caches, Writers) {
    let (config_maps, config_maps_w) = reflector::store();
    let (services, services_w) = reflector::store();
    let (pdbs, pdbs_w) = reflector::store();
    let (hpas, hpas_w) = reflector::store();
    let (pvcs, pvcs_w) = reflector::store();
    let (network_policies, network_policies_w) = reflector::store();
    let (deployments, deployments_w) = reflector::store();
    let (pods, pods_w) = reflector::store();
    (
        Caches {
            config_maps,
            services,
            pdbs,
            hpas,
            pvcs,
            network_policies,
            deployments,
            pods,
            recent: Arc::new(RecentWrites::default()),
        },
        Writers {
            config_maps: config_maps_w,
            services: services_w,
            pdbs: pdbs_w,
            hpas: hpas_w,
            pvcs: pvcs_w,
            network_policies: network_policies_w,
            deployments: deployments_w,
            pods: pods_w,
        },
    )
}

/// Objects in `store` and their serialized JSON size.
pub fn footprint<K>(name: &'static str, store: &Store<K>) -> (&'static str, usize, usize)
where
    K: kube::Resource + Serialize + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let state = store.state();
    (
        name,
        state.len(),
        serialized_size(state.iter().map(AsRef::as_ref)),
    )
}

/// The serialized JSON size of `items`, together (the `gantry_operator_cache_bytes` measure).
pub fn serialized_size<'a, T: Serialize + 'a>(items: impl IntoIterator<Item = &'a T>) -> usize {
    items
        .into_iter()
        .map(|o| serde_json::to_vec(o).map_or(0, |v| v.len()))
        .sum()
}

/// How often a task waiting for a store to list checks again (see [`until_listed`]).
const LISTED_CHECK: Duration = Duration::from_millis(250);

/// Wait until `store` has listed once. kube's `Store::wait_until_ready` wakes only the task
/// that polled it last (a oneshot channel underneath keeps one waker), and a kube
/// `Controller` waits on its own store: any second task waiting on the same store (the
/// autoscaler on the Model store) would sleep for ever. So each wait is short and repeated,
/// which re-registers the waiter; it costs one check per [`LISTED_CHECK`] until the list ends.
pub async fn until_listed<K>(store: &Store<K>) -> Result<(), reflector::store::WriterDropped>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    loop {
        if let Ok(done) = tokio::time::timeout(LISTED_CHECK, store.wait_until_ready()).await {
            return done;
        }
    }
}

impl Caches {
    /// Wait until every store has listed once (a reconcile before that could take "not in the
    /// cache" for "not in the cluster" and re-create what exists). Several tasks wait on these
    /// (the controller, the autoscaler), hence [`until_listed`].
    pub async fn wait_until_ready(&self) -> Result<(), reflector::store::WriterDropped> {
        until_listed(&self.config_maps).await?;
        until_listed(&self.services).await?;
        until_listed(&self.pdbs).await?;
        until_listed(&self.hpas).await?;
        until_listed(&self.pvcs).await?;
        until_listed(&self.network_policies).await?;
        until_listed(&self.deployments).await?;
        until_listed(&self.pods).await
    }

    /// What each store holds: `(store, objects, serialized JSON bytes)` (the
    /// `gantry_operator_cache_*` gauges).
    pub fn footprint(&self) -> Vec<(&'static str, usize, usize)> {
        vec![
            footprint("configmaps", &self.config_maps),
            footprint("services", &self.services),
            footprint("poddisruptionbudgets", &self.pdbs),
            footprint("horizontalpodautoscalers", &self.hpas),
            footprint("persistentvolumeclaims", &self.pvcs),
            footprint("networkpolicies", &self.network_policies),
            footprint("deployments", &self.deployments),
            footprint("pods", &self.pods),
        ]
    }

    /// Cached objects of every kind (logged when the caches have listed).
    pub fn len(&self) -> usize {
        self.config_maps.state().len()
            + self.services.state().len()
            + self.pdbs.state().len()
            + self.hpas.state().len()
            + self.pvcs.state().len()
            + self.network_policies.state().len()
            + self.deployments.state().len()
            + self.pods.state().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The node pods of Model `ns/model`, sorted by name.
    pub fn node_pods(&self, ns: &str, model: &str) -> Vec<Arc<NodePod>> {
        let mut pods: Vec<Arc<NodePod>> = self
            .pods
            .state()
            .into_iter()
            .filter(|p| {
                p.metadata.namespace.as_deref() == Some(ns)
                    && p.labels().get(LABEL_MODEL).map(String::as_str) == Some(model)
            })
            .collect();
        pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        pods
    }
}

/// Look up `ns/name` in a store.
pub fn get<K>(store: &Store<K>, ns: &str, name: &str) -> Option<Arc<K>>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    store.get(&ObjectRef::new(name).within(ns))
}

/// How long a write waits for its watch event before the cache is trusted again.
const RECENT_WRITE_TTL: Duration = Duration::from_secs(30);

/// The applied hash of objects this operator wrote, until the watch brings them into the
/// cache (or 30 s pass). Without it, a reconcile that runs between a write and its watch
/// event would see the old object and write the same thing again. A delete event clears the
/// entry, so an object deleted right after a write is re-created.
#[derive(Debug, Default)]
pub struct RecentWrites(Mutex<HashMap<String, (String, Instant)>>);

impl RecentWrites {
    fn key(kind: &str, ns: &str, name: &str) -> String {
        format!("{kind}/{ns}/{name}")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The object was just applied with `hash`.
    pub fn wrote(&self, kind: &str, ns: &str, name: &str, hash: &str) {
        self.lock().insert(
            Self::key(kind, ns, name),
            (hash.to_string(), Instant::now()),
        );
    }

    /// Whether `hash` was applied to the object in the last 30 s and no delete was seen since.
    pub fn holds(&self, kind: &str, ns: &str, name: &str, hash: &str) -> bool {
        let mut map = self.lock();
        let key = Self::key(kind, ns, name);
        match map.get(&key) {
            Some((h, at)) if at.elapsed() < RECENT_WRITE_TTL => h == hash,
            Some(_) => {
                map.remove(&key);
                false
            }
            None => false,
        }
    }

    /// The watch delivered the object with `hash` (`None`: its deletion): once it carries
    /// what was written, or is gone, the cache is current again.
    pub fn seen(&self, kind: &str, ns: &str, name: &str, hash: Option<&str>) {
        let mut map = self.lock();
        let key = Self::key(kind, ns, name);
        if hash.is_none() || map.get(&key).is_some_and(|(h, _)| Some(h.as_str()) == hash) {
            map.remove(&key);
        }
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Keep only what the apply step reads: name, namespace, uid, owner references, deletion
/// time, Gantry's own annotations and the Model and app-name labels (node pods are found by
/// them).
pub fn trim_meta(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    meta.labels = meta.labels.take().and_then(|labels| {
        let kept: BTreeMap<String, String> = labels
            .into_iter()
            .filter(|(k, _)| k == LABEL_MODEL || k == LABEL_NAME)
            .collect();
        (!kept.is_empty()).then_some(kept)
    });
    let prefix = format!("{API_GROUP}/");
    meta.annotations = meta.annotations.take().and_then(|annotations| {
        let kept: BTreeMap<String, String> = annotations
            .into_iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .collect();
        (!kept.is_empty()).then_some(kept)
    });
    meta.generate_name = None;
    meta.creation_timestamp = None;
    meta.finalizers = None;
    if let Some(refs) = &mut meta.owner_references {
        refs.retain(|r| r.controller == Some(true));
    }
}

/// [`trim_meta`] for a metadata-only object.
pub fn trim_partial<K>(obj: &mut Meta<K>) {
    obj.types = None;
    trim_meta(&mut obj.metadata);
}

/// A Deployment as the reconcile and the autoscaler read it: metadata, `spec.replicas`,
/// status, and who owns `spec.replicas` (`model::applied::owns_replicas`; see
/// `model::apply::operator_alone_owns_replicas`).
pub fn trim_deployment(d: &mut Deployment) {
    let replica_owners: Vec<ManagedFieldsEntry> = d
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|e| owns_replicas(e))
        .map(|e| ManagedFieldsEntry {
            manager: e.manager.clone(),
            operation: Some(OWNS_REPLICAS.to_string()),
            ..ManagedFieldsEntry::default()
        })
        .collect();
    trim_meta(&mut d.metadata);
    d.metadata.managed_fields = (!replica_owners.is_empty()).then_some(replica_owners);
    d.spec = DeploymentSpec {
        replicas: d.spec.replicas,
        ..DeploymentSpec::default()
    };
    if let Some(status) = &mut d.status {
        for c in status.conditions.iter_mut().flatten() {
            c.last_update_time = None;
        }
    }
}

/// A node pod as the reconcile, the autoscaler and the report poller read it: of what
/// [`NodePod`] holds, the metadata trimmed and only the `Ready` condition.
pub fn trim_pod(p: &mut NodePod) {
    trim_meta(&mut p.metadata);
    p.metadata.owner_references = None;
    if let Some(cs) = p.status.as_mut().and_then(|s| s.conditions.as_mut()) {
        cs.retain(|c| c.type_ == "Ready");
    }
}

/// Drop what no reader of a Model needs from the Model store: managed fields and the
/// client-side-apply copy of the whole object.
pub fn trim_model(m: &mut DeserializeGuard<Model>) {
    m.meta_mut().managed_fields = None;
    if let Some(a) = &mut m.meta_mut().annotations {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

/// The Model that controls an owned object, from its controller reference.
pub fn owner_model<K: Resource>(obj: &K) -> Option<ModelRef> {
    let ns = obj.meta().namespace.as_deref()?;
    obj.meta()
        .owner_references
        .iter()
        .flatten()
        .find(|r| {
            r.controller == Some(true)
                && r.kind == "Model"
                && r.api_version.starts_with(&format!("{API_GROUP}/"))
        })
        .map(|r| ObjectRef::new(&r.name).within(ns))
}

/// The Model a node pod serves, from its `gantry.dev/model` label.
pub fn pod_model(pod: &NodePod) -> Option<ModelRef> {
    let ns = pod.metadata.namespace.as_deref()?;
    let model = pod.labels().get(LABEL_MODEL)?;
    Some(ObjectRef::new(model).within(ns))
}

/// Whether two cached versions differ in anything a reconcile reads (everything that
/// survived trimming, but the resource version).
fn differs<K: Resource + Serialize + Clone>(old: &K, new: &K) -> bool {
    let strip = |k: &K| {
        let mut k = k.clone();
        k.meta_mut().resource_version = None;
        k.meta_mut().managed_fields = None;
        serde_json::to_value(&k).ok()
    };
    strip(old) != strip(new)
}

/// What a cache driver needs to know about its kind.
pub struct Kind<K> {
    /// For [`RecentWrites`] keys: the kind name the apply step uses.
    pub name: &'static str,
    pub trim: fn(&mut K),
    /// The Model a change of this object concerns.
    pub owner: fn(&K) -> Option<ModelRef>,
}

/// Feed one watch into its store, trimming every object first, and send the owning Model of
/// every relevant change to `trigger`. The first list triggers nothing (the Model controller
/// reconciles every Model when it starts); a re-list after a broken watch triggers the Models
/// of objects that changed or vanished during the gap. Runs until the watch stream ends.
pub async fn drive<K, S>(
    events: S,
    mut writer: Writer<K>,
    kind: Kind<K>,
    recent: Arc<RecentWrites>,
    mut trigger: mpsc::Sender<ModelRef>,
) where
    K: Resource + Serialize + Clone + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let store = writer.as_reader();
    let mut listed_once = false;
    let mut seen: HashSet<ObjectRef<K>> = HashSet::new();
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event.modify(kind.trim),
            Err(e) => {
                tracing::warn!(kind = kind.name, error = %e, "watch");
                continue;
            }
        };
        let mut owners: Vec<ModelRef> = Vec::new();
        // The object this event delivers, with its applied hash (`None` for a delete).
        let mut delivered: Option<(&K, Option<&str>)> = None;
        match &event {
            watcher::Event::Init => seen.clear(),
            watcher::Event::InitApply(obj) | watcher::Event::Apply(obj) => {
                let key = ObjectRef::from_obj(obj);
                let old = store.get(&key);
                if matches!(event, watcher::Event::InitApply(_)) {
                    seen.insert(key);
                }
                let relevant = match &old {
                    Some(old) => differs(old.as_ref(), obj),
                    None => true,
                };
                if relevant && listed_once {
                    owners.extend((kind.owner)(obj));
                }
                delivered = Some((obj, applied_hash(obj.meta())));
            }
            watcher::Event::Delete(obj) => {
                owners.extend((kind.owner)(obj));
                delivered = Some((obj, None));
            }
            watcher::Event::InitDone => {
                if listed_once {
                    // Gone while the watch was broken.
                    for obj in store.state() {
                        if !seen.contains(&ObjectRef::from_obj(obj.as_ref())) {
                            owners.extend((kind.owner)(obj.as_ref()));
                        }
                    }
                }
                listed_once = true;
                seen.clear();
            }
        }
        if let Some((obj, hash)) = delivered {
            let ns = obj.meta().namespace.as_deref().unwrap_or_default();
            recent.seen(kind.name, ns, &obj.name_any(), hash);
        }
        writer.apply_watcher_event(&event);
        for owner in owners {
            // The controller gone means shutdown.
            if trigger.send(owner).await.is_err() {
                return;
            }
        }
    }
}
