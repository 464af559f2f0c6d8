//! Node server tests, replicas and engines: a model's replicas take requests in turn, and of
//! several engines for one model the node measures each and serves with the best.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::common::{node_metrics as metrics_text, node_status as status, post_json as post};
use crate::{metric_value, open_stream, spawn_short_completion, tiny_node};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};
use serde_json::{Value, json};

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
    let c = spawn_short_completion(&node);
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
