//! Test support (outside the reconcile path): YAML fixtures, a test Context, and the mock
//! API server that checks a reconcile's exact requests (kube-rs controller-rs `fixtures.rs`)
//! and holds what the cluster's watches have delivered into the controller's caches.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gantry_api::NodeStatus;
use gantry_crd::{EnginePlugin, Model, ModelPool};
use gantry_operator::context::{Context, Settings};
use gantry_operator::metrics::Metrics;
use gantry_operator::node_report::FixedNodeStatus;
use gantry_operator::rbac::{self, Component, Names, Scope};
use gantry_operator::report_cache::Reports;
use gantry_operator::watch_cache::{self, Writers};
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::store::Writer;
use kube::runtime::{reflector, watcher};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// The operator's own namespace in these tests (leader Lease, API-key Secret).
pub const OPERATOR_NAMESPACE: &str = "gantry-system";

/// `operator/`.
pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The repository root.
pub fn repo_dir() -> PathBuf {
    crate_dir().join("..")
}

/// Every YAML document in a file, deserialized.
pub fn yaml_docs<T: DeserializeOwned>(path: &std::path::Path) -> Vec<T> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let value = serde_yaml::Value::deserialize(doc).expect("yaml");
            serde_yaml::from_value(value)
                .unwrap_or_else(|e| panic!("{} does not deserialize: {e}", path.display()))
        })
        .collect()
}

use serde::Deserialize;

pub fn fixture_model(name: &str) -> Model {
    let path = crate_dir().join(format!("tests/fixtures/models/{name}.yaml"));
    yaml_docs::<Model>(&path).remove(0)
}

pub fn fixture_plugins() -> Vec<EnginePlugin> {
    yaml_docs(&crate_dir().join("tests/fixtures/plugins.yaml"))
}

/// A fixed clock: every `lastTransitionTime` a test sees is this instant.
pub fn t0() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("timestamp")
}

/// A Context whose client talks to the returned mock server.
pub fn context(
    plugins: Vec<EnginePlugin>,
    nodes: BTreeMap<String, NodeStatus>,
) -> (Arc<Context>, ApiServer) {
    context_with(Settings::default(), plugins, nodes)
}

/// [`context`] with operator `settings` (install token, network policies).
pub fn context_with(
    settings: Settings,
    plugins: Vec<EnginePlugin>,
    nodes: BTreeMap<String, NodeStatus>,
) -> (Arc<Context>, ApiServer) {
    context_full(settings, plugins, nodes, Vec::new(), Vec::new())
}

/// [`context_with`] whose Model and ModelPool stores hold `models` and `pools`, as the
/// controllers' reflectors would.
pub fn context_full(
    settings: Settings,
    plugins: Vec<EnginePlugin>,
    nodes: BTreeMap<String, NodeStatus>,
    models: Vec<Model>,
    pools: Vec<ModelPool>,
) -> (Arc<Context>, ApiServer) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (store, mut writer) = reflector::store::<DeserializeGuard<EnginePlugin>>();
    for p in plugins {
        writer.apply_watcher_event(&watcher::Event::Apply(DeserializeGuard(Ok(p))));
    }
    let (model_store, mut model_writer) = reflector::store::<DeserializeGuard<Model>>();
    for m in models {
        model_writer.apply_watcher_event(&watcher::Event::Apply(DeserializeGuard(Ok(m))));
    }
    let (pool_store, mut pool_writer) = reflector::store::<DeserializeGuard<ModelPool>>();
    for p in pools {
        pool_writer.apply_watcher_event(&watcher::Event::Apply(DeserializeGuard(Ok(p))));
    }
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let (caches, writers) = watch_cache::caches();
    let ctx = Context::new(
        client,
        settings,
        store,
        caches,
        Arc::new(Reports::new(Arc::new(FixedNodeStatus(nodes)))),
        metrics,
    )
    .with_clock(Arc::new(t0))
    .with_stores(model_store, pool_store);
    let mut server = ApiServer::new(handle);
    server.writers = Some(writers);
    (Arc::new(ctx), server)
}

/// Deliver `obj` as a watch would: deserialize it as its kind, trim it, and put it in the
/// cache the controller reads that kind from.
fn deliver<K>(writer: &mut Writer<K>, obj: Value, trim: fn(&mut K))
where
    K: kube::Resource + Clone + DeserializeOwned + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let mut k: K = serde_json::from_value(obj).expect("object of its kind");
    trim(&mut k);
    writer.apply_watcher_event(&watcher::Event::Apply(k));
}

