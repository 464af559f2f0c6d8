//! Node server tests: the real `gantry-node` binary on loopback with real plugins — batching,
//! disconnects, deadlines, the watchdog, fault isolation, SIGTERM drain, readiness and metrics.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use common::{node_metrics as metrics_text, node_status as status, post_json as post};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};
use serde_json::{Value, json};

/// Start the node with a YAML config written from `models` (each `{id, file, ...}`).
fn start(config: Value, plugins: &Path, dir: tempfile::TempDir) -> NodeProc {
    spawn_node(&config, plugins, dir, |_| {})
}

fn tiny_dir(spec: TinyModelSpec) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("tiny.gguf");
    write_tiny_gguf(&p, &spec).expect("tiny gguf");
    (dir, p)
}

fn tiny_node(extra_model: Value, scheduler: Value) -> NodeProc {
    node_with(TinyModelSpec::default(), extra_model, scheduler)
}

fn node_with(spec: TinyModelSpec, extra_model: Value, scheduler: Value) -> NodeProc {
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

fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .map(|v| v.trim().parse::<f64>().expect("number"))
        })
        .unwrap_or_else(|| panic!("{series} missing"))
}

async fn open_stream(
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
    let c = tokio::spawn({
        let base = node.base.clone();
        async move {
            http()
                .post(format!("{base}/v1/completions"))
                .json(&json!({"model": "tiny", "prompt": "C", "max_tokens": 5, "temperature": 0}))
                .send()
                .await
                .expect("c")
                .status()
                .as_u16()
        }
    });
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_pass_promtool_and_name_the_endpoint_picker_gauges() {
    let node = tiny_node(json!({}), json!({}));
    wait_ready(&node).await;
    let (s, _) = post(
        &node,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = post(
        &node,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200);
    let text = metrics_text(&node).await;
    for name in [
        "gantry_num_requests_waiting",
        "gantry_num_requests_running",
        "gantry_kv_cache_usage_perc",
        "gantry_time_to_first_token_seconds_bucket",
        "gantry_inter_token_latency_seconds_bucket",
        "gantry_model_load_seconds",
    ] {
        assert!(text.contains(name), "{name} missing");
    }
    assert_eq!(
        metric_value(&text, "gantry_response_cache_hits_total{model=\"tiny\"}"),
        1.0,
        "the second greedy request was a cache hit"
    );
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; scripts/setup.sh installs it)");
    std::io::Write::write_all(promtool.stdin.as_mut().expect("stdin"), text.as_bytes())
        .expect("write");
    let out = promtool.wait_with_output().expect("promtool");
    // The endpoint picker's series carry vLLM's names, whose `:` promtool's linter flags (it
    // reserves colons for recording rules); that is the only complaint allowed, and only for them.
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let other: Vec<&str> = report
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !(l.starts_with("vllm:") && l.contains("metric names should not contain ':'")))
        .collect();
    assert!(other.is_empty(), "promtool check metrics failed:\n{report}");
    // The endpoint picker's defaults (gateway-api-inference-extension, see
    // docs/observability.md): one node-wide gauge each, KV use as a fraction.
    for name in gantry_node::metrics::EPP_METRIC_NAMES {
        assert!(
            text.contains(&format!("# TYPE {name} gauge")),
            "{name} is not exported as a gauge"
        );
    }
    assert_eq!(metric_value(&text, "vllm:num_requests_waiting"), 0.0);
    let kv = metric_value(&text, "vllm:kv_cache_usage_perc");
    assert!((0.0..=1.0).contains(&kv), "{kv}");
    assert!(
        text.lines().any(|l| l
            .starts_with("vllm:cache_config_info{block_size=\"1\",num_gpu_blocks=\"")
            && l.ends_with(" 1")),
        "cache_config_info with the KV geometry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_fails_readiness_at_once_and_lets_inflight_streams_finish() {
    let node = tiny_node(
        json!({"requestTimeoutSeconds": 0}),
        json!({"responseCacheRamFraction": 0.0, "shutdownGraceSeconds": 30}),
    );
    wait_ready(&node).await;
    let mut streams = Vec::new();
    for _ in 0..3 {
        streams.push(open_stream(&node, 600).await);
    }
    for s in &mut streams {
        s.recv().await.expect("first chunk");
    }
    let pid = node.child.id().to_string();
    let ok = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(ok.success());
    let c = http();
    let t0 = Instant::now();
    loop {
        let r = c
            .get(format!("{}/readyz", node.base))
            .send()
            .await
            .expect("readyz while draining");
        if r.status() == 503 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "readyz still 200 after SIGTERM"
        );
    }
    let (code, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "late", "max_tokens": 2}),
    )
    .await;
    assert_eq!(code, 503, "{v}");
    for (i, mut s) in streams.into_iter().enumerate() {
        let mut chunks = Vec::new();
        while let Some(d) = s.recv().await {
            chunks.push(d);
        }
        assert_eq!(
            chunks.last().map(String::as_str),
            Some("[DONE]"),
            "stream {i} lost"
        );
        let fin: Value = serde_json::from_str(&chunks[chunks.len() - 2]).expect("final");
        assert_eq!(
            fin["choices"][0]["finish_reason"], "length",
            "stream {i} ran to max_tokens"
        );
    }
    let mut node = node;
    let exit = tokio::task::spawn_blocking(move || {
        let st = node.child.wait().expect("wait");
        (st, node)
    })
    .await
    .expect("join");
    assert!(exit.0.success(), "exit status {:?}", exit.0);
}

