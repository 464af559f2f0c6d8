//! Operator scale benchmark (outside the reconcile path), the in-memory API server: list (in
//! pages), watch (from a resource version, label-selected, metadata-only when asked), get,
//! server-side apply, merge patches, create, delete — with what a real apiserver adds to what
//! it stores: resource versions, uids, `generation` bumped on spec changes, and `managedFields`
//! entries per field manager (`fields`). Events are stored and listed like
//! any object. A non-status write of a Deployment runs the Deployment controller stand-in
//! (`cluster::sync_deployment`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::cluster;
use crate::fields::set_managed;
use crate::nodes::NodeEndpoint;

/// One resource collection: its objects and its event log (for watches that resume).
#[derive(Default)]
pub struct Collection {
    pub objects: BTreeMap<(String, String), Value>,
    log: Vec<(u64, &'static str, Value)>,
}

/// The in-memory cluster.
pub struct Cluster {
    rv: u64,
    uids: u64,
    pub collections: HashMap<String, Collection>,
    events: broadcast::Sender<(String, u64, &'static str, Value)>,
    /// Requests by `VERB kind`, list and watch included.
    pub requests: BTreeMap<String, u64>,
    /// The node pods' status endpoint's own state, apart from the cluster's lock (which a
    /// long list holds): pod IP → the served name its `/v1/status` reports (pods the kubelet
    /// stand-in started), and the requests it had.
    pub nodes: Arc<NodeEndpoint>,
}

pub type Shared = Arc<Mutex<Cluster>>;

pub fn lock(c: &Shared) -> std::sync::MutexGuard<'_, Cluster> {
    c.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A fixed wall-clock time for every timestamp the server writes (the figures do not depend
/// on it, and a fixed one keeps objects the same size run to run).
pub const NOW: &str = "2026-11-23T00:00:00Z";

/// Collection key and resource path parts of a request path.
struct Target {
    collection: String,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

fn parse(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (gv, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => (v.to_string(), rest),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        rest => (None, rest),
    };
    let (plural, name, status) = match rest {
        [plural] => (*plural, None, false),
        [plural, name] => (*plural, Some(name.to_string()), false),
        [plural, name, "status"] => (*plural, Some(name.to_string()), true),
        _ => return None,
    };
    Some(Target {
        collection: format!("{gv}/{plural}"),
        namespace,
        name,
        status,
    })
}

pub fn key_of(obj: &Value) -> (String, String) {
    let m = &obj["metadata"];
    (
        m["namespace"].as_str().unwrap_or_default().to_string(),
        m["name"].as_str().unwrap_or_default().to_string(),
    )
}

/// Server-side apply and merge patches, approximated: objects merge key by key, anything else
/// (lists included) is replaced.
fn merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b.clone(),
    }
}

fn labels_match(obj: &Value, selector: &str) -> bool {
    selector.split(',').filter(|s| !s.is_empty()).all(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        obj["metadata"]["labels"][k].as_str() == Some(v)
    })
}

/// What a metadata-only request returns for an object.
fn partial(obj: &Value) -> Value {
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
           "metadata": obj["metadata"]})
}

