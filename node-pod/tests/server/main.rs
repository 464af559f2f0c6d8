//! Node server tests: the real `gantry-node` binary on loopback with real plugins — batching,
//! disconnects, deadlines, the watchdog, fault isolation, SIGTERM drain, readiness and metrics.

#[path = "../common/mod.rs"]
mod common;
mod lifecycle;
mod replicas;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use common::{node_metrics as metrics_text, node_status as status, post_json as post};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};
use serde_json::{Value, json};

/// Start the node with a YAML config written from `models` (each `{id, file, ...}`).
pub(crate) fn start(config: Value, plugins: &Path, dir: tempfile::TempDir) -> NodeProc {
    spawn_node(&config, plugins, dir, |_| {})
}

pub(crate) fn tiny_dir(spec: TinyModelSpec) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("tiny.gguf");
    write_tiny_gguf(&p, &spec).expect("tiny gguf");
    (dir, p)
}

pub(crate) fn tiny_node(extra_model: Value, scheduler: Value) -> NodeProc {
    node_with(TinyModelSpec::default(), extra_model, scheduler)
}

pub(crate) fn node_with(spec: TinyModelSpec, extra_model: Value, scheduler: Value) -> NodeProc {
    let (dir, p) = tiny_dir(spec);
    let mut model = json!({"id": "tiny", "path": p, "format": "gguf", "contextLength": 2048, "maxBatchSize": 8});
    if let (Some(m), Some(e)) = (model.as_object_mut(), extra_model.as_object()) {
        m.extend(e.clone());
    }
    let config = json!({"models": [model], "scheduler": scheduler});
    start(config, &profile_dir().join("engines"), dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_greedy_requests_return_what_eight_sequential_ones_do() {
    let node = tiny_node(json!({}), json!({"responseCacheRamFraction": 0.0}));
    wait_ready(&node).await;
    let prompts: Vec<String> = (0..8).map(|i| format!("Request number {i} says")).collect();
    let body = |p: &str| json!({"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0});
    let mut sequential = Vec::new();
    for p in &prompts {
        let (s, v) = post(&node, "/v1/completions", body(p)).await;
        assert_eq!(s, 200, "{v}");
        sequential.push(v["choices"][0]["text"].as_str().expect("text").to_string());
    }
    let concurrent = futures::future::join_all(
        prompts
            .iter()
            .map(|p| post(&node, "/v1/completions", body(p))),
    )
    .await;
    for (i, (s, v)) in concurrent.iter().enumerate() {
        assert_eq!(*s, 200);
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(sequential[i].as_str()),
            "request {i}"
        );
        assert_eq!(v["usage"]["completion_tokens"], 24);
    }
    // They really ran together: some step carried more than one sequence.
    let metrics = metrics_text(&node).await;
    let one_token_steps = metric_value(
        &metrics,
        "gantry_engine_step_tokens_bucket{model=\"tiny\",le=\"1\"}",
    );
    let steps = metric_value(&metrics, "gantry_engine_steps_total{model=\"tiny\"}");
    assert!(one_token_steps < steps, "no batched step among {steps}");
}

pub(crate) fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .map(|v| v.trim().parse::<f64>().expect("number"))
        })
        .unwrap_or_else(|| panic!("{series} missing"))
}

/// A short greedy completion ("C", 5 tokens) sent in the background; its HTTP status.
pub(crate) fn spawn_short_completion(node: &NodeProc) -> tokio::task::JoinHandle<u16> {
    let base = node.base.clone();
    tokio::spawn(async move {
        http()
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "tiny", "prompt": "C", "max_tokens": 5, "temperature": 0}))
            .send()
            .await
            .expect("c")
            .status()
            .as_u16()
    })
}

