//! The node token check (HTTP layer, before any handler): the real `gantry-node` binary with
//! `GANTRY_NODE_TOKEN` set refuses every route but the probes and metrics unless the request
//! carries the token, and answers in OpenAI's error shape.

mod common;

use std::time::{Duration, Instant};

use common::*;
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};
use serde_json::{Value, json};

const TOKEN: &str = "4dce9168474a782aeebad355ce9572b8e237d58baa22a8c071bdd293110b3ba2";
const HEADER: &str = "X-Gantry-Node-Token";

fn node(token: Option<&str>) -> NodeProc {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("tiny.gguf");
    write_tiny_gguf(&p, &TinyModelSpec::default()).expect("tiny gguf");
    let config = json!({"models": [{"id": "tiny", "path": p, "format": "gguf",
                                    "contextLength": 512, "maxBatchSize": 2}]});
    let token = token.map(str::to_string);
    spawn_node(&config, &profile_dir().join("engines"), dir, move |cmd| {
        cmd.env_remove("GANTRY_NODE_TOKEN");
        if let Some(t) = token {
            cmd.env("GANTRY_NODE_TOKEN", t);
        }
    })
}

async fn chat(node: &NodeProc, token: Option<&str>) -> (u16, Value) {
    let mut req = http()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&json!({
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "temperature": 0
        }));
    if let Some(t) = token {
        req = req.header(HEADER, t);
    }
    let r = req.send().await.expect("request");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn assert_refused(status: u16, body: &Value, code: &str) {
    assert_eq!(status, 401, "{body}");
    let e = &body["error"];
    assert_eq!(e["code"], code, "{body}");
    assert_eq!(e["type"], "invalid_request_error", "{body}");
    assert!(e["param"].is_null(), "{body}");
    assert!(
        e["message"].as_str().is_some_and(|m| m.contains(HEADER)),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_node_token_every_route_but_probes_and_metrics_is_401() {
    let node = node(Some(TOKEN));
    wait_ready(&node).await;

    let (s, v) = chat(&node, None).await;
    assert_refused(s, &v, "node_token_required");
    let (s, v) = chat(&node, Some(&TOKEN[..63])).await;
    assert_refused(s, &v, "invalid_node_token");
    let (s, v) = chat(&node, Some("")).await;
    assert_refused(s, &v, "invalid_node_token");

    // The right token serves.
    let (s, v) = chat(&node, Some(TOKEN)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion", "{v}");

    // Every other route is closed too: models, status, tokenize, embeddings, unknown paths.
    for path in ["/v1/models", "/v1/status", "/nope"] {
        let r = http()
            .get(format!("{}{path}", node.base))
            .send()
            .await
            .expect("get");
        assert_eq!(r.status(), 401, "{path}");
        let with = http()
            .get(format!("{}{path}", node.base))
            .header(HEADER, TOKEN)
            .send()
            .await
            .expect("get");
        assert_ne!(with.status(), 401, "{path} with the token");
    }
    // The check comes before the body is parsed: junk without a token is a 401, not a 400.
    let r = http()
        .post(format!("{}/v1/completions", node.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 401);

    // Probes and metrics stay open (the kubelet and Prometheus send no token).
    for path in ["/healthz", "/readyz", "/metrics"] {
        let r = http()
            .get(format!("{}{path}", node.base))
            .send()
            .await
            .expect("get");
        assert_eq!(r.status(), 200, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_configured_token_the_node_is_open_and_a_weak_token_does_not_start() {
    let node = node(None);
    wait_ready(&node).await;
    let (s, v) = chat(&node, None).await;
    assert_eq!(s, 200, "{v}");

    let mut weak = self::node(Some("too-short"));
    let t0 = Instant::now();
    let exit = loop {
        if let Some(status) = weak.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "a node with a weak token kept running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!exit.success());
}
