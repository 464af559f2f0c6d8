//! Config reload tests (node state, beside the request path): the real `gantry-node` binary with
//! the real llama.cpp plugin and tiny GGUF models, its config rewritten under it the way kubelet
//! updates a ConfigMap volume (a new `..data` directory swapped in by one rename). A reload
//! adds a model without touching a running stream, removes one only after its streams end
//! (404 for new requests at once), refuses an invalid file while the old models keep serving,
//! and `/v1/status` `configHash` names the file in force.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::node_metrics as metrics;
use common::{NodeProc, http, profile_dir, spawn_node_with_config, stream, wait_ready};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};
use serde_json::{Value, json};
use sha2::Digest as _;

/// Tokens the long streams generate: with the wide model below, seconds of work.
const STREAM_TOKENS: u64 = 600;

/// A config directory laid out as kubelet lays out a ConfigMap volume:
/// `models.yaml -> ..data/models.yaml`, `..data -> ..vN`. A new version goes into a fresh
/// `..vN` and `..data` is swapped to it by an atomic rename, so a reader sees the old file or
/// the new one whole.
struct ConfigMapDir {
    root: PathBuf,
    version: u32,
}

impl ConfigMapDir {
    fn new(root: &Path, config: &Value) -> Self {
        let mut d = ConfigMapDir {
            root: root.to_path_buf(),
            version: 0,
        };
        d.write(config);
        std::os::unix::fs::symlink("..data/models.yaml", d.path()).expect("models.yaml link");
        d
    }

    fn path(&self) -> PathBuf {
        self.root.join("models.yaml")
    }

    /// Swap in `config` as YAML; returns the bytes written.
    fn write(&mut self, config: &Value) -> Vec<u8> {
        self.write_text(&serde_yaml::to_string(config).expect("yaml"))
    }

    fn write_text(&mut self, text: &str) -> Vec<u8> {
        self.version += 1;
        let dir = format!("..v{}", self.version);
        std::fs::create_dir(self.root.join(&dir)).expect("version dir");
        std::fs::write(self.root.join(&dir).join("models.yaml"), text).expect("write");
        let tmp = self.root.join("..data_tmp");
        std::os::unix::fs::symlink(&dir, &tmp).expect("data link");
        std::fs::rename(&tmp, self.root.join("..data")).expect("swap ..data");
        text.as_bytes().to_vec()
    }
}

/// The operator's `short_hash`: the first 8 bytes of the sha256, in hex.
fn short_hash(bytes: &[u8]) -> String {
    hex::encode(&sha2::Sha256::digest(bytes)[..8])
}

/// A model wide enough that a long stream takes seconds on any machine.
fn wide_spec() -> TinyModelSpec {
    TinyModelSpec {
        n_embd: 512,
        n_ff: 1024,
        n_layer: 8,
        n_head: 8,
        n_head_kv: 8,
        ..TinyModelSpec::default()
    }
}

fn write_model(dir: &Path, id: &str, spec: &TinyModelSpec) -> PathBuf {
    let p = dir.join(format!("{id}.gguf"));
    write_tiny_gguf(&p, spec).expect("tiny gguf");
    p
}

fn model(id: &str, path: &Path, ctx: u32) -> Value {
    json!({"id": id, "path": path, "format": "gguf", "contextLength": ctx, "maxBatchSize": 2,
           "requestTimeoutSeconds": 0})
}

fn config(models: &[Value]) -> Value {
    json!({"models": models,
           "scheduler": {"responseCacheRamFraction": 0.0, "shutdownGraceSeconds": 60}})
}

/// Start the node on the ConfigMap-style directory `cm` inside `dir`.
fn start(cm: &ConfigMapDir, dir: tempfile::TempDir, reload_seconds: u32) -> NodeProc {
    spawn_node_with_config(&cm.path(), &profile_dir().join("engines"), dir, |cmd| {
        cmd.args(["--config-reload-seconds", &reload_seconds.to_string()]);
    })
}

fn sighup(node: &NodeProc) {
    let ok = Command::new("kill")
        .args(["-HUP", &node.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(ok.success());
}

async fn get_json(node: &NodeProc, path: &str) -> Value {
    http()
        .get(format!("{}{path}", node.base))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("json")
}

/// The value of one series, `None` when it is not exported.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .filter(|v| v.starts_with(' '))
            .map(|v| v.trim().parse().expect("number"))
    })
}

