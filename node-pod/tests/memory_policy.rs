//! Memory policy tests (node state, before and after each model load): the real `gantry-node`
//! binary with the real llama.cpp plugin, three tiny lazy models and a RAM limit that holds two —
//! the least-recently-used idle model is unloaded and reloads on demand, and a model that can
//! never fit is refused with OOM_RAM without disturbing the others. The fault-injection plugin
//! adds what llama.cpp cannot do on cue: a model kept busy by a hung step, and an engine that
//! refuses a load with OOM_VRAM.

mod common;

use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use common::{NodeProc, http, install_faulty, profile_dir, spawn_node, wait_ready};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};
use serde_json::{Value, json};

fn start(config: Value, ram_limit: u64, dir: tempfile::TempDir) -> NodeProc {
    start_with(config, &profile_dir().join("engines"), ram_limit, dir)
}

fn start_with(config: Value, plugins: &Path, ram_limit: u64, dir: tempfile::TempDir) -> NodeProc {
    spawn_node(&config, plugins, dir, |cmd| {
        cmd.args(["--ram-limit", &ram_limit.to_string(), "--threads", "2"]);
    })
}

async fn get(node: &NodeProc, path: &str) -> reqwest::Response {
    http()
        .get(format!("{}{path}", node.base))
        .send()
        .await
        .expect("GET")
}