/// One expected request and the answer to give.
#[derive(Clone, Debug)]
pub struct Step {
    pub method: Method,
    pub path: String,
    pub status: StatusCode,
    pub reply: Reply,
    /// The field manager a PATCH must name.
    pub manager: &'static str,
}

/// What the mock answers.
#[derive(Clone, Debug)]
pub enum Reply {
    /// The request body, as an apply or create echoes the object back.
    Echo,
    /// A fixed document.
    Json(Value),
    /// This object with the request body's fields laid over it: what a status patch returns.
    EchoOnto(Value),
}

impl Step {
    /// The same step, expecting a PATCH under `manager`.
    pub fn by(mut self, manager: &'static str) -> Step {
        self.manager = manager;
        self
    }

    pub fn get(path: impl Into<String>, reply: Option<Value>) -> Step {
        match reply {
            Some(v) => Step {
                manager: "gantry-operator",
                method: Method::GET,
                path: path.into(),
                status: StatusCode::OK,
                reply: Reply::Json(v),
            },
            None => Step::not_found(Method::GET, path),
        }
    }

    pub fn not_found(method: Method, path: impl Into<String>) -> Step {
        let path = path.into();
        Step {
            manager: "gantry-operator",
            method,
            reply: Reply::Json(status_body(404, "NotFound", &format!("{path} not found"))),
            path,
            status: StatusCode::NOT_FOUND,
        }
    }

    /// A server-side apply (PATCH) answered with the applied object.
    pub fn apply(path: impl Into<String>) -> Step {
        Step {
            manager: "gantry-operator",
            method: Method::PATCH,
            path: path.into(),
            status: StatusCode::OK,
            reply: Reply::Echo,
        }
    }

    /// A status apply, answered with `object` carrying the applied status.
    pub fn apply_status(path: impl Into<String>, object: Value) -> Step {
        Step {
            manager: "gantry-operator",
            method: Method::PATCH,
            path: path.into(),
            status: StatusCode::OK,
            reply: Reply::EchoOnto(object),
        }
    }

    pub fn create(path: impl Into<String>) -> Step {
        Step {
            manager: "gantry-operator",
            method: Method::POST,
            path: path.into(),
            status: StatusCode::CREATED,
            reply: Reply::Echo,
        }
    }

    pub fn replace(path: impl Into<String>) -> Step {
        Step {
            manager: "gantry-operator",
            method: Method::PUT,
            path: path.into(),
            status: StatusCode::OK,
            reply: Reply::Echo,
        }
    }

    pub fn delete(path: impl Into<String>) -> Step {
        let reply =
            json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}});
        Step {
            manager: "gantry-operator",
            method: Method::DELETE,
            path: path.into(),
            status: StatusCode::OK,
            reply: Reply::Json(reply),
        }
    }

    pub fn fail(method: Method, path: impl Into<String>, code: u16) -> Step {
        let reason = match code {
            409 => "Conflict",
            422 => "Invalid",
            _ => "InternalError",
        };
        Step {
            manager: "gantry-operator",
            method,
            path: path.into(),
            status: StatusCode::from_u16(code).expect("status code"),
            reply: Reply::Json(status_body(code, reason, "injected by the test")),
        }
    }

    pub fn event(ns: &str) -> Step {
        Step::create(format!("/apis/events.k8s.io/v1/namespaces/{ns}/events"))
    }

    pub fn list(path: impl Into<String>, items: Vec<Value>) -> Step {
        Step {
            manager: "gantry-operator",
            method: Method::GET,
            path: path.into(),
            status: StatusCode::OK,
            reply: Reply::Json(
                json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items}),
            ),
        }
    }
}

pub fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// A request the reconcile made.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: Method,
    pub path: String,
    pub query: String,
    /// The request's `Content-Type` (which kind of PATCH it is).
    pub content_type: String,
    pub body: Option<Value>,
}

/// The API server side of the mock: answers steps in order and records the requests.
pub struct ApiServer {
    handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
    /// Whose permissions the requests are checked against.
    component: Component,
    /// The controller's caches, as the watches fill them.
    writers: Option<Writers>,
}

impl ApiServer {
    /// A mock API server for requests made by the controller.
    pub fn new(handle: tower_test::mock::Handle<Request<Body>, Response<Body>>) -> Self {
        ApiServer {
            handle,
            component: Component::Controller,
            writers: None,
        }
    }

