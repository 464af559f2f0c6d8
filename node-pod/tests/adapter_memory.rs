//! LoRA adapters under the memory policy (node adapter table → memory policy): the real
//! `gantry-node` with the real llama.cpp plugin, SmolLM2 and its two test adapters, and a RAM
//! limit whose watermark holds the model and one adapter but not two. At start the first adapter
//! loads and the second waits (start-up loads evict nothing); a request for the second evicts
//! the idle first one; an adapter a stream is using is never evicted, and the request that
//! would need it gets the memory 507 while the stream finishes untouched. An adapter served
//! from a worker process (`process` isolation) answers as it does in the node process.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{
    NodeProc, http, node_metrics, node_status, post_json, profile_dir, serial_async, spawn_node,
    stream,
};
use serde_json::{Value, json};

fn adapters_dir() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("GANTRY_SMOLLM2_ADAPTERS")?);
    p.join("pirate.gguf").is_file().then_some(p)
}

fn smollm2() -> PathBuf {
    PathBuf::from(
        std::env::var_os("GANTRY_SMOLLM2_GGUF")
            .expect("GANTRY_SMOLLM2_GGUF: run scripts/setup.sh test (scripts/test.sh does)"),
    )
}

fn start(lora: &std::path::Path, ram_limit: u64) -> NodeProc {
    start_isolated(lora, ram_limit, "inProcess")
}

/// The node with the llama.cpp plugin in `isolation` (`inProcess` or `process`).
fn start_isolated(lora: &std::path::Path, ram_limit: u64, isolation: &str) -> NodeProc {
    let config = json!({
        "isolation": {"default": isolation},
        "models": [{
            "id": "smol", "path": smollm2(), "format": "gguf",
            "contextLength": 512, "maxBatchSize": 2,
            "adapters": [
                {"name": "pirate", "path": lora.join("pirate.gguf")},
                {"name": "formal", "path": lora.join("formal.gguf")},
                {"name": "bad-shape", "path": lora.join("bad-shape.gguf")},
            ],
        }],
        "scheduler": {"responseCacheRamFraction": 0.0},
    });
    let dir = tempfile::tempdir().expect("tempdir");
    spawn_node(&config, &profile_dir().join("engines"), dir, |cmd| {
        cmd.args(["--ram-limit", &ram_limit.to_string(), "--threads", "2"]);
    })
}

