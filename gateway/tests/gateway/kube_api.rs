//! Gateway against a mock API server (discovery and the scale-up request, beside the gateway's
//! request path): the exact calls the gateway makes to the Kubernetes API.

use std::sync::Arc;
use std::time::Duration;

use gantry_api::node_token::InstallToken;
use gantry_crd::Model;
use gantry_crd::names::ANNOTATION_SCALE_UP_REQUESTED;
use gantry_gateway::kube_source::{self, routes_from};
use gantry_gateway::route_table::{RouteTable, ScaleTarget};
use gantry_gateway::scale::{KubeScaler, Scaler};
use http::{Method, Request, Response};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::client::Body;
use serde_json::{Value, json};

fn slice(ns: &str, service: &str, endpoints: &[(&str, Option<bool>)]) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-abcde"), "namespace": ns,
                     "labels": {"kubernetes.io/service-name": service,
                                "app.kubernetes.io/managed-by": "gantry-operator"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints.iter().map(|(ip, ready)| {
            let mut e = json!({"addresses": [ip]});
            if let Some(r) = ready {
                e["conditions"] = json!({"ready": r});
            }
            e
        }).collect::<Vec<_>>(),
    })
}

/// The operator tests' CPU Model (operator/tests/fixtures/models/cpu.yaml), through the Model type.
fn fixture_model() -> Model {
    serde_json::from_value(json!({
        "apiVersion": "gantry.dev/v1alpha1", "kind": "Model",
        "metadata": {"name": "gemma-3-270m", "namespace": "default",
                     "uid": "3f1c2b4a-0000-4000-8000-000000000001", "generation": 1},
        "spec": {
            "source": {"uri": "hf://unsloth/gemma-3-270m-it-GGUF", "quantization": "Q4_K_M"},
            "format": "gguf",
            "servedName": "gemma-3-270m",
            "resources": {"cpu": "2", "memory": "2Gi"},
            "engineConfig": {"contextLength": 4096, "maxBatchSize": 8, "threads": 2},
        },
    }))
    .expect("model")
}

fn model_json(min: i32) -> Value {
    let mut m = serde_json::to_value(fixture_model()).expect("json");
    m["spec"]["replicas"] = json!({"min": min, "max": 2});
    m
}

#[tokio::test]
async fn scale_up_request_merge_patches_the_node_deployment_annotation() {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let scaler = KubeScaler::new(kube::Client::new(service, "default"));
    let target = ScaleTarget {
        namespace: "team-a".into(),
        deployment: "gemma-3-270m".into(),
    };
    let server = tokio::spawn(async move {
        let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
            .await
            .expect("a request")
            .expect("client alive");
        let (method, uri) = (req.method().clone(), req.uri().clone());
        let content_type = req.headers()["content-type"]
            .to_str()
            .expect("ascii")
            .to_string();
        let body: Value =
            serde_json::from_slice(&req.into_body().collect_bytes().await.expect("body"))
                .expect("json body");
        send.send_response(
            Response::builder()
                .body(Body::from(
                    serde_json::to_vec(&json!({"apiVersion": "apps/v1", "kind": "Deployment",
                        "metadata": {"name": "gemma-3-270m", "namespace": "team-a"}}))
                    .expect("json"),
                ))
                .expect("response"),
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(200), handle.next_request())
                .await
                .is_err(),
            "one request only"
        );
        (method, uri, content_type, body)
    });
    let before = k8s_openapi::jiff::Timestamp::now();
    scaler
        .request_scale_up("gemma-3-270m", Some(&target))
        .await
        .expect("patched");
    let (method, uri, content_type, body) = server.await.expect("mock server");
    assert_eq!(method, Method::PATCH);
    assert_eq!(
        uri.path(),
        "/apis/apps/v1/namespaces/team-a/deployments/gemma-3-270m"
    );
    assert_eq!(uri.query(), Some("&fieldManager=gantry-gateway"));
    assert_eq!(content_type, "application/merge-patch+json");
    // Exactly one annotation, an RFC 3339 UTC time of now.
    let annotations = body["metadata"]["annotations"]
        .as_object()
        .expect("annotations");
    assert_eq!(body.as_object().map(|o| o.len()), Some(1), "{body}");
    assert_eq!(annotations.len(), 1, "{body}");
    let stamp = annotations[ANNOTATION_SCALE_UP_REQUESTED]
        .as_str()
        .expect("string");
    assert!(stamp.ends_with('Z'), "{stamp}");
    let at: k8s_openapi::jiff::Timestamp = stamp.parse().expect("RFC 3339");
    assert!(
        at >= before
            .checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(1))
            .expect("t")
    );
}