/// A short greedy completion; returns the status and body.
async fn complete(node: &NodeProc, model: &str) -> (u16, Value) {
    let r = http()
        .post(format!("{}/v1/completions", node.base))
        .json(&json!({"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `model id -> (load state, message)` from `/v1/status`.
async fn loads(node: &NodeProc) -> std::collections::BTreeMap<String, (String, String)> {
    let v: Value = get(node, "/v1/status").await.json().await.expect("json");
    v["models"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| {
            (
                m["id"].as_str().expect("id").to_string(),
                (
                    m["load"]["state"].as_str().expect("state").to_string(),
                    m["load"]["message"].as_str().unwrap_or("").to_string(),
                ),
            )
        })
        .collect()
}

fn loaded(l: &std::collections::BTreeMap<String, (String, String)>) -> Vec<&str> {
    l.iter()
        .filter(|(_, (s, _))| s == "loaded")
        .map(|(id, _)| id.as_str())
        .collect()
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .map(|v| v.trim().parse().expect("number"))
        })
        .unwrap_or(0.0)
}

/// Per-model settings: context and sequences decide the KV cache.
const CTX: u64 = 256;
const SEQS: u64 = 2;
/// KV bytes per context cell of the default tiny model: 2 layers x 2 KV heads x (16 + 16) x 2 bytes.
const KV_PER_CELL: u64 = 256;

fn write_model(dir: &Path, stem: &str, seed: u64) -> PathBuf {
    let p = dir.join(format!("{stem}.gguf"));
    let spec = TinyModelSpec {
        seed,
        ..TinyModelSpec::default()
    };
    write_tiny_gguf(&p, &spec).expect("tiny gguf");
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_least_recently_used_idle_model_is_unloaded_and_one_that_never_fits_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut models = Vec::new();
    let mut estimate = 0;
    for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
        let sub = dir.path().join(id);
        std::fs::create_dir_all(&sub).expect("dir");
        let p = write_model(&sub, id, i as u64);
        // What the node estimates before a load: the file plus the KV cache.
        estimate = std::fs::metadata(&p).expect("size").len() + KV_PER_CELL * CTX * SEQS;
        models.push(
            json!({"id": id, "path": p, "format": "gguf", "load": "lazy",
                           "contextLength": CTX, "maxBatchSize": SEQS}),
        );
    }
    // The same weights with a context far beyond the node's RAM: it can never load.
    let sub = dir.path().join("huge");
    std::fs::create_dir_all(&sub).expect("dir");
    let p = write_model(&sub, "huge", 9);
    models.push(
        json!({"id": "huge", "path": p, "format": "gguf", "load": "lazy",
                       "contextLength": 2048, "maxBatchSize": 8}),
    );
    // Two models fit under the 90 % watermark, three do not.
    let limit = estimate * 5 / 2;
    let config = json!({"models": models, "scheduler": {"responseCacheRamFraction": 0.0}});
    let node = start(config, limit, dir);
    wait_ready(&node).await;
    assert!(
        loaded(&loads(&node).await).is_empty(),
        "lazy models start unloaded"
    );

    for id in ["a", "b"] {
        let (s, v) = complete(&node, id).await;
        assert_eq!(s, 200, "{id}: {v}");
    }
    assert_eq!(loaded(&loads(&node).await), ["a", "b"]);

    // A third model passes the watermark: `a`, used least recently, goes.
    let (s, v) = complete(&node, "c").await;
    assert_eq!(s, 200, "{v}");
    let l = loads(&node).await;
    assert_eq!(loaded(&l), ["b", "c"]);
    let (state, msg) = &l["a"];
    assert_eq!(state, "unloaded");
    assert!(
        msg.contains("least recently used") && msg.contains("RAM use") && msg.contains("`c`"),
        "{msg}"
    );

    // `b` loaded before `c` but is used after it, so `c` is now the least recently used:
    // the policy follows use, not load order. `a` reloads on its request.
    let (s, v) = complete(&node, "b").await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = complete(&node, "a").await;
    assert_eq!(s, 200, "a reloads: {v}");
    let l = loads(&node).await;
    assert_eq!(loaded(&l), ["a", "b"]);
    assert_eq!(l["c"].0, "unloaded");
    assert!(l["a"].1.is_empty(), "a reloaded, no message: {:?}", l["a"]);

    // A model larger than the whole limit is refused with OOM_RAM (507) before anything
    // is allocated, and nothing loaded is disturbed.
    let (s, v) = complete(&node, "huge").await;
    assert_eq!(s, 507, "{v}");
    assert_eq!(v["error"]["code"], "oom_ram", "{v}");
    assert_eq!(v["error"]["type"], "insufficient_storage", "{v}");
    let err = v["error"]["message"].as_str().expect("message");
    assert!(
        err.starts_with("OOM_RAM: model `huge` needs") && err.contains("can never be loaded"),
        "{err}"
    );
    let l = loads(&node).await;
    assert_eq!(loaded(&l), ["a", "b"], "the refusal unloaded nothing");
    let (state, msg) = &l["huge"];
    assert_eq!(state, "failed");
    assert!(msg.starts_with("OOM_RAM:") && msg.contains("KV"), "{msg}");
    for id in ["a", "b"] {
        let (s, v) = complete(&node, id).await;
        assert_eq!(s, 200, "{id} still serves: {v}");
    }
    assert_eq!(get(&node, "/healthz").await.status(), 200);
    assert_eq!(
        get(&node, "/readyz").await.status(),
        200,
        "lazy refusals keep the node ready"
    );

    let text = get(&node, "/metrics").await.text().await.expect("metrics");
    let unloads = |m: &str| {
        metric(
            &text,
            &format!("gantry_model_unloads_total{{model=\"{m}\",reason=\"ram_watermark\"}}"),
        )
    };
    assert_eq!((unloads("a"), unloads("b"), unloads("c")), (1.0, 0.0, 1.0));
    assert_eq!(
        metric(
            &text,
            "gantry_model_load_refusals_total{code=\"OOM_RAM\",model=\"huge\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&text, "gantry_memory_limit_bytes{pool=\"ram\"}"),
        limit as f64
    );
    let used = metric(&text, "gantry_memory_used_bytes{pool=\"ram\"}");
    assert!(
        used > 0.0 && used <= (limit - limit / 10) as f64,
        "two models under the watermark: {used} of {limit}"
    );
    // `/v1/status` reports the same pool (the gateway places a cold model by its room).
    let v: Value = get(&node, "/v1/status").await.json().await.expect("json");
    let mem = &v["memory"];
    assert_eq!(mem["pool"], "ram", "{mem}");
    assert_eq!(mem["limitBytes"].as_u64(), Some(limit), "{mem}");
    assert_eq!(
        mem["watermarkBytes"].as_u64(),
        Some(limit / 100 * 90 + limit % 100 * 90 / 100),
        "{mem}"
    );
    assert_eq!(
        mem["usedBytes"].as_u64().map(|u| u as f64),
        Some(used),
        "{mem}"
    );
}

/// `(waiting, running)` of one model's queue from `/v1/status`.
async fn queue(node: &NodeProc, id: &str) -> (u64, u64) {
    let v: Value = get(node, "/v1/status").await.json().await.expect("json");
    let m = v["models"]
        .as_array()
        .expect("models")
        .iter()
        .find(|m| m["id"] == id)
        .cloned()
        .expect("model");
    (
        m["queue"]["waiting"].as_u64().unwrap_or(0),
        m["queue"]["running"].as_u64().unwrap_or(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_model_is_never_unloaded_and_an_engine_oom_is_reported_as_such() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugins = dir.path().join("plugins");
    install_faulty(&plugins);
    // The faulty plugin's behaviour follows the file name: `hang*` never finishes a step,
    // `oom*` is refused by the engine with OOM_VRAM.
    let mut models = Vec::new();
    let mut estimate = 0;
    for id in ["hang", "b", "c", "oom"] {
        let sub = dir.path().join(id);
        std::fs::create_dir_all(&sub).expect("dir");
        let p = sub.join(format!("{id}.gguf"));
        let spec = TinyModelSpec {
            architecture_name_override: Some("toy".into()),
            ..TinyModelSpec::default()
        };
        write_tiny_gguf(&p, &spec).expect("toy gguf");
        estimate = std::fs::metadata(&p).expect("size").len() + KV_PER_CELL * CTX * SEQS;
        models.push(
            json!({"id": id, "path": p, "format": "gguf", "load": "lazy",
                           "contextLength": CTX, "maxBatchSize": SEQS,
                           "requestTimeoutSeconds": 0}),
        );
    }
    let limit = estimate * 5 / 2;
    let config = json!({"models": models,
                        "scheduler": {"responseCacheRamFraction": 0.0, "stepTimeoutSeconds": 600}});
    let node = start_with(config, &plugins, limit, dir);
    wait_ready(&node).await;

    // `hang` is used first and stays busy: its step never returns.
    let base = node.base.clone();
    let hung = tokio::spawn(async move {
        let _ = http()
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "hang", "prompt": "x", "max_tokens": 4}))
            .send()
            .await;
    });
    let t0 = Instant::now();
    while queue(&node, "hang").await == (0, 0) {
        assert!(t0.elapsed() < Duration::from_secs(30), "hang never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The engine refuses `oom` with OOM_VRAM; it fits the node's budget, so nothing was
    // unloaded for it, and the refusal is reported with the engine's code.
    let (s, v) = complete(&node, "oom").await;
    assert_eq!(s, 507, "{v}");
    assert_eq!(v["error"]["code"], "oom_vram", "{v}");
    let err = v["error"]["message"].as_str().expect("message");
    assert!(
        err.starts_with("OOM_VRAM: the engine refused model `oom`"),
        "{err}"
    );
    let l = loads(&node).await;
    assert_eq!(l["oom"].0, "failed");
    assert!(
        l["oom"].1.contains("does not fit (by design)"),
        "{:?}",
        l["oom"]
    );

    let (s, v) = complete(&node, "b").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(loaded(&loads(&node).await), ["b", "hang"]);
    // `hang` is the least recently used, but busy: the idle `b` makes room for `c`.
    let (s, v) = complete(&node, "c").await;
    assert_eq!(s, 200, "{v}");
    let l = loads(&node).await;
    assert_eq!(loaded(&l), ["c", "hang"]);
    assert!(
        l["b"].1.contains("least recently used idle model"),
        "{:?}",
        l["b"]
    );
    // `b` comes back by unloading the idle `c`, never the busy `hang`.
    let (s, v) = complete(&node, "b").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(loaded(&loads(&node).await), ["b", "hang"]);
    hung.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_model_with_a_draft_model_counts_the_drafts_instance_before_it_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut estimate = 0;
    let mut paths = Vec::new();
    for (i, id) in ["draft", "target", "plain"].into_iter().enumerate() {
        let sub = dir.path().join(id);
        std::fs::create_dir_all(&sub).expect("dir");
        let p = write_model(&sub, id, i as u64);
        estimate = std::fs::metadata(&p).expect("size").len() + KV_PER_CELL * CTX * SEQS;
        paths.push(p);
    }
    let entry = |id: &str, p: &Path| {
        json!({"id": id, "path": p, "format": "gguf", "load": "lazy",
               "contextLength": CTX, "maxBatchSize": SEQS})
    };
    let mut target = entry("target", &paths[1]);
    target["speculation"] = json!({"method": "draftModel", "draftModel": "draft"});
    let config = json!({
        "models": [entry("draft", &paths[0]), target, entry("plain", &paths[2])],
        "scheduler": {"responseCacheRamFraction": 0.0},
    });
    // One model fits under the 90 % watermark; a model and its draft's instance do not.
    let limit = estimate * 3 / 2;
    let node = start(config, limit, dir);
    wait_ready(&node).await;
    let (s, v) = complete(&node, "target").await;
    assert_eq!(s, 507, "the target and its draft do not fit: {v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("draft model `draft`: weights"),
        "the estimate names the draft's share: {message}"
    );
    // The same model without a draft fits.
    let (s, v) = complete(&node, "plain").await;
    assert_eq!(s, 200, "{v}");
}