    /// Objects the cluster holds, as its watches deliver them into the controller's caches
    /// (by `kind`; a Secret is never cached, so it is not accepted here).
    pub fn seed(&mut self, objects: impl IntoIterator<Item = Value>) {
        let w = self
            .writers
            .as_mut()
            .expect("a server made by context() has caches");
        for obj in objects {
            match obj["kind"].as_str().expect("object with a kind") {
                "ConfigMap" => deliver(&mut w.config_maps, obj, watch_cache::trim_partial),
                "Service" => deliver(&mut w.services, obj, watch_cache::trim_partial),
                "PodDisruptionBudget" => deliver(&mut w.pdbs, obj, watch_cache::trim_partial),
                "HorizontalPodAutoscaler" => deliver(&mut w.hpas, obj, watch_cache::trim_partial),
                "PersistentVolumeClaim" => deliver(&mut w.pvcs, obj, watch_cache::trim_partial),
                "NetworkPolicy" => deliver(&mut w.network_policies, obj, watch_cache::trim_partial),
                "Deployment" => deliver(&mut w.deployments, obj, watch_cache::trim_deployment),
                "Pod" => deliver(&mut w.pods, obj, watch_cache::trim_pod),
                other => panic!("the controller does not cache {other}"),
            }
        }
    }

    /// Serve `steps` in order. Panics on a request that differs from the next step, and on
    /// any request after the last step: the reconcile must make exactly these calls.
    pub fn run(mut self, steps: Vec<Step>) -> tokio::task::JoinHandle<Vec<Recorded>> {
        tokio::spawn(async move {
            let mut recorded = Vec::new();
            for (i, step) in steps.into_iter().enumerate() {
                let (request, send) =
                    tokio::time::timeout(Duration::from_secs(5), self.handle.next_request())
                        .await
                        .unwrap_or_else(|_| {
                            panic!(
                                "step {i}: no request arrived; expected {} {}",
                                step.method, step.path
                            )
                        })
                        .unwrap_or_else(|| {
                            panic!(
                                "step {i}: client gone; expected {} {}",
                                step.method, step.path
                            )
                        });
                let method = request.method().clone();
                let path = request.uri().path().to_string();
                let query = request.uri().query().unwrap_or_default().to_string();
                let content_type = request
                    .headers()
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                let is_apply = content_type == "application/apply-patch+yaml";
                // Every request the code makes must be granted by the RBAC table (and so by
                // the chart, which a chart test holds equal to the table).
                assert_granted(self.component, &method, &path, &query, is_apply);
                let bytes = request
                    .into_body()
                    .collect_bytes()
                    .await
                    .expect("request body");
                let body: Option<Value> = if bytes.is_empty() {
                    None
                } else {
                    Some(serde_json::from_slice(&bytes).expect("request body is JSON"))
                };
                assert_eq!(
                    (&method, &path),
                    (&step.method, &step.path),
                    "step {i}: unexpected request {method} {path}?{query}"
                );
                if method == Method::PATCH {
                    assert!(
                        query
                            .split('&')
                            .any(|kv| kv == format!("fieldManager={}", step.manager)),
                        "step {i}: {path}?{query} is not under field manager {}",
                        step.manager
                    );
                    // A server-side apply takes over conflicting fields; any other patch (an
                    // ephemeral container added to a pod) has no such option.
                    assert_eq!(
                        query.contains("force=true"),
                        is_apply,
                        "step {i}: {path}?{query} ({content_type}): only an apply is forced"
                    );
                }
                let reply = match &step.reply {
                    Reply::Json(v) => v.clone(),
                    Reply::Echo => body.clone().unwrap_or(json!({})),
                    Reply::EchoOnto(base) => {
                        let mut merged = base.clone();
                        for (k, v) in body
                            .as_ref()
                            .and_then(Value::as_object)
                            .into_iter()
                            .flatten()
                        {
                            if k != "metadata" {
                                merged[k] = v.clone();
                            }
                        }
                        merged
                    }
                };
                let response = Response::builder()
                    .status(step.status)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&reply).expect("json")))
                    .expect("response");
                send.send_response(response);
                recorded.push(Recorded {
                    method,
                    path,
                    query,
                    content_type,
                    body,
                });
            }
            if let Ok(Some((request, _))) =
                tokio::time::timeout(Duration::from_millis(200), self.handle.next_request()).await
            {
                panic!(
                    "unexpected extra request {} {}",
                    request.method(),
                    request.uri()
                );
            }
            recorded
        })
    }
}

