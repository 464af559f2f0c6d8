//! LoRA adapters through the gateway (its request path and `/v1/models`), against fake nodes:
//! each answers `/v1/status` with a fixed report listing its adapters and echoes every
//! completion with its own name, so a test sees which replica a request reached. Needs no
//! `gantry-node` binary.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::routing::{get, post};
use gantry_api::{AdapterState, AdapterStatus, LoadState, LoadStatus, ModelStatus, NodeStatus};
use serde_json::{Value, json};

use crate::support::{Gateway, fast_settings, metric};

/// A fake node named `name` whose status reports model `model` loaded with `adapters`.
struct FakeNode {
    base: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Fake {
    name: String,
    status: NodeStatus,
}

fn adapter(name: &str, id: &str, state: AdapterState) -> AdapterStatus {
    let refused = state == AdapterState::Refused;
    AdapterStatus {
        name: name.into(),
        id: id.into(),
        state,
        reason: refused.then(|| "mismatch".into()),
        message: refused.then(|| "adapter rank 16 was trained for another base model".into()),
        bytes: None,
    }
}

impl FakeNode {
    async fn start(name: &str, model: &str, adapters: Vec<AdapterStatus>) -> FakeNode {
        let status = NodeStatus {
            version: "0.1.0".into(),
            backend: "cpu".into(),
            ready: true,
            draining: false,
            models: vec![ModelStatus {
                id: model.into(),
                format: "gguf".into(),
                architecture: Some("llama".into()),
                verdict: None,
                artifact: Default::default(),
                load: LoadStatus {
                    state: LoadState::Loaded,
                    plugin: Some("llama_cpp".into()),
                    ..Default::default()
                },
                queue: Default::default(),
                devices: Vec::new(),
                replicas: Vec::new(),
                crashes: None,
                engine_choice: None,
                adapters,
                draft: None,
            }],
            ..NodeStatus::default()
        };
        let fake = Arc::new(Fake {
            name: name.into(),
            status,
        });
        let app = axum::Router::new()
            .route(
                "/v1/status",
                get(|State(f): State<Arc<Fake>>| async move { Json(f.status.clone()) }),
            )
            .route(
                "/v1/completions",
                post(
                    |State(f): State<Arc<Fake>>, Json(body): Json<Value>| async move {
                        Json(json!({"object": "text_completion", "model": body["model"],
                                    "node": f.name, "choices": []}))
                    },
                ),
            )
            .with_state(fake);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeNode { base, task }
    }
}

fn completion(model: &str) -> Value {
    json!({"model": model, "prompt": "Once upon a time", "max_tokens": 2})
}

/// Two replicas of `smol`: `pirate` has its files on one and is loaded on the other; `legal`
/// (served as `legal-bot`) was refused by both.
async fn two_replicas_with_adapters() -> ([FakeNode; 2], Gateway) {
    let nodes = [
        FakeNode::start(
            "downloaded",
            "smol",
            vec![
                adapter("pirate", "smol:pirate", AdapterState::Downloaded),
                adapter("legal", "legal-bot", AdapterState::Refused),
            ],
        )
        .await,
        FakeNode::start(
            "loaded",
            "smol",
            vec![
                adapter("pirate", "smol:pirate", AdapterState::Loaded),
                adapter("legal", "legal-bot", AdapterState::Refused),
            ],
        )
        .await,
    ];
    let gw = Gateway::start(
        json!({"models": {"smol": [nodes[0].base, nodes[1].base]}}),
        fast_settings(),
        None,
    )
    .await;
    gw.wait_probed("smol:pirate").await;
    (nodes, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_id_routes_to_the_base_models_replica_that_has_it_loaded() {
    let (_nodes, gw) = two_replicas_with_adapters().await;
    // Eight prompts, which prefix routing alone would spread over both replicas.
    for i in 0..8 {
        let body = json!({"model": "smol:pirate", "prompt": format!("Tale {i}: once upon a time"),
                          "max_tokens": 2});
        let (s, v) = gw.post("/v1/completions", body, None).await;
        assert_eq!(s, 200, "{v}");
        // The node gets the adapter's id as the client sent it.
        assert_eq!(
            (v["node"].as_str(), v["model"].as_str()),
            (Some("loaded"), Some("smol:pirate")),
            "prompt {i}"
        );
    }
    // The base model is served as before.
    let (s, v) = gw.post("/v1/completions", completion("smol"), None).await;
    assert_eq!((s, v["model"].as_str()), (200, Some("smol")), "{v}");
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "gantry_gateway_requests_total{code=\"200\",model=\"smol:pirate\"}"
        ),
        Some(8.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_each_adapter_with_its_parent_after_its_base_and_not_a_refused_one() {
    let (_nodes, gw) = two_replicas_with_adapters().await;
    let (s, v) = gw.get("/v1/models", None).await;
    assert_eq!(s, 200, "{v}");
    let data = v["data"].as_array().expect("data");
    let ids: Vec<&str> = data.iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["smol", "smol:pirate"], "{v}");
    assert_eq!(data[0]["parent"], Value::Null);
    assert_eq!(data[0]["ready"], true);
    let pirate = &data[1];
    assert_eq!(
        (
            pirate["object"].as_str(),
            pirate["owned_by"].as_str(),
            pirate["parent"].as_str(),
            pirate["ready"].as_bool(),
            pirate["replicas_ready"].as_u64(),
        ),
        (
            Some("model"),
            Some("gantry"),
            Some("smol"),
            Some(true),
            Some(1)
        )
    );
    assert_eq!(pirate["created"], data[0]["created"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_or_refused_adapter_gets_an_openai_error_naming_the_model_field() {
    let (_nodes, gw) = two_replicas_with_adapters().await;
    let (s, v) = gw
        .post("/v1/completions", completion("smol:nope"), None)
        .await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    assert_eq!(v["error"]["param"], "model", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(
        v["error"]["message"],
        "The model `smol:nope` does not exist: the model `smol` has no adapter `nope` \
         (its adapters: legal-bot, smol:pirate)"
    );

    let (s, v) = gw
        .post("/v1/completions", completion("legal-bot"), None)
        .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["code"], "adapter_refused", "{v}");
    assert_eq!(v["error"]["param"], "model", "{v}");
    assert_eq!(
        v["error"]["message"],
        "the adapter `legal-bot` of the model `smol` cannot serve: every replica refused it \
         (mismatch: adapter rank 16 was trained for another base model); see the Model's \
         status.adapters"
    );
    // `<model>:<name>` of no model at all is a plain unknown model.
    let (s, v) = gw
        .post("/v1/completions", completion("other:pirate"), None)
        .await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(
        v["error"]["message"],
        "The model `other:pirate` does not exist"
    );
}
