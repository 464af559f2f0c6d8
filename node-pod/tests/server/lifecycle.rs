//! Node server tests, the node's life: metrics that pass promtool, SIGTERM's drain, and
//! `/healthz` right after exec.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::common::{node_metrics as metrics_text, post_json as post};
use crate::{metric_value, open_stream, tiny_dir, tiny_node};
use gantry_testkit::TinyModelSpec;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_pass_promtool_and_name_the_endpoint_picker_gauges() {
    let node = tiny_node(json!({}), json!({}));
    wait_ready(&node).await;
    for _ in 0..2 {
        let (s, _) = post(
            &node,
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}),
        )
        .await;
        assert_eq!(s, 200);
    }
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