/// Wait until the node is ready and `loaded` adapters of `smol` have loaded (start-up loads
/// run in the background, in config order); the status then.
async fn settled(node: &NodeProc, loaded: usize) -> Value {
    for _ in 0..600 {
        if let Ok(r) = http().get(format!("{}/readyz", node.base)).send().await
            && r.status() == 200
        {
            let st = node_status(node).await;
            let n = st["models"][0]["adapters"]
                .as_array()
                .map_or(0, |a| a.iter().filter(|a| a["state"] == "loaded").count());
            if n >= loaded {
                // The next adapter's attempt, if any, has had time to run.
                tokio::time::sleep(Duration::from_millis(500)).await;
                return node_status(node).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{loaded} adapter(s) of the node did not load in 60 s");
}

/// `name -> state` of `smol`'s two good adapters.
async fn states(node: &NodeProc) -> Vec<(String, String)> {
    node_status(node).await["models"][0]["adapters"]
        .as_array()
        .expect("adapters")
        .iter()
        .take(2)
        .map(|a| {
            (
                a["name"].as_str().expect("name").to_string(),
                a["state"].as_str().expect("state").to_string(),
            )
        })
        .collect()
}

async fn complete(node: &NodeProc, model: &str) -> (u16, Value) {
    post_json(
        node,
        "/v1/completions",
        json!({"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}),
    )
    .await
}

fn evictions(metrics: &str, adapter: &str) -> f64 {
    let series = format!("gantry_adapter_events_total{{adapter=\"{adapter}\",event=\"evicted\"}}");
    metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(&series)
                .map(|v| v.trim().parse().expect("number"))
        })
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adapters_are_evicted_least_recently_used_and_never_while_in_use() {
    let _serial = serial_async().await;
    let Some(lora) = adapters_dir() else {
        panic!(
            "GANTRY_SMOLLM2_ADAPTERS is not set or holds no pirate.gguf: run scripts/setup.sh test (scripts/test.sh does)"
        );
    };
    // First, what the model and each adapter hold, with room for everything.
    let roomy = start(&lora, 64 << 30);
    let st = settled(&roomy, 2).await;
    let used = st["models"][0]["load"]["bytesUsed"]
        .as_u64()
        .expect("bytesUsed");
    let adapter_bytes: Vec<u64> = st["models"][0]["adapters"]
        .as_array()
        .expect("adapters")
        .iter()
        .take(2)
        .map(|a| a["bytes"].as_u64().expect("loaded with room to spare"))
        .collect();
    drop(roomy);
    let (a, b) = (adapter_bytes[0], adapter_bytes[1]);
    let base = used - a - b;
    // The 90 % watermark holds the model and one adapter, with half an adapter to spare.
    let limit = (base + a + b / 2) * 10 / 9 + 1;
    let node = start(&lora, limit);
    settled(&node, 1).await;
    assert_eq!(
        states(&node).await,
        [
            ("pirate".into(), "loaded".into()),
            ("formal".into(), "downloaded".into())
        ],
        "start-up loads what fits and evicts nothing"
    );

    // `formal` needs the room `pirate` holds; `pirate` is idle, so it goes.
    let (s, v) = complete(&node, "smol:formal").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        states(&node).await,
        [
            ("pirate".into(), "downloaded".into()),
            ("formal".into(), "loaded".into())
        ]
    );
    assert_eq!(evictions(&node_metrics(&node).await, "smol:pirate"), 1.0);

    // A stream holds `formal` (its end-of-generation tokens banned, so it runs its 200
    // tokens): `pirate` cannot evict it, and gets the memory 507.
    let mut events = stream(
        &node,
        "/v1/completions",
        json!({"model": "smol:formal", "prompt": "Tell me a long story", "max_tokens": 200,
               "temperature": 0, "stream": true, "logit_bias": {"0": -100, "2": -100}}),
    )
    .await;
    let first = events.recv().await.expect("a first event");
    assert!(first.contains("\"smol:formal\""), "{first}");
    let (s, v) = complete(&node, "smol:pirate").await;
    assert_eq!(s, 507, "{v}");
    assert_eq!(v["error"]["code"], "oom_ram", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("adapter")),
        "{v}"
    );
    let mut last = first;
    while let Some(ev) = events.recv().await {
        last = ev;
    }
    assert_eq!(last, "[DONE]", "the stream ended early");
    assert_eq!(
        states(&node).await,
        [
            ("pirate".into(), "downloaded".into()),
            ("formal".into(), "loaded".into())
        ]
    );

    // Once the stream ended, `formal` is idle and makes room for `pirate`.
    let (s, v) = complete(&node, "smol:pirate").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(evictions(&node_metrics(&node).await, "smol:formal"), 1.0);
    // The base model served throughout.
    let (s, v) = complete(&node, "smol").await;
    assert_eq!(s, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_adapter_in_a_worker_process_answers_as_in_process() {
    let _serial = serial_async().await;
    let Some(lora) = adapters_dir() else {
        panic!(
            "GANTRY_SMOLLM2_ADAPTERS is not set or holds no pirate.gguf: run scripts/setup.sh test (scripts/test.sh does)"
        );
    };
    let ask = json!({"model": "smol:pirate", "prompt": "The sea is", "max_tokens": 16,
                     "temperature": 0, "seed": 1});
    let mut answers = Vec::new();
    for isolation in ["inProcess", "process"] {
        let node = start_isolated(&lora, 64 << 30, isolation);
        settled(&node, 2).await;
        let st = node_status(&node).await;
        assert_eq!(st["plugins"][0]["isolation"], isolation, "{st}");
        let bad = &st["models"][0]["adapters"][2];
        assert_eq!(bad["state"], "refused", "{isolation}: {bad}");
        assert!(
            bad["message"]
                .as_str()
                .is_some_and(|m| m.contains("blk.0.attn_q.weight")),
            "{isolation}: {bad}"
        );
        let (s, v) = post_json(&node, "/v1/completions", ask.clone()).await;
        assert_eq!(s, 200, "{isolation}: {v}");
        answers.push(v["choices"][0]["text"].as_str().expect("text").to_string());
    }
    assert_eq!(answers[0], answers[1], "in-process vs worker process");
}