/// Await the mock server, failing the test if it panicked or hung.
pub async fn finish(server: tokio::task::JoinHandle<Vec<Recorded>>) -> Vec<Recorded> {
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("mock server timed out")
        .expect("mock server scenario failed")
}

/// Paths of a namespaced core or group resource.
pub fn path(group_version: &str, ns: &str, plural: &str, name: &str) -> String {
    let prefix = if group_version == "v1" {
        "/api/v1".to_string()
    } else {
        format!("/apis/{group_version}")
    };
    format!("{prefix}/namespaces/{ns}/{plural}/{name}")
}

/// JSON `value` with a deep subset `expected`: every field of `expected` is in `value`, equal.
pub fn contains(value: &Value, expected: &Value) -> bool {
    match (value, expected) {
        (Value::Object(v), Value::Object(e)) => e
            .iter()
            .all(|(k, ev)| v.get(k).is_some_and(|vv| contains(vv, ev))),
        (Value::Array(v), Value::Array(e)) => {
            v.len() == e.len() && v.iter().zip(e).all(|(a, b)| contains(a, b))
        }
        (a, b) => a == b,
    }
}

/// The condition of `type_` in a status JSON.
pub fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

/// What RBAC sees in one request: API group, resource (with subresource), verbs, namespace
/// and object name. A server-side apply is a `patch` that the apiserver also authorizes as
/// `create` when the object does not exist, so it needs both; an apply to a subresource
/// (`status`) never creates its parent, so it is a `patch` alone.
#[derive(Debug, PartialEq, Eq)]
pub struct Access {
    pub group: String,
    pub resource: String,
    pub verbs: Vec<&'static str>,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Map a request's method and path to the RBAC attributes the apiserver authorizes
/// (`/api/v1/...` is the core group, `/apis/{group}/{version}/...` the others).
pub fn access(method: &Method, path: &str, query: &str, is_apply: bool) -> Access {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", _version, rest @ ..] => (String::new(), rest),
        ["apis", group, _version, rest @ ..] => (group.to_string(), rest),
        _ => panic!("not a Kubernetes API path: {path}"),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        rest => (None, rest),
    };
    let (resource, name) = match rest {
        [plural] => (plural.to_string(), None),
        [plural, name] => (plural.to_string(), Some(name.to_string())),
        [plural, name, sub] => (format!("{plural}/{sub}"), Some(name.to_string())),
        _ => panic!("unexpected API path shape: {path}"),
    };
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let verbs = match (method.as_str(), name.is_some()) {
        ("GET", true) => vec!["get"],
        ("GET", false) if watch => vec!["watch"],
        ("GET", false) => vec!["list"],
        ("POST", _) => vec!["create"],
        ("PUT", _) => vec!["update"],
        ("PATCH", _) if is_apply && !resource.contains('/') => vec!["patch", "create"],
        ("PATCH", _) => vec!["patch"],
        ("DELETE", true) => vec!["delete"],
        ("DELETE", false) => vec!["deletecollection"],
        (m, _) => panic!("unexpected method {m} on {path}"),
    };
    Access {
        group,
        resource,
        verbs,
        namespace,
        name,
    }
}

/// Panic unless the RBAC table grants `component` every verb the request needs.
pub fn assert_granted(component: Component, method: &Method, path: &str, query: &str, apply: bool) {
    let a = access(method, path, query, apply);
    let scope = match a.namespace.as_deref() {
        Some(OPERATOR_NAMESPACE) => Scope::OperatorNamespace,
        _ => Scope::Cluster,
    };
    let names_of = |n: Names| match n {
        Names::LeaderLease => Some(rbac::LEASE_NAME.to_string()),
        Names::ApiKeysSecret | Names::Any => None,
    };
    for verb in &a.verbs {
        assert!(
            rbac::allows(
                component,
                scope,
                &a.group,
                &a.resource,
                verb,
                a.name.as_deref(),
                names_of
            ),
            "{component:?} made {method} {path}?{query}, which needs `{verb}` on \
             {:?}/{} ({scope:?}); operator/src/rbac.rs (and so the chart) does not grant it",
            a.group,
            a.resource,
        );
    }
}