/// The spec of an object, for the `generation` rule (a change anywhere but metadata and
/// status is a new generation).
fn spec_part(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

impl Cluster {
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(1 << 16);
        Cluster {
            rv: 0,
            uids: 0,
            collections: HashMap::new(),
            events,
            requests: BTreeMap::new(),
            nodes: Arc::default(),
        }
    }

    pub fn rv(&self) -> u64 {
        self.rv
    }

    pub fn get(&self, collection: &str, key: &(String, String)) -> Option<&Value> {
        self.collections.get(collection)?.objects.get(key)
    }

    /// Objects of a collection in a namespace whose labels include all of `labels`.
    pub fn select(&self, collection: &str, ns: &str, labels: &Value) -> Vec<Value> {
        let Some(col) = self.collections.get(collection) else {
            return Vec::new();
        };
        col.objects
            .values()
            .filter(|o| key_of(o).0 == ns)
            .filter(|o| {
                labels.as_object().is_some_and(|want| {
                    want.iter()
                        .all(|(k, v)| o["metadata"]["labels"][k.as_str()] == *v)
                })
            })
            .cloned()
            .collect()
    }

    /// Store a new version of an object (or its deletion) and tell the watches.
    pub fn store(&mut self, collection: &str, mut obj: Value, kind: &'static str) -> Value {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let c = self.collections.entry(collection.to_string()).or_default();
        let key = key_of(&obj);
        if kind == "DELETED" {
            c.objects.remove(&key);
        } else {
            c.objects.insert(key, obj.clone());
        }
        c.log.push((self.rv, kind, obj.clone()));
        let _ = self
            .events
            .send((collection.to_string(), self.rv, kind, obj.clone()));
        obj
    }

    /// Create or update an object, stamping what the apiserver adds to a new one.
    pub fn upsert(&mut self, collection: &str, mut obj: Value) -> Value {
        let key = key_of(&obj);
        let existing = self.get(collection, &key).cloned();
        let kind = match &existing {
            Some(old) => {
                let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
                let changed = spec_part(old) != spec_part(&obj);
                obj["metadata"]["generation"] = json!(generation + i64::from(changed));
                "MODIFIED"
            }
            None => {
                self.uids += 1;
                let m = &mut obj["metadata"];
                if m["uid"].is_null() {
                    m["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", self.uids));
                }
                m["generation"] = json!(1);
                m["creationTimestamp"] = json!(NOW);
                "ADDED"
            }
        };
        self.store(collection, obj, kind)
    }

    /// Server-side apply (`status`: to the status subresource) of `patch` by `manager`.
    pub fn apply(
        &mut self,
        collection: &str,
        key: &(String, String),
        patch: &Value,
        manager: &str,
        status: bool,
    ) -> Option<Value> {
        let existing = self.get(collection, key).cloned();
        if status && existing.is_none() {
            return None;
        }
        let mut obj = existing.unwrap_or_else(|| {
            json!({"apiVersion": patch["apiVersion"], "kind": patch["kind"],
                   "metadata": {"name": key.1, "namespace": key.0}})
        });
        if status {
            merge(&mut obj["status"], &patch["status"]);
            set_managed(
                &mut obj,
                manager,
                "Apply",
                Some("status"),
                &json!({"status": patch["status"]}),
            );
        } else {
            merge(&mut obj, patch);
            set_managed(&mut obj, manager, "Apply", None, patch);
        }
        if key.0.is_empty() {
            obj["metadata"]
                .as_object_mut()
                .map(|m| m.remove("namespace"));
        }
        Some(self.upsert(collection, obj))
    }

    pub fn count(&mut self, what: String) {
        *self.requests.entry(what).or_default() += 1;
    }
}

fn json_response(code: StatusCode, v: &Value) -> Response {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(v.to_string()))
        .unwrap_or_default()
}

fn not_found() -> Response {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "NotFound", "code": 404}),
    )
}