#[tokio::test]
async fn discovery_lists_models_and_their_endpoint_slices_into_routes() {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let table = Arc::new(RouteTable::new(true));
    let install: InstallToken = "0123456789abcdef0123456789abcdef".parse().expect("token");
    let run = tokio::spawn(kube_source::run(
        client,
        Some("default".into()),
        table.clone(),
        Some(install.clone()),
    ));
    let mut seen = Vec::new();
    // Open watches are parked here, unanswered, so the reflectors stay quiet after listing.
    let mut parked = Vec::new();
    while seen
        .iter()
        .filter(|(_, q): &&(String, String)| !q.contains("watch=true"))
        .count()
        < 2
    {
        let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
            .await
            .expect("a request")
            .expect("client alive");
        assert_eq!(req.method(), Method::GET);
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or_default().to_string();
        let items = match path.as_str() {
            "/apis/gantry.dev/v1alpha1/namespaces/default/models" => vec![model_json(0)],
            "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices" => vec![
                slice(
                    "default",
                    "gemma-3-270m",
                    &[("10.0.0.7", Some(true)), ("10.0.0.8", Some(false))],
                ),
                slice("default", "unrelated", &[("10.0.0.9", None)]),
            ],
            other => panic!("unexpected request {other}?{query}"),
        };
        if query.contains("watch=true") {
            parked.push(send);
        } else {
            send.send_response(
                Response::builder()
                    .body(Body::from(
                        serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "List",
                            "metadata": {"resourceVersion": "1"}, "items": items}))
                        .expect("json"),
                    ))
                    .expect("response"),
            );
        }
        seen.push((path, query));
    }
    // Only the operator's slices are watched.
    let slice_list = seen
        .iter()
        .find(|(p, q)| p.ends_with("/endpointslices") && !q.contains("watch=true"))
        .expect("slice list");
    assert!(
        slice_list
            .1
            .contains("labelSelector=app.kubernetes.io%2Fmanaged-by%3Dgantry-operator"),
        "{}",
        slice_list.1
    );
    let t0 = std::time::Instant::now();
    while !table.is_synced() {
        assert!(t0.elapsed() < Duration::from_secs(5), "routes never built");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let route = table.get("gemma-3-270m").expect("routed by servedName");
    let urls: Vec<&str> = route.replicas.iter().map(|r| r.url.as_str()).collect();
    assert_eq!(urls, ["http://10.0.0.7:8080", "http://10.0.0.8:8080"]);
    // Every replica carries the Model's own token: HMAC of "<namespace>/<name>" under the
    // install token, the value the operator put in the Model's Secret.
    let derived = install.for_model("default", "gemma-3-270m");
    assert_eq!(
        derived.as_str(),
        "b5872537c6db2192a6a3d0f908624a52d9413fd1802cf4966d4267748a81ef62"
    );
    for r in &route.replicas {
        assert_eq!(
            r.node_token().map(|v| v.as_bytes()),
            Some(derived.as_str().as_bytes())
        );
    }
    assert!(
        !route.spec.endpoints[1].1,
        "the not-ready endpoint is kept but not ready"
    );
    assert_eq!(
        route.spec.target,
        Some(ScaleTarget {
            namespace: "default".into(),
            deployment: "gemma-3-270m".into()
        })
    );
    assert_eq!(route.spec.min_replicas, 0);
    assert!(route.listable());
    run.abort();
    drop(parked);
}