async fn complete(node: &NodeProc, model: &str) -> (u16, Value) {
    let r = http()
        .post(format!("{}/v1/completions", node.base))
        .json(&json!({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `id -> ready` from `/v1/models`.
async fn listed(node: &NodeProc) -> Vec<(String, bool, Option<u64>)> {
    get_json(node, "/v1/models").await["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| {
            (
                m["id"].as_str().expect("id").to_string(),
                m["ready"].as_bool().expect("ready"),
                m["context_length"].as_u64(),
            )
        })
        .collect()
}

/// Poll `cond` every 50 ms for at most `limit`; panics with `what` when it never holds.
async fn until<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !cond().await {
        assert!(t0.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn config_hash(node: &NodeProc) -> Option<String> {
    get_json(node, "/v1/status").await["configHash"]
        .as_str()
        .map(str::to_string)
}

/// A long greedy completion stream on `model`, its first chunk already read.
async fn long_stream(node: &NodeProc, model: &str) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let mut rx = stream(
        node,
        "/v1/completions",
        json!({"model": model, "prompt": "Once", "max_tokens": STREAM_TOKENS, "temperature": 0,
               "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    rx.recv().await.expect("first chunk");
    rx
}

/// Read a stream to its end: it must end with `[DONE]` after `STREAM_TOKENS` tokens.
async fn finish(rx: tokio::sync::mpsc::UnboundedReceiver<String>, what: &str) {
    finish_n(rx, STREAM_TOKENS, what).await
}

/// Read a stream to its end: it must end with `[DONE]` after `tokens` tokens.
async fn finish_n(mut rx: tokio::sync::mpsc::UnboundedReceiver<String>, tokens: u64, what: &str) {
    let mut events = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(d) = rx.recv().await {
            events.push(d);
        }
    })
    .await;
    assert!(read.is_ok(), "{what}: the stream did not end within 300 s");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{what}");
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).expect("usage chunk");
    assert_eq!(
        usage["usage"]["completion_tokens"].as_u64(),
        Some(tokens),
        "{what}: every token arrived: {usage}"
    );
    let fin: Value = serde_json::from_str(&events[events.len() - 3]).expect("final chunk");
    assert_eq!(
        fin["choices"][0]["finish_reason"], "length",
        "{what}: {fin}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reload_adds_a_model_while_a_stream_on_another_runs_to_its_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = write_model(dir.path(), "a", &wide_spec());
    let b = write_model(dir.path(), "b", &TinyModelSpec::default());
    let mut cm = ConfigMapDir::new(dir.path(), &config(&[model("a", &a, 2048)]));
    let node = start(&cm, dir, 0);
    wait_ready(&node).await;
    assert_eq!(listed(&node).await.len(), 1);

    let rx = long_stream(&node, "a").await;
    let bytes = cm.write(&config(&[model("a", &a, 2048), model("b", &b, 512)]));
    sighup(&node);
    let want = short_hash(&bytes);
    until(Duration::from_secs(10), "the reload applied", || async {
        config_hash(&node).await.as_deref() == Some(want.as_str())
    })
    .await;
    // The stream on `a` is still generating: the reload did not wait for it, nor cut it.
    let m = metrics(&node).await;
    assert_eq!(
        metric(&m, "gantry_num_requests_running{model=\"a\"}"),
        Some(1.0),
        "the stream on a runs across the reload"
    );
    assert_eq!(
        metric(&m, "gantry_config_reloads_total{result=\"applied\"}"),
        Some(1.0)
    );
    // A model added by a reload does not take readiness away while it loads.
    let ready = http()
        .get(format!("{}/readyz", node.base))
        .send()
        .await
        .expect("readyz");
    assert_eq!(ready.status(), 200);
    until(Duration::from_secs(30), "b listed and ready", || async {
        listed(&node).await.iter().any(|(id, r, _)| id == "b" && *r)
    })
    .await;
    let (s, v) = complete(&node, "b").await;
    assert_eq!(s, 200, "b serves: {v}");
    finish(rx, "the stream on a").await;
    let (s, v) = complete(&node, "a").await;
    assert_eq!(s, 200, "a still serves: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_removed_model_answers_404_at_once_finishes_its_streams_then_is_unloaded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = write_model(dir.path(), "a", &wide_spec());
    let b = write_model(dir.path(), "b", &TinyModelSpec::default());
    let mut cm = ConfigMapDir::new(
        dir.path(),
        &config(&[model("a", &a, 2048), model("b", &b, 512)]),
    );
    let node = start(&cm, dir, 0);
    wait_ready(&node).await;
    let used = |s: &Value| s["memory"]["usedBytes"].as_u64().expect("usedBytes");
    let before = used(&get_json(&node, "/v1/status").await);
    let a_bytes = metric(
        &metrics(&node).await,
        "gantry_model_memory_bytes{model=\"a\"}",
    )
    .expect("a's memory") as u64;
    assert!(a_bytes > 0 && before > a_bytes, "{a_bytes} of {before}");

    let rx = long_stream(&node, "a").await;
    let bytes = cm.write(&config(&[model("b", &b, 512)]));
    sighup(&node);
    let want = short_hash(&bytes);
    until(Duration::from_secs(10), "the reload applied", || async {
        config_hash(&node).await.as_deref() == Some(want.as_str())
    })
    .await;
    // At once: `a` is unknown to new requests and gone from the listings...
    let (s, v) = complete(&node, "a").await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    assert_eq!(
        listed(&node)
            .await
            .iter()
            .map(|m| m.0.as_str())
            .collect::<Vec<_>>(),
        ["b"]
    );
    let status = get_json(&node, "/v1/status").await;
    assert_eq!(
        status["models"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    // ...but it keeps its engine while its stream runs, and the policy still counts it.
    let m = metrics(&node).await;
    assert_eq!(
        metric(&m, "gantry_num_requests_running{model=\"a\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "gantry_model_unloads_total{model=\"a\",reason=\"config_removed\"}"
        ),
        None,
        "not unloaded while its stream runs"
    );
    assert_eq!(used(&status), before, "{status}");

    finish(rx, "the stream on the removed model").await;
    until(Duration::from_secs(10), "a unloaded", || async {
        metric(
            &metrics(&node).await,
            "gantry_model_unloads_total{model=\"a\",reason=\"config_removed\"}",
        ) == Some(1.0)
    })
    .await;
    let status = get_json(&node, "/v1/status").await;
    assert_eq!(
        used(&status),
        before - a_bytes,
        "a's memory is released: {status}"
    );
    let m = metrics(&node).await;
    assert_eq!(
        metric(&m, "gantry_model_memory_bytes{model=\"a\"}"),
        None,
        "a's gauges are gone"
    );
    assert_eq!(
        metric(&m, "gantry_memory_used_bytes{pool=\"ram\"}"),
        Some((before - a_bytes) as f64)
    );
    let (s, v) = complete(&node, "b").await;
    assert_eq!(s, 200, "b serves on: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_invalid_config_is_refused_and_a_changed_model_is_replaced_on_the_next_valid_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = write_model(dir.path(), "a", &TinyModelSpec::default());
    let b = write_model(dir.path(), "b", &TinyModelSpec::default());
    let mut cm = ConfigMapDir::new(dir.path(), &config(&[model("a", &a, 512)]));
    let first = std::fs::read(cm.path()).expect("config");
    // Polled every second: no signal in this test.
    let node = start(&cm, dir, 1);
    wait_ready(&node).await;
    let hash0 = short_hash(&first);
    assert_eq!(config_hash(&node).await.as_deref(), Some(hash0.as_str()));
    let reloads = |m: &str, result: &str| {
        metric(
            m,
            &format!("gantry_config_reloads_total{{result=\"{result}\"}}"),
        )
    };
    assert_eq!(reloads(&metrics(&node).await, "refused"), Some(0.0));

    // Against the rules (replicas 0), then not YAML at all: each refused once.
    let mut bad = model("a", &a, 512);
    bad["replicas"] = json!(0);
    cm.write(&config(&[bad]));
    until(
        Duration::from_secs(15),
        "the invalid file refused",
        || async { reloads(&metrics(&node).await, "refused") == Some(1.0) },
    )
    .await;
    cm.write_text("models: [\n");
    until(
        Duration::from_secs(15),
        "the broken file refused",
        || async { reloads(&metrics(&node).await, "refused") == Some(2.0) },
    )
    .await;
    assert_eq!(config_hash(&node).await.as_deref(), Some(hash0.as_str()));
    let (s, v) = complete(&node, "a").await;
    assert_eq!(s, 200, "the old model keeps serving: {v}");
    let m = metrics(&node).await;
    assert_eq!(reloads(&m, "applied"), Some(0.0));
    assert_eq!(
        reloads(&m, "refused"),
        Some(2.0),
        "each version refused once"
    );

    // `a` changes (its context), `b` is new, and a node-wide setting changes too.
    let mut next = config(&[model("a", &a, 1024), model("b", &b, 512)]);
    next["scheduler"]["stallTimeoutSeconds"] = json!(7);
    let bytes = cm.write(&next);
    let want = short_hash(&bytes);
    until(
        Duration::from_secs(15),
        "the valid file applied",
        || async { config_hash(&node).await.as_deref() == Some(want.as_str()) },
    )
    .await;
    let status = get_json(&node, "/v1/status").await;
    assert_eq!(
        status["restartRequired"],
        json!(["scheduler.stallTimeoutSeconds"]),
        "{status}"
    );
    until(
        Duration::from_secs(30),
        "a back with its new context, and b",
        || async {
            let l = listed(&node).await;
            l.contains(&("a".into(), true, Some(1024))) && l.iter().any(|m| m.0 == "b" && m.1)
        },
    )
    .await;
    for id in ["a", "b"] {
        let (s, v) = complete(&node, id).await;
        assert_eq!(s, 200, "{id}: {v}");
    }
    let m = metrics(&node).await;
    assert_eq!(
        metric(
            &m,
            "gantry_model_unloads_total{model=\"a\",reason=\"config_changed\"}"
        ),
        Some(1.0)
    );
    assert_eq!(reloads(&m, "applied"), Some(1.0));
}

/// `smollm2`'s adapters in `/v1/status`: `(name, state)`.
async fn adapter_states(node: &NodeProc) -> Vec<(String, String)> {
    let status = get_json(node, "/v1/status").await;
    let m = status["models"]
        .as_array()
        .expect("models")
        .iter()
        .find(|m| m["id"] == "smollm2")
        .cloned()
        .unwrap_or(Value::Null);
    m["adapters"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|a| {
                    (
                        a["name"].as_str().unwrap_or_default().to_string(),
                        a["state"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adding_and_removing_adapters_leaves_the_loaded_base_model_serving() {
    let Some(lora) = std::env::var_os("GANTRY_SMOLLM2_ADAPTERS").map(PathBuf::from) else {
        eprintln!(
            "SKIPPED: GANTRY_SMOLLM2_ADAPTERS is not set (the SmolLM2 test adapters of \
             testkit/python/smollm2_lora.py; scripts/test.sh's environment sets it)"
        );
        return;
    };
    let base = PathBuf::from(
        std::env::var_os("GANTRY_SMOLLM2_GGUF").expect("GANTRY_SMOLLM2_GGUF beside the adapters"),
    );
    let with = |names: &[&str]| {
        let adapters: Vec<Value> = names
            .iter()
            .map(|n| json!({"name": n, "path": lora.join(format!("{n}.gguf"))}))
            .collect();
        config(&[json!({"id": "smollm2", "path": base, "format": "gguf",
                          "contextLength": 1024, "maxBatchSize": 2, "adapters": adapters})])
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cm = ConfigMapDir::new(dir.path(), &with(&["pirate"]));
    let node = start(&cm, dir, 0);
    wait_ready(&node).await;
    until(Duration::from_secs(30), "pirate loaded", || async {
        adapter_states(&node).await == [("pirate".to_string(), "loaded".to_string())]
    })
    .await;

    // A stream on the base runs across both reloads (its own deadline: beside the other tests'
    // nodes on two cores it may crawl). Its end-of-generation tokens (`<|endoftext|>` 0,
    // `<|im_end|>` 2) are banned, so it runs its 200 tokens whatever the batches it shares
    // with the adapters' requests do to the last bits of its logits.
    let mut rx = stream(
        &node,
        "/v1/completions",
        json!({"model": "smollm2", "prompt": "Once", "max_tokens": 200, "temperature": 0,
               "timeout": 600, "stream": true, "stream_options": {"include_usage": true},
               "logit_bias": {"0": -100, "2": -100}}),
    )
    .await;
    rx.recv().await.expect("first chunk");
    cm.write(&with(&["pirate", "formal"]));
    sighup(&node);
    until(
        Duration::from_secs(30),
        "formal added and loaded",
        || async {
            adapter_states(&node).await
                == [
                    ("pirate".to_string(), "loaded".to_string()),
                    ("formal".to_string(), "loaded".to_string()),
                ]
        },
    )
    .await;
    // The base was not made again: it serves at once (a replaced model answers 503 until the
    // old one drained and the new one loaded).
    let (s, v) = complete(&node, "smollm2").await;
    assert_eq!(s, 200, "the base serves at once: {v}");
    let (s, v) = complete(&node, "smollm2:formal").await;
    assert_eq!(s, 200, "the added adapter serves: {v}");

    cm.write(&with(&["formal"]));
    sighup(&node);
    until(Duration::from_secs(30), "pirate gone", || async {
        adapter_states(&node).await == [("formal".to_string(), "loaded".to_string())]
    })
    .await;
    let (s, v) = complete(&node, "smollm2:pirate").await;
    assert_eq!(s, 404, "a removed adapter is unknown at once: {v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    until(
        Duration::from_secs(30),
        "pirate unloaded from the engine",
        || async {
            metric(
                &metrics(&node).await,
                "gantry_adapter_events_total{adapter=\"smollm2:pirate\",event=\"removed\"}",
            ) == Some(1.0)
        },
    )
    .await;
    let m = metrics(&node).await;
    assert_eq!(
        metric(&m, "gantry_config_reloads_total{result=\"applied\"}"),
        Some(2.0)
    );
    // A remade model would have unloaded the old one (`reason="config_changed"`).
    assert_eq!(
        metric(
            &m,
            "gantry_model_unloads_total{model=\"smollm2\",reason=\"config_changed\"}"
        ),
        None,
        "the base model was never unloaded"
    );
    finish_n(rx, 200, "the stream on the base, across both reloads").await;
    let (s, v) = complete(&node, "smollm2:formal").await;
    assert_eq!(s, 200, "the kept adapter still serves: {v}");
}