/// One API request.
pub async fn handle(
    cluster: Shared,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(t) = parse(uri.path()) else {
        return not_found();
    };
    let query: HashMap<String, String> =
        reqwest::Url::parse(&format!("http://x/?{}", uri.query().unwrap_or_default()))
            .map(|u| u.query_pairs().into_owned().collect())
            .unwrap_or_default();
    let meta_only = headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("PartialObjectMetadata"));
    let plural = t
        .collection
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string();
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let verb = match (&method, t.name.is_some(), watch) {
        (&Method::GET, false, true) => "WATCH",
        (&Method::GET, false, false) => "LIST",
        (m, _, _) => m.as_str(),
    };
    let sub = if t.status { "/status" } else { "" };
    // Writes are counted by field manager too: the operator's reconciler and its autoscaler
    // write the same objects.
    let by = match query.get("fieldManager") {
        Some(m) if verb == "PATCH" && m != "gantry-operator" => format!(" ({m})"),
        _ => String::new(),
    };
    lock(&cluster).count(format!("{verb} {plural}{sub}{by}"));
    let selector = query.get("labelSelector").cloned().unwrap_or_default();
    match (method, t.name.clone()) {
        (Method::GET, None) if watch => {
            let since: u64 = query
                .get("resourceVersion")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let (backlog, rx) = {
                let c = lock(&cluster);
                let backlog: Vec<(&'static str, Value)> = c
                    .collections
                    .get(&t.collection)
                    .map(|col| {
                        col.log
                            .iter()
                            .filter(|(rv, _, _)| *rv > since)
                            .map(|(_, k, o)| (*k, o.clone()))
                            .collect()
                    })
                    .unwrap_or_default();
                (backlog, c.events.subscribe())
            };
            let collection = t.collection.clone();
            let live =
                futures::stream::unfold((rx, collection), |(mut rx, collection)| async move {
                    loop {
                        match rx.recv().await {
                            Ok((c, _, kind, obj)) if c == collection => {
                                return Some(((kind, obj), (rx, collection)));
                            }
                            Ok(_) => continue,
                            // Fell behind: end the watch, as an apiserver does, and the client
                            // lists again.
                            Err(_) => return None,
                        }
                    }
                });
            let stream = futures::stream::iter(backlog).chain(live);
            let body = stream.filter_map(move |(kind, obj)| {
                let selector = selector.clone();
                async move {
                    if !labels_match(&obj, &selector) {
                        return None;
                    }
                    let obj = if meta_only { partial(&obj) } else { obj };
                    let line = format!("{}\n", json!({"type": kind, "object": obj}));
                    Some(Ok::<Bytes, std::convert::Infallible>(Bytes::from(line)))
                }
            });
            Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(body))
                .unwrap_or_default()
        }
        (Method::GET, None) => {
            let c = lock(&cluster);
            let items: Vec<Value> = c
                .collections
                .get(&t.collection)
                .map(|col| {
                    col.objects
                        .values()
                        .filter(|o| {
                            t.namespace.is_none()
                                || key_of(o).0 == *t.namespace.as_deref().unwrap_or_default()
                        })
                        .filter(|o| labels_match(o, &selector))
                        .map(|o| if meta_only { partial(o) } else { o.clone() })
                        .collect()
                })
                .unwrap_or_default();
            // Pages of `limit` items, the `continue` token being the next offset.
            let from: usize = query
                .get("continue")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let limit: usize = query
                .get("limit")
                .and_then(|v| v.parse().ok())
                .filter(|l| *l > 0)
                .unwrap_or(usize::MAX);
            let total = items.len();
            let page: Vec<Value> = items.into_iter().skip(from).take(limit).collect();
            let next = from.saturating_add(limit);
            let mut metadata = json!({"resourceVersion": c.rv.to_string()});
            if next < total {
                metadata["continue"] = json!(next.to_string());
            }
            let kind = if meta_only {
                "PartialObjectMetadataList"
            } else {
                "List"
            };
            json_response(
                StatusCode::OK,
                &json!({"apiVersion": "v1", "kind": kind, "metadata": metadata, "items": page}),
            )
        }
        (Method::GET, Some(name)) => {
            let c = lock(&cluster);
            let key = (t.namespace.clone().unwrap_or_default(), name);
            match c.get(&t.collection, &key) {
                Some(o) => json_response(
                    StatusCode::OK,
                    &if meta_only { partial(o) } else { o.clone() },
                ),
                None => not_found(),
            }
        }
        (Method::PATCH, Some(name)) => {
            let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let is_apply = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("apply-patch"));
            let manager = query
                .get("fieldManager")
                .cloned()
                .unwrap_or_else(|| "unknown".into());
            let mut c = lock(&cluster);
            let key = (t.namespace.clone().unwrap_or_default(), name);
            let stored = if is_apply {
                c.apply(&t.collection, &key, &patch, &manager, t.status)
            } else {
                // A merge patch (kube's event series updates): only of an existing object.
                c.get(&t.collection, &key).cloned().map(|mut obj| {
                    merge(&mut obj, &patch);
                    set_managed(&mut obj, &manager, "Update", None, &patch);
                    c.upsert(&t.collection, obj)
                })
            };
            let Some(out) = stored else {
                return not_found();
            };
            if plural == "deployments" && !t.status {
                cluster::sync_deployment(&mut c, &key);
            }
            json_response(StatusCode::OK, &out)
        }
        (Method::POST, _) => {
            let mut obj: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let mut c = lock(&cluster);
            if obj["metadata"]["namespace"].is_null() {
                obj["metadata"]["namespace"] = json!(t.namespace);
            }
            if c.get(&t.collection, &key_of(&obj)).is_some() {
                return json_response(
                    StatusCode::CONFLICT,
                    &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "AlreadyExists", "code": 409}),
                );
            }
            let manager = query
                .get("fieldManager")
                .cloned()
                .unwrap_or_else(|| "gantry-operator".into());
            let config = obj.clone();
            set_managed(&mut obj, &manager, "Update", None, &config);
            let out = c.upsert(&t.collection, obj);
            json_response(StatusCode::CREATED, &out)
        }
        (Method::DELETE, Some(name)) => {
            let mut c = lock(&cluster);
            let key = (t.namespace.clone().unwrap_or_default(), name);
            match c.get(&t.collection, &key).cloned() {
                Some(o) => {
                    if plural == "deployments" {
                        cluster::collect_deployment(&mut c, &o);
                    }
                    c.store(&t.collection, o, "DELETED");
                    json_response(
                        StatusCode::OK,
                        &json!({"kind": "Status", "status": "Success"}),
                    )
                }
                None => not_found(),
            }
        }
        _ => not_found(),
    }
}
