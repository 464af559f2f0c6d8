//! Operator scale benchmark (outside the reconcile path; `cargo run --release -p
//! gantry-operator --example operator-scale -- --scenario warm`): the real `gantry-operator`
//! binary, in its own process, against an in-memory Kubernetes API served on loopback by this
//! process — list, watch (with resource versions, metadata-only when asked), server-side apply
//! as a deep merge, delete, events — holding 1,000 Models and, per scenario, their objects and
//! node pods with managed fields as an apiserver returns them. Node pods' `/v1/status` is
//! answered on port 8080 of their loopback pod IPs (127.x.y.z).
//!
//! Scenarios:
//! - `cold`: 1,000 new Models and nothing else; each created Deployment gets one Pending pod.
//! - `warm`: the operator restarts in a cluster where the 1,000 Models run (objects current,
//!   pods Running and Ready, no Model status yet).
//! - `pending`: like `warm`, but every node pod is Pending (a cluster waiting for GPUs).
//!
//! Reports (JSON, `--out`): requests by verb while converging and afterwards in a quiet window
//! (no watch event at all), the operator's RSS and peak RSS, its CPU seconds to converge, and
//! the wall time. Converged: every Model has a status with `observedGeneration` and the
//! operator has reconciled each at least once; bounded by `--timeout` seconds.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use gantry_api::{
    ArtifactState, ArtifactStatus, EngineVerdict, LoadState, LoadStatus, ModelStatus, NodeStatus,
    QueueStatus,
};
use gantry_crd::{EnginePlugin, Model};
use gantry_operator::context::Settings;
use gantry_operator::model::{build, resolve::resolve, validate::validate};
use serde_json::{Value, json};
use tokio::sync::broadcast;

/// Models in the cluster (`--models`, default 1,000).
fn models() -> usize {
    arg("--models").and_then(|n| n.parse().ok()).unwrap_or(1000)
}
const NAMESPACE: &str = "bench";