#[test]
fn the_node_answers_healthz_right_after_start() {
    // Listening comes first; plugin discovery and model loads happen behind it.
    // The time it takes is measured by bench/node_vs_llama_server.py (`cold_start`), not asserted here.
    let (_dir, p) = tiny_dir(TinyModelSpec::default());
    let port = free_port();
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gantry-node"))
        .args(["serve", "--model"])
        .arg(&p)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--plugins-dir")
        .arg(profile_dir().join("engines"))
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut healthy_at = None;
    while t0.elapsed() < Duration::from_secs(10) {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            let _ = s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n");
            let mut resp = String::new();
            let _ = s.read_to_string(&mut resp);
            if resp.starts_with("HTTP/1.0 200") || resp.starts_with("HTTP/1.1 200") {
                healthy_at = Some(t0.elapsed());
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
    let healthy_at = healthy_at.expect("no 200 from /healthz within 10 s of exec");
    eprintln!("healthz answered {healthy_at:?} after exec");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_take_requests_in_turn_and_status_shows_each_one() {
    // Two engine instances of one sequence each: two streams run at once only because they
    // went to different replicas, and a third waits on the replica whose turn it is.
    let node = tiny_node(
        json!({"requestTimeoutSeconds": 0, "maxBatchSize": 1, "replicas": 2}),
        json!({"responseCacheRamFraction": 0.0}),
    );
    wait_ready(&node).await;
    let s = status(&node).await;
    let replicas = s["models"][0]["replicas"].as_array().expect("replicas");
    assert_eq!(replicas.len(), 2, "{s}");
    let capacity: u64 = replicas
        .iter()
        .map(|r| r["queue"]["kvCapacityTokens"].as_u64().expect("capacity"))
        .sum();
    assert_eq!(
        s["models"][0]["queue"]["kvCapacityTokens"].as_u64(),
        Some(capacity),
        "the model's KV is its replicas' together: {s}"
    );
    let bytes: u64 = replicas
        .iter()
        .map(|r| r["bytesUsed"].as_u64().expect("bytes"))
        .sum();
    assert!(replicas.iter().all(|r| r["bytesUsed"].as_u64() > Some(0)));
    assert_eq!(s["models"][0]["load"]["bytesUsed"].as_u64(), Some(bytes));

    let mut a = open_stream(&node, 1800).await;
    let mut b = open_stream(&node, 1800).await;
    for _ in 0..3 {
        a.recv().await.expect("a chunk");
        b.recv().await.expect("b chunk");
    }
    let s = status(&node).await;
    let running = |s: &Value, i: usize| s["models"][0]["replicas"][i]["queue"]["running"].clone();
    assert_eq!(
        (running(&s, 0), running(&s, 1)),
        (json!(1), json!(1)),
        "{s}"
    );
    assert_eq!(s["models"][0]["queue"]["running"], 2, "{s}");
    let metrics = metrics_text(&node).await;
    assert_eq!(
        metric_value(&metrics, "gantry_num_requests_running{model=\"tiny\"}"),
        2.0,
        "the gauge sums the replicas"
    );
    // The third request is replica 0's turn again: it waits there while replica 1 is busy too.
    let c = tokio::spawn({
        let base = node.base.clone();
        async move {
            http()
                .post(format!("{base}/v1/completions"))
                .json(&json!({"model": "tiny", "prompt": "C", "max_tokens": 5, "temperature": 0}))
                .send()
                .await
                .expect("c")
                .status()
                .as_u16()
        }
    });
    let t0 = Instant::now();
    loop {
        let s = status(&node).await;
        if s["models"][0]["replicas"][0]["queue"]["waiting"] == 1 {
            assert_eq!(s["models"][0]["replicas"][1]["queue"]["waiting"], 0, "{s}");
            assert_eq!(s["models"][0]["queue"]["waiting"], 1, "{s}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "C never queued: {s}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(a); // replica 0's slot frees, and C runs there
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), c)
            .await
            .expect("C admitted")
            .expect("join"),
        200
    );
    drop(b);
}

/// A plugin tree with the real llama.cpp plugin and the `faulty` plugin, whose manifest also
/// claims the `llama` architecture: two engines that both support a tiny llama GGUF.
fn two_engines(root: &Path) -> PathBuf {
    let plugins = root.join("plugins");
    std::fs::create_dir_all(&plugins).expect("plugins dir");
    std::os::unix::fs::symlink(
        profile_dir().join("engines/llama_cpp"),
        plugins.join("llama_cpp"),
    )
    .expect("link the llama.cpp plugin");
    install_faulty_for(&plugins, &["toy", "llama"]);
    plugins
}

/// Start a node serving `file` as `tiny` from the two-engine tree, its cache in `cache`.
fn choice_node(plugins: &Path, file: &Path, cache: &Path, extra: Value) -> NodeProc {
    let mut model = json!({"id": "tiny", "path": file, "format": "gguf", "contextLength": 512, "maxBatchSize": 2});
    if let (Some(m), Some(e)) = (model.as_object_mut(), extra.as_object()) {
        m.extend(e.clone());
    }
    let config = json!({"models": [model], "cacheDir": cache});
    spawn_node(
        &config,
        plugins,
        tempfile::tempdir().expect("tempdir"),
        |_| {},
    )
}

fn candidates(status: &Value) -> Vec<(String, String, bool)> {
    status["models"][0]["engineChoice"]["candidates"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    (
                        c["plugin"].as_str().unwrap_or_default().to_string(),
                        c["outcome"].as_str().unwrap_or_default().to_string(),
                        c["cached"].as_bool().unwrap_or(false),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_engines_for_one_model_are_measured_and_the_best_serves_it() {
    let root = tempfile::tempdir().expect("tempdir");
    let plugins = two_engines(root.path());
    let cache = root.path().join("cache");
    // The fault plugin reads its behaviour from the file name, the cache keys by content:
    // each file gets its own weights (seed).
    let model = |stem: &str, seed: u64| {
        let p = root.path().join(format!("{stem}.gguf"));
        let spec = TinyModelSpec {
            seed,
            ..TinyModelSpec::default()
        };
        write_tiny_gguf(&p, &spec).expect("tiny gguf");
        p
    };

    // `sluggish*`: the faulty engine sleeps 250 ms per step; the real engine on the tiny model
    // is far faster (even on a CPU shared with other tests), so it serves, and both
    // candidates' figures are in the status.
    let slow = model("sluggish-tiny", 1);
    let node = choice_node(&plugins, &slow, &cache, json!({}));
    wait_ready(&node).await;
    let s = status(&node).await;
    let choice = &s["models"][0]["engineChoice"];
    assert_eq!(choice["chosen"], "llama_cpp", "{choice}");
    assert!(
        choice["rule"]
            .as_str()
            .is_some_and(|r| r.contains("highest decode tokens/s"))
    );
    assert_eq!(
        candidates(&s),
        vec![
            ("faulty".to_string(), "slower".to_string(), false),
            ("llama_cpp".to_string(), "chosen".to_string(), false)
        ]
    );
    for c in choice["candidates"].as_array().expect("candidates") {
        assert!(
            c["tokensPerSecond"].as_f64().is_some_and(|t| t > 0.0),
            "{c}"
        );
        assert!(c["ttftMs"].as_f64().is_some_and(|t| t > 0.0), "{c}");
        assert!(c["peakBytes"].as_u64().is_some(), "{c}");
    }
    let slow_tps = choice["candidates"][0]["tokensPerSecond"]
        .as_f64()
        .unwrap_or(0.0);
    assert!(
        slow_tps < 4.5,
        "250 ms a step is at most 4 tokens/s: {slow_tps}"
    );
    assert_eq!(s["models"][0]["load"]["plugin"], "llama_cpp");
    assert_eq!(
        s["models"][0]["verdict"]["plugin"], "llama_cpp",
        "{}",
        s["models"][0]["verdict"]
    );
    let (code, v) = post(
        &node,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    drop(node);

    // The same model again: the figures come from the cache, nothing is measured.
    let node = choice_node(&plugins, &slow, &cache, json!({}));
    wait_ready(&node).await;
    let s = status(&node).await;
    assert_eq!(
        candidates(&s),
        vec![
            ("faulty".to_string(), "slower".to_string(), true),
            ("llama_cpp".to_string(), "chosen".to_string(), true)
        ]
    );
    drop(node);

    // A candidate that cannot load is `failed` with its reason; the other serves.
    let oom = model("oom-tiny", 2);
    let node = choice_node(&plugins, &oom, &cache, json!({}));
    wait_ready(&node).await;
    let s = status(&node).await;
    let choice = &s["models"][0]["engineChoice"];
    assert_eq!(choice["chosen"], "llama_cpp");
    assert_eq!(choice["candidates"][0]["outcome"], "failed");
    assert!(
        choice["candidates"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("does not fit (by design)")),
        "{choice}"
    );
    drop(node);

    // A pinned engine is not measured: the pin serves and there is no choice to show.
    let node = choice_node(&plugins, &slow, &cache, json!({"engine": "faulty"}));
    wait_ready(&node).await;
    let s = status(&node).await;
    assert!(
        s["models"][0].get("engineChoice").is_none(),
        "{}",
        s["models"][0]
    );
    assert_eq!(s["models"][0]["load"]["plugin"], "faulty");
}