#[test]
fn a_model_whose_status_says_it_cannot_serve_is_failed_and_not_listed() {
    let mut m: Model = serde_json::from_value(model_json(0)).expect("model");
    m.status = Some(
        serde_json::from_value(json!({"conditions": [{
            "type": "Ready", "status": "False", "reason": "EngineUnresolved",
            "message": "no engine", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}))
        .expect("status"),
    );
    let slices: Vec<Arc<EndpointSlice>> = vec![Arc::new(
        serde_json::from_value(slice("default", "gemma-3-270m", &[("10.0.0.7", None)]))
            .expect("slice"),
    )];
    let specs = routes_from(&[Arc::new(m)], &slices, None);
    assert_eq!(specs[0].node_token, None);
    assert!(specs[0].failed);
    let table = RouteTable::new(true);
    table.replace(specs);
    assert!(!table.get("gemma-3-270m").expect("route").listable());
}

#[test]
fn pool_members_share_their_pools_pods_token_and_deployment() {
    let member = |name: &str| -> Arc<Model> {
        let mut m = fixture_model();
        m.metadata.name = Some(name.to_string());
        m.spec.served_name = Some(name.to_string());
        m.spec.resources = None;
        m.spec.pool = Some("small".to_string());
        Arc::new(m)
    };
    let slices: Vec<Arc<EndpointSlice>> = vec![Arc::new(
        serde_json::from_value(slice(
            "default",
            "small-pool",
            &[("10.0.0.7", None), ("10.0.0.8", Some(true))],
        ))
        .expect("slice"),
    )];
    let install: InstallToken = "0123456789abcdef0123456789abcdef".parse().expect("token");
    let specs = routes_from(&[member("a"), member("b")], &slices, Some(&install));
    assert_eq!(specs.len(), 2);
    for s in &specs {
        assert_eq!(
            s.endpoints,
            vec![
                ("http://10.0.0.7:8080".to_string(), true),
                ("http://10.0.0.8:8080".to_string(), true)
            ],
            "{}",
            s.id
        );
        assert_eq!(
            s.node_token,
            Some(install.for_model("default", "small-pool"))
        );
        assert_eq!(
            s.target,
            Some(ScaleTarget {
                namespace: "default".into(),
                deployment: "small-pool".into()
            })
        );
    }
}

#[test]
fn a_models_spec_adapters_route_to_its_pods_before_any_pod_reports_them() {
    let mut m = fixture_model();
    m.spec.adapters = serde_json::from_value(json!([
        {"name": "pirate", "source": {"uri": "hf://org/pirate-lora"}},
        {"name": "legal", "source": {"uri": "pvc://loras/legal"}, "servedName": "legal-bot"},
    ]))
    .expect("adapters");
    let slices: Vec<Arc<EndpointSlice>> = vec![Arc::new(
        serde_json::from_value(slice("default", "gemma-3-270m", &[("10.0.0.7", None)]))
            .expect("slice"),
    )];
    let specs = routes_from(&[Arc::new(m)], &slices, None);
    assert_eq!(specs[0].adapters, ["gemma-3-270m:pirate", "legal-bot"]);
    let table = RouteTable::new(true);
    table.replace(specs);
    for id in ["gemma-3-270m:pirate", "legal-bot"] {
        match table.resolve(id) {
            gantry_gateway::route_table::Target::Adapter { route, id: adapter } => {
                assert_eq!(
                    (route.spec.id.as_str(), adapter.as_str()),
                    ("gemma-3-270m", id)
                );
            }
            other => panic!("{id} resolved to {other:?}"),
        }
    }
}