/// One resource collection: its objects and its event log (for watches that resume).
#[derive(Default)]
struct Collection {
    objects: BTreeMap<(String, String), Value>,
    log: Vec<(u64, &'static str, Value)>,
}

/// The in-memory cluster.
struct Cluster {
    rv: u64,
    collections: HashMap<String, Collection>,
    events: broadcast::Sender<(String, u64, &'static str, Value)>,
    /// Requests by `VERB kind`, list and watch included.
    requests: BTreeMap<String, u64>,
    /// Create a Pending node pod for every new Deployment (the `cold` scenario).
    pods_for_new_deployments: bool,
}

type Shared = Arc<Mutex<Cluster>>;

fn lock(c: &Shared) -> std::sync::MutexGuard<'_, Cluster> {
    c.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

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

fn key_of(obj: &Value) -> (String, String) {
    let m = &obj["metadata"];
    (
        m["namespace"].as_str().unwrap_or_default().to_string(),
        m["name"].as_str().unwrap_or_default().to_string(),
    )
}

/// Server-side apply, approximated: objects merge key by key, anything else is replaced.
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

impl Cluster {
    fn store(&mut self, collection: &str, mut obj: Value, kind: &'static str) -> Value {
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

    fn count(&mut self, what: String) {
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

async fn handle(
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
    lock(&cluster).count(format!("{verb} {plural}{sub}"));
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
            match c
                .collections
                .get(&t.collection)
                .and_then(|col| col.objects.get(&key))
            {
                Some(o) => json_response(
                    StatusCode::OK,
                    &if meta_only { partial(o) } else { o.clone() },
                ),
                None => not_found(),
            }
        }
        (Method::PATCH, Some(name)) => {
            let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let mut c = lock(&cluster);
            let key = (t.namespace.clone().unwrap_or_default(), name.clone());
            let existing = c
                .collections
                .get(&t.collection)
                .and_then(|col| col.objects.get(&key))
                .cloned();
            let created = existing.is_none();
            if t.status && created {
                return not_found();
            }
            let mut obj = existing.unwrap_or_else(|| {
                json!({"metadata": {"name": name, "namespace": t.namespace,
                    "uid": format!("uid-{}-{}", plural, name), "generation": 1,
                    "creationTimestamp": "2026-11-23T00:00:00Z"}})
            });
            if t.status {
                merge(&mut obj["status"], &patch["status"]);
            } else {
                merge(&mut obj, &patch);
            }
            let kind = if created { "ADDED" } else { "MODIFIED" };
            let out = c.store(&t.collection, obj, kind);
            if created && plural == "deployments" && c.pods_for_new_deployments {
                let pod = node_pod(&out, None);
                c.store("v1/pods", pod, "ADDED");
            }
            json_response(StatusCode::OK, &out)
        }
        (Method::POST, _) => {
            let obj: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            json_response(StatusCode::CREATED, &obj)
        }
        (Method::DELETE, Some(name)) => {
            let mut c = lock(&cluster);
            let key = (t.namespace.clone().unwrap_or_default(), name);
            let existing = c
                .collections
                .get(&t.collection)
                .and_then(|col| col.objects.get(&key))
                .cloned();
            match existing {
                Some(o) => {
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

/// Managed fields as an apiserver keeps them for an object applied by a client and updated
/// by a controller: the bulk of a real object's metadata.
fn managed_fields(manager: &str, spec_keys: &[&str]) -> Value {
    let spec: serde_json::Map<String, Value> = spec_keys
        .iter()
        .map(|k| (format!("f:{k}"), json!({".": {}, "f:value": {}})))
        .collect();
    json!([
        {"manager": manager, "operation": "Apply", "apiVersion": "v1", "time": "2026-11-23T00:00:00Z",
         "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {"f:app.kubernetes.io/name": {}}},
                                                "f:spec": spec}},
        {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
         "time": "2026-11-23T00:00:01Z", "fieldsType": "FieldsV1", "subresource": "status",
         "fieldsV1": {"f:status": {"f:conditions": {".": {}, "k:{\"type\":\"Ready\"}": {".": {},
            "f:lastProbeTime": {}, "f:lastTransitionTime": {}, "f:status": {}, "f:type": {}}},
            "f:observedGeneration": {}, "f:replicas": {}, "f:readyReplicas": {}}}}
    ])
}

fn model(i: usize, template: &Value) -> Value {
    let mut m = template.clone();
    let name = format!("m-{i:04}");
    m["metadata"] = json!({"name": name, "namespace": NAMESPACE, "uid": format!("uid-model-{i:04}"),
        "generation": 1, "creationTimestamp": "2026-11-23T00:00:00Z",
        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": template.to_string()},
        "managedFields": managed_fields("kubectl-client-side-apply",
            &["source", "format", "architecture", "engine", "servedName", "resources", "replicas", "engineConfig", "cache", "load"])});
    m["spec"]["servedName"] = json!(name);
    m
}

/// A node pod of `deployment`: Running and Ready at `ip`, or Pending without one.
fn node_pod(deployment: &Value, ip: Option<&str>) -> Value {
    let name = deployment["metadata"]["name"].as_str().unwrap_or_default();
    let template = &deployment["spec"]["template"];
    let status = match ip {
        Some(ip) => json!({"phase": "Running", "podIP": ip, "hostIP": "10.0.0.1",
            "startTime": "2026-11-23T00:00:00Z",
            "conditions": [{"type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-23T00:00:05Z"},
                           {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-11-23T00:00:05Z"},
                           {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-11-23T00:00:01Z"},
                           {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-23T00:00:00Z"}],
            "containerStatuses": [{"name": "node", "ready": true, "restartCount": 0, "image": "gantry-node", "imageID": "sha256:0", "started": true,
                                   "state": {"running": {"startedAt": "2026-11-23T00:00:02Z"}}}]}),
        None => {
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]})
        }
    };
    let mut labels = template["metadata"]["labels"].clone();
    labels["pod-template-hash"] = json!("7c9d5f");
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{name}-7c9d5f-abcde"), "namespace": NAMESPACE,
            "uid": format!("uid-pod-{name}"), "labels": labels,
            "annotations": template["metadata"]["annotations"],
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("{name}-7c9d5f"),
                                 "uid": format!("uid-rs-{name}"), "controller": true}],
            "managedFields": managed_fields("kube-controller-manager", &["containers", "volumes", "securityContext"])},
        "spec": template["spec"], "status": status})
}

fn pod_ip(i: usize) -> String {
    format!("127.{}.{}.{}", 1 + i / 62500, (i / 250) % 250, 1 + i % 250)
}

/// The node status document of model `served`, loaded and ready.
fn node_status(served: &str) -> NodeStatus {
    NodeStatus {
        version: "0.1.0".into(),
        backend: "cpu".into(),
        ready: true,
        draining: false,
        plugins: Vec::new(),
        models: vec![ModelStatus {
            id: served.into(),
            format: "gguf".into(),
            architecture: Some("gemma3".into()),
            verdict: Some(EngineVerdict::Supported {
                plugin: "llama_cpp".into(),
                version: "0.1.0".into(),
            }),
            artifact: ArtifactStatus {
                state: ArtifactState::Ready,
                bytes_done: 253_000_000,
                bytes_total: 253_000_000,
                bytes_per_second: 0.0,
                message: None,
            },
            load: LoadStatus {
                state: LoadState::Loaded,
                plugin: Some("llama_cpp".into()),
                ..Default::default()
            },
            queue: QueueStatus::default(),
            devices: Vec::new(),
            replicas: Vec::new(),
            crashes: None,
            engine_choice: None,
        }],
        ..NodeStatus::default()
    }
}

fn yaml<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc = text
        .split("\n---")
        .find(|d| d.contains("kind:"))
        .unwrap_or_default();
    serde_yaml::from_str(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Fill the cluster for `scenario`; returns pod IP → served model name.
fn populate(c: &mut Cluster, scenario: &str, repo: &std::path::Path) -> HashMap<String, String> {
    let plugin: Value = yaml(&repo.join("docs/examples/engineplugin-llama-cpp-cpu.yaml"));
    let mut plugin_obj = plugin.clone();
    plugin_obj["metadata"]["uid"] = json!("uid-plugin");
    plugin_obj["metadata"]["generation"] = json!(1);
    c.store("gantry.dev/v1alpha1/engineplugins", plugin_obj, "ADDED");
    let plugins: Vec<EnginePlugin> = vec![serde_json::from_value(plugin).expect("plugin")];
    let template: Value = yaml(&repo.join("docs/examples/model-gemma-3-270m.yaml"));
    let mut ips = HashMap::new();
    for i in 0..models() {
        let m = model(i, &template);
        c.store("gantry.dev/v1alpha1/models", m.clone(), "ADDED");
        if scenario == "cold" {
            continue;
        }
        let typed: Model = serde_json::from_value(m).expect("model");
        let v = validate(&typed, &Settings::default()).expect("valid");
        let r = resolve(&v, Some("gemma3"), &plugins, 1);
        let o = build::build(&v, &r.mounted(), &Settings::default()).expect("build");
        let mut cm = serde_json::to_value(&o.config_map).expect("json");
        cm["metadata"]["managedFields"] = managed_fields("gantry-operator", &["data"]);
        c.store("v1/configmaps", cm, "ADDED");
        let mut svc = serde_json::to_value(&o.service).expect("json");
        svc["metadata"]["managedFields"] =
            managed_fields("gantry-operator", &["ports", "selector", "type"]);
        svc["spec"]["clusterIP"] = json!("10.96.0.10");
        c.store("v1/services", svc, "ADDED");
        let mut d = serde_json::to_value(&o.deployment).expect("json");
        d["metadata"]["generation"] = json!(1);
        d["metadata"]["managedFields"] =
            managed_fields("gantry-operator", &["template", "selector", "strategy"]);
        d["spec"]["replicas"] = json!(1);
        let ready = if scenario == "warm" { 1 } else { 0 };
        d["status"] = json!({"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
            "readyReplicas": ready, "availableReplicas": ready,
            "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable",
                "lastUpdateTime": "2026-11-23T00:00:00Z", "lastTransitionTime": "2026-11-23T00:00:00Z"}]});
        let ip = (scenario == "warm").then(|| pod_ip(i));
        let pod = node_pod(&d, ip.as_deref());
        c.store("apps/v1/deployments", d, "ADDED");
        c.store("v1/pods", pod, "ADDED");
        if let Some(ip) = ip {
            ips.insert(ip, v.served_name.clone());
        }
    }
    ips
}

/// Every Model has a status for its generation.
fn converged(c: &Cluster) -> bool {
    c.collections
        .get("gantry.dev/v1alpha1/models")
        .is_some_and(|col| {
            col.objects.len() == models()
                && col
                    .objects
                    .values()
                    .all(|m| m["status"]["observedGeneration"] == json!(1))
        })
}

fn writes(requests: &BTreeMap<String, u64>) -> u64 {
    requests
        .iter()
        .filter(|(k, _)| !k.starts_with("LIST ") && !k.starts_with("WATCH "))
        .map(|(_, n)| *n)
        .sum()
}

fn diff(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, n)| (k.clone(), n - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// (RSS, peak RSS) in KiB and CPU seconds of a process, from /proc.
fn proc_stats(pid: u32) -> (u64, u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |field: &str| {
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15; after the command name they are 12 and 13 (0-based 11, 12).
    let ticks: f64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|t| t.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    (kib("VmRSS:"), kib("VmHWM:"), ticks / 100.0)
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() {
    let scenario = arg("--scenario").unwrap_or_else(|| "warm".into());
    assert!(
        ["cold", "warm", "pending"].contains(&scenario.as_str()),
        "--scenario cold|warm|pending"
    );
    let timeout = Duration::from_secs(arg("--timeout").and_then(|t| t.parse().ok()).unwrap_or(120));
    let quiet = Duration::from_secs(arg("--quiet").and_then(|t| t.parse().ok()).unwrap_or(30));
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let exe = std::env::current_exe().expect("exe");
    let operator = arg("--operator").map(PathBuf::from).unwrap_or_else(|| {
        exe.parent()
            .and_then(|p| p.parent())
            .map(|p| p.join("gantry-operator"))
            .expect("target dir")
    });

    let (events, _) = broadcast::channel(1 << 16);
    let mut cluster = Cluster {
        rv: 0,
        collections: HashMap::new(),
        events,
        requests: BTreeMap::new(),
        pods_for_new_deployments: scenario == "cold",
    };
    let ips = Arc::new(populate(&mut cluster, &scenario, &repo));
    let cluster: Shared = Arc::new(Mutex::new(cluster));

    // The API server.
    let api = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let api_addr: SocketAddr = api.local_addr().expect("addr");
    let c = cluster.clone();
    let app = axum::Router::new().fallback(
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            handle(c.clone(), method, uri, headers, body)
        },
    );
    tokio::spawn(async move { axum::serve(api, app).await });
    // The node pods' status endpoint, on every loopback pod IP.
    let statuses = ips.clone();
    // The client asked for `http://{pod_ip}:8080/v1/status`: the Host header names the pod.
    let nodes = axum::Router::new().route(
        "/v1/status",
        axum::routing::get(move |headers: HeaderMap| {
            let statuses = statuses.clone();
            async move {
                let host = headers
                    .get("host")
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or_default();
                let ip = host.split(':').next().unwrap_or_default();
                match statuses.get(ip) {
                    Some(served) => axum::Json(node_status(served)).into_response(),
                    None => StatusCode::NOT_FOUND.into_response(),
                }
            }
        }),
    );
    let node_listener = tokio::net::TcpListener::bind("0.0.0.0:8080")
        .await
        .expect("port 8080 (the node port) must be free for the node status endpoint");
    tokio::spawn(async move { axum::serve(node_listener, nodes).await });

    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: bench\n  cluster:\n    server: http://{api_addr}\nusers:\n- name: bench\n  user: {{}}\ncontexts:\n- name: bench\n  context:\n    cluster: bench\n    user: bench\n    namespace: default\ncurrent-context: bench\n"
        ),
    )
    .expect("kubeconfig");
    let started = Instant::now();
    let mut child = tokio::process::Command::new(&operator)
        .args([
            "run",
            "--components",
            "controller",
            "--no-leader-election",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .env_remove("GANTRY_NODE_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", operator.display()));
    let pid = child.id().expect("pid");

    let mut converged_at = None;
    while started.elapsed() < timeout {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if converged(&lock(&cluster)) {
            converged_at = Some(started.elapsed());
            break;
        }
    }
    // Let the tail of the last reconciles land before taking the converge figures.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (rss_converged, _, cpu_converged) = proc_stats(pid);
    let at_converge = lock(&cluster).requests.clone();
    let rv_at_converge = lock(&cluster).rv;
    tokio::time::sleep(quiet).await;
    let (rss, peak, cpu_end) = proc_stats(pid);
    let (after, rv_after) = {
        let c = lock(&cluster);
        (c.requests.clone(), c.rv)
    };
    let _ = child.kill().await;

    let quiet_requests = diff(&after, &at_converge);
    let report = json!({
        "benchmark": "operator-scale",
        "scenario": scenario,
        "models": models(),
        "converged": converged_at.is_some(),
        "converge_wall_seconds": converged_at.map(|d| d.as_secs_f64()),
        "operator_cpu_seconds_to_converge": cpu_converged,
        "operator_rss_mib_after_converge": rss_converged as f64 / 1024.0,
        "operator_rss_mib_end": rss as f64 / 1024.0,
        "operator_peak_rss_mib": peak as f64 / 1024.0,
        "requests_to_converge": at_converge,
        "requests_to_converge_excluding_list_watch": writes(&at_converge),
        "requests_per_model_to_converge": writes(&at_converge) as f64 / models() as f64,
        "quiet_window_seconds": quiet.as_secs(),
        "watch_events_in_quiet_window": rv_after - rv_at_converge,
        "requests_in_quiet_window": quiet_requests,
        "operator_cpu_seconds_in_quiet_window": cpu_end - cpu_converged,
    });
    let text = serde_json::to_string_pretty(&report).expect("json");
    println!("{text}");
    if let Some(out) = arg("--out") {
        std::fs::write(&out, text + "\n").unwrap_or_else(|e| panic!("{out}: {e}"));
    }
}