pub(crate) async fn open_stream(
    node: &NodeProc,
    max_tokens: u32,
) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    stream(
        node,
        "/v1/chat/completions",
        json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story"}],
               "max_tokens": max_tokens, "temperature": 0, "stream": true}),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_disconnected_stream_frees_its_sequence_while_the_others_continue() {
    // Two sequence slots: A and B hold them, C waits for one.
    let node = tiny_node(
        json!({"requestTimeoutSeconds": 0, "maxBatchSize": 2}),
        json!({"responseCacheRamFraction": 0.0}),
    );
    wait_ready(&node).await;
    let mut a = open_stream(&node, 1800).await;
    let mut b = open_stream(&node, 1800).await;
    for _ in 0..3 {
        a.recv().await.expect("a chunk");
        b.recv().await.expect("b chunk");
    }
    let c = spawn_short_completion(&node);
    let t0 = Instant::now();
    let held = loop {
        let s = status(&node).await;
        if s["models"][0]["queue"]["waiting"] == 1 {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "C never queued: {s}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(held["models"][0]["queue"]["running"], 2, "{held}");
    let kv_both = held["models"][0]["queue"]["kvUsedTokens"]
        .as_u64()
        .expect("kv");
    assert!(kv_both > 0);
    drop(a); // the client goes away: its slot and KV go to C at the next step
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), c)
            .await
            .expect("C admitted")
            .expect("join"),
        200
    );
    // The scheduler publishes its figures after each step: poll briefly.
    let t0 = Instant::now();
    loop {
        let s = status(&node).await;
        if s["models"][0]["queue"]["running"] == 1 && s["models"][0]["queue"]["waiting"] == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "only B should be left: {s}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // B is untouched and runs to its end.
    let mut chunks = 0;
    let mut last = String::new();
    while let Some(d) = b.recv().await {
        chunks += 1;
        last = d;
    }
    assert_eq!(last, "[DONE]");
    assert!(chunks > 1000, "B streamed all its tokens ({chunks} events)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_the_deadline_a_stream_ends_with_an_error_event_and_a_plain_request_says_how_it_was_cut()
{
    // A wider random model (~100x the tiny one's work per token) makes a 1 s
    // deadline land mid-generation on fast and on loaded machines alike.
    let slow = TinyModelSpec {
        n_embd: 512,
        n_ff: 1024,
        n_layer: 8,
        n_head: 8,
        n_head_kv: 8,
        ..TinyModelSpec::default()
    };
    let node = node_with(
        slow,
        json!({"contextLength": 2048}),
        json!({"responseCacheRamFraction": 0.0}),
    );
    wait_ready(&node).await;
    let (s, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "x", "max_tokens": 2040, "temperature": 0, "timeout": 1}),
    )
    .await;
    assert_eq!(s, 504, "{v}");
    assert_eq!(v["error"]["code"], "deadline_exceeded");
    // No `max_tokens`: the node chose the length, the deadline bounded it; the work is kept.
    let resp = http()
        .post(format!("{}/v1/completions", node.base))
        .json(&json!({"model": "tiny", "prompt": "x", "temperature": 0, "timeout": 1}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()
            .get("x-gantry-truncated")
            .and_then(|h| h.to_str().ok()),
        Some("deadline")
    );
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(
        v["usage"]["completion_tokens"].as_u64().expect("n") > 0,
        "{v}"
    );
    let mut rx = stream(
        &node,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "x", "max_tokens": 2040, "temperature": 0, "stream": true, "timeout": 1}),
    )
    .await;
    let mut chunks = Vec::new();
    while let Some(d) = rx.recv().await {
        chunks.push(d);
    }
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    // The last event before [DONE] is an OpenAI-shaped error, and no chunk claimed to finish.
    let fin: Value = serde_json::from_str(&chunks[chunks.len() - 2]).expect("final event");
    assert_eq!(fin["error"]["code"], "deadline_exceeded", "{fin}");
    assert!(
        chunks[..chunks.len() - 2]
            .iter()
            .filter_map(|c| serde_json::from_str::<Value>(c).ok())
            .all(|c| c["choices"][0]["finish_reason"].is_null()),
        "a cut stream must not carry a finish_reason"
    );
    // At least one token chunk before the error event and [DONE]; how many fit in the second
    // depends on how busy the machine is.
    assert!(chunks.len() >= 3, "the stream returned the tokens it had");
    assert!(
        chunks.len() < 2000,
        "the deadline cut the stream short ({} events)",
        chunks.len()
    );
    // A per-request timeout above the model's maximum is refused.
    let (s, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "x", "max_tokens": 2, "timeout": 0}),
    )
    .await;
    assert_eq!(
        s, 200,
        "no maximum configured: `timeout: 0` is allowed: {v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_engine_step_fails_healthz_and_the_request_times_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugins = faulty_plugins(dir.path());
    let hang = toy_gguf(dir.path(), "hang-model");
    let config = json!({
        "models": [{"id": "hang", "path": hang, "format": "gguf", "requestTimeoutSeconds": 1}],
        "scheduler": {"stepTimeoutSeconds": 1, "responseCacheRamFraction": 0.0}
    });
    let node = start(config, &plugins, dir);
    wait_ready(&node).await;
    let c = http();
    assert_eq!(
        c.get(format!("{}/healthz", node.base))
            .send()
            .await
            .expect("h")
            .status(),
        200
    );
    let (s, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "hang", "prompt": "hi", "max_tokens": 4}),
    )
    .await;
    assert_eq!(s, 504, "{v}");
    let t0 = Instant::now();
    loop {
        let r = c
            .get(format!("{}/healthz", node.base))
            .send()
            .await
            .expect("h");
        if r.status() == 503 {
            assert!(r.text().await.expect("t").contains("engine hung"));
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "healthz never failed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_model_answers_500_and_the_node_keeps_serving_the_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugins = faulty_plugins(dir.path());
    let config = json!({
        "models": [
            {"id": "panicky", "path": toy_gguf(dir.path(), "panic-model"), "format": "gguf"},
            {"id": "healthy", "path": toy_gguf(dir.path(), "healthy-model"), "format": "gguf"}
        ]
    });
    let node = start(config, &plugins, dir);
    wait_ready(&node).await;
    let (s, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "panicky", "prompt": "hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 500, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("msg")
            .contains("plugin panicked"),
        "{v}"
    );
    let (s, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "healthy", "prompt": "ab", "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["choices"][0]["text"], "cde",
        "the toy engine counts up from the last byte"
    );
    let h = http()
        .get(format!("{}/healthz", node.base))
        .send()
        .await
        .expect("h");
    assert_eq!(h.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_constrained_request_to_an_engine_without_masks_is_a_400_naming_the_engine() {
    // The fault plugin declares no GANTRY_CAP_TOKEN_MASK: a constrained request must be
    // refused, never answered unconstrained, and the model keeps serving plain requests.
    let dir = tempfile::tempdir().expect("tempdir");
    let plugins = faulty_plugins(dir.path());
    let config = json!({
        "models": [{"id": "toy", "path": toy_gguf(dir.path(), "plain-model"), "format": "gguf"}],
        "scheduler": {"responseCacheRamFraction": 0.0}
    });
    let node = start(config, &plugins, dir);
    wait_ready(&node).await;
    let schema =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}});
    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": "toy", "messages": [{"role": "user", "content": "hi"}], "response_format": schema}),
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "toy", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}),
            "tools",
        ),
        (
            "/v1/completions",
            json!({"model": "toy", "prompt": "hi", "guided_regex": "[a-z]+"}),
            "guided_regex",
        ),
    ];
    for (path, body, field) in cases {
        let (s, v) = post(&node, path, body).await;
        assert_eq!(s, 400, "{v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let msg = v["error"]["message"].as_str().expect("message");
        assert!(
            msg.contains("engine `faulty`") && msg.contains("GANTRY_CAP_TOKEN_MASK"),
            "{msg}"
        );
    }
    let (s, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "toy", "prompt": "ab", "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(
        (s, v["choices"][0]["text"].as_str()),
        (200, Some("cde")),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unsupported_architecture_keeps_the_node_unready_and_says_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("mystery.gguf");
    let spec = TinyModelSpec {
        architecture_name_override: Some("mysteryarch".into()),
        ..TinyModelSpec::default()
    };
    write_tiny_gguf(&p, &spec).expect("gguf");
    let config = json!({"models": [{"id": "mystery", "path": p, "format": "gguf"}]});
    let node = start(config, &profile_dir().join("engines"), dir);
    let c = http();
    let t0 = Instant::now();
    let s = loop {
        let s = match c.get(format!("{}/v1/status", node.base)).send().await {
            Ok(r) => r.json::<Value>().await.expect("json"),
            Err(_) => Value::Null, // not listening yet
        };
        if !s["models"][0]["verdict"].is_null() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(s["ready"], false);
    assert_eq!(s["models"][0]["verdict"]["verdict"], "unsupported");
    assert_eq!(
        s["models"][0]["verdict"]["rejections"][0]["kind"],
        "architecture"
    );
    assert!(
        s["models"][0]["verdict"]["rejections"][0]["reason"]
            .as_str()
            .expect("r")
            .contains("mysteryarch")
    );
    let r = c
        .get(format!("{}/readyz", node.base))
        .send()
        .await
        .expect("readyz");
    assert_eq!(r.status(), 503);
    let (code, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "mystery", "prompt": "x"}),
    )
    .await;
    assert_eq!(code, 503);
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("m")
            .contains("no engine on this node supports")
    );
}
