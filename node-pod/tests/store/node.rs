//! The real `gantry-node` binary downloading in the background: 503 + `Retry-After` while
//! it downloads, readiness, unsupported or failed artifacts, retries, S3 and direct URLs.

use super::*;

fn start_node(models: Value, hub: &Hub) -> NodeProc {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = json!({"models": models, "cacheDir": dir.path().join("cache")});
    spawn_node(&config, &profile_dir().join("engines"), dir, |cmd| {
        cmd.env("HF_ENDPOINT", &hub.base)
            .env_remove("HF_TOKEN")
            .env_remove("GANTRY_CACHE_DIR");
    })
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

async fn node_status(node: &NodeProc) -> Value {
    match http().get(format!("{}/v1/status", node.base)).send().await {
        Ok(r) => r.json().await.expect("json"),
        Err(_) => Value::Null, // not listening yet
    }
}

fn tiny_gguf_bytes(spec: &TinyModelSpec) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("tmp");
    let p = dir.path().join("t.gguf");
    write_tiny_gguf(&p, spec).expect("tiny");
    std::fs::read(p).expect("read")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_downloading_model_answers_503_with_retry_after_and_readiness_waits_for_it() {
    let hub = Hub::start().await;
    let bytes = tiny_gguf_bytes(&TinyModelSpec::default());
    hub.put("org/tiny", "tiny-F32.gguf", &bytes);
    hub.put("org/tiny", "tiny-Q8_0.gguf", &blob("unused", 100));
    // About three seconds of download.
    hub.faults().bytes_per_second = (bytes.len() as u64 / 3).max(1);
    let node = start_node(
        json!([{"id": "tiny", "source": "hf://org/tiny:F32", "format": "gguf", "contextLength": 512}]),
        &hub,
    );
    let c = http();
    let t0 = Instant::now();
    let s = loop {
        let s = node_status(&node).await;
        if s["models"][0]["artifact"]["state"] == "downloading"
            && s["models"][0]["artifact"]["bytesDone"].as_u64() > Some(0)
        {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no progress: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(s["ready"], false);
    assert_eq!(
        s["models"][0]["artifact"]["bytesTotal"].as_u64(),
        Some(bytes.len() as u64)
    );
    let r = c
        .post(format!("{}/v1/completions", node.base))
        .json(&json!({"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 503);
    let retry_after: u64 = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((1..=60).contains(&retry_after));
    let v: Value = r.json().await.expect("json");
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("message")
            .contains("model `tiny` is still downloading"),
        "{v}"
    );
    let ready = c
        .get(format!("{}/readyz", node.base))
        .send()
        .await
        .expect("readyz");
    assert_eq!(ready.status(), 503);
    assert!(ready.text().await.expect("t").contains("Downloading"));
    // Ready only once downloaded, verified, inspected and loaded.
    let t0 = Instant::now();
    loop {
        let r = c
            .get(format!("{}/readyz", node.base))
            .send()
            .await
            .expect("readyz");
        if r.status() == 200 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = node_status(&node).await;
    assert_eq!(s["models"][0]["artifact"]["state"], "ready");
    assert_eq!(s["models"][0]["load"]["state"], "loaded");
    assert_eq!(s["models"][0]["verdict"]["verdict"], "supported");
    let r = c
        .post(format!("{}/v1/completions", node.base))
        .json(&json!({"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 200);
    assert!(hub.downloads_of("Q8_0").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_downloaded_unsupported_architecture_or_a_failed_download_keeps_the_node_unready() {
    let hub = Hub::start().await;
    let spec = TinyModelSpec {
        architecture_name_override: Some("mysteryarch".into()),
        ..TinyModelSpec::default()
    };
    hub.put("org/mystery", "mystery-F32.gguf", &tiny_gguf_bytes(&spec));
    let node = start_node(
        json!([
            {"id": "mystery", "source": "hf://org/mystery", "format": "gguf"},
            {"id": "missing", "source": "hf://org/missing", "format": "gguf"}
        ]),
        &hub,
    );
    let t0 = Instant::now();
    let s = loop {
        let s = node_status(&node).await;
        let models = s["models"].as_array().cloned().unwrap_or_default();
        let done = models.len() == 2
            && models
                .iter()
                .all(|m| !m["verdict"].is_null() || m["artifact"]["state"] == "failed");
        if done {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "{s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(s["ready"], false);
    let by_id = |id: &str| {
        s["models"]
            .as_array()
            .expect("models")
            .iter()
            .find(|m| m["id"] == id)
            .cloned()
            .expect("model")
    };
    let mystery = by_id("mystery");
    assert_eq!(mystery["artifact"]["state"], "ready");
    assert_eq!(mystery["architecture"], "mysteryarch");
    assert_eq!(mystery["verdict"]["verdict"], "unsupported");
    assert!(
        mystery["verdict"]["rejections"][0]["reason"]
            .as_str()
            .expect("reason")
            .contains("mysteryarch")
    );
    let missing = by_id("missing");
    assert_eq!(missing["artifact"]["state"], "failed");
    assert!(
        missing["artifact"]["message"]
            .as_str()
            .expect("message")
            .contains("HTTP 404"),
        "{missing}"
    );
    let r = http()
        .get(format!("{}/readyz", node.base))
        .send()
        .await
        .expect("readyz");
    assert_eq!(r.status(), 503);
    let r = http()
        .post(format!("{}/v1/completions", node.base))
        .json(&json!({"model": "missing", "prompt": "x"}))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.expect("json");
    assert!(
        v["error"]["message"].as_str().expect("m").contains("404"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failures_are_retried_four_times_with_backoff_then_reported() {
    let hub = Hub::start().await;
    hub.put("org/flaky", "f-Q4_0.gguf", &blob("flaky", 1000));
    let cache = tempfile::tempdir().expect("cache");
    let s = store(hub.settings(), cache.path());
    let tree_calls = |hub: &Hub| hub.log().iter().filter(|l| l.contains("/tree/")).count();
    // Three 503s, then an answer: the fourth attempt succeeds after 100 + 200 + 400 ms.
    hub.faults().tree_503s = 3;
    let t0 = Instant::now();
    let (r, _) = fetch(&s, "hf://org/flaky", Format::Gguf, None).await;
    r.expect("fourth attempt");
    assert_eq!(tree_calls(&hub), 4);
    assert!(
        t0.elapsed() >= Duration::from_millis(700),
        "{:?}",
        t0.elapsed()
    );
    // Four 503s: given up, with the reason.
    hub.faults().tree_503s = 4;
    let (r, _) = fetch(&s, "hf://org/flaky", Format::Gguf, None).await;
    let e = r.expect_err("four failures");
    assert!(e.to_string().contains("HTTP 503"), "{e}");
    assert_eq!(tree_calls(&hub), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_fetches_from_s3_with_aws_env_and_judges_each_model_from_its_metadata() {
    let s3 = start_s3().await;
    let gguf = tiny_gguf_bytes(&TinyModelSpec::default());
    s3_upload(
        &s3.endpoint,
        "models",
        &[
            ("tiny/tiny-F32.gguf", gguf),
            ("st/config.json", br#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048}"#.to_vec()),
            ("st/tokenizer.json", b"{}".to_vec()),
            ("st/model.safetensors", blob("st-weights", 2000)),
        ],
    )
    .await;
    let hub = Hub::start().await; // unused by these sources; HF_ENDPOINT points somewhere harmless
    let dir = tempfile::tempdir().expect("tempdir");
    let config = json!({
        "cacheDir": dir.path().join("cache"),
        "models": [
            {"id": "tiny", "source": "s3://models/tiny", "format": "gguf", "contextLength": 512},
            {"id": "st", "source": "s3://models/st", "format": "safetensors"}
        ]
    });
    let node = spawn_node(&config, &profile_dir().join("engines"), dir, |cmd| {
        cmd.env("HF_ENDPOINT", &hub.base)
            .env("AWS_ENDPOINT_URL", &s3.endpoint)
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", S3_KEY)
            .env("AWS_SECRET_ACCESS_KEY", S3_SECRET)
            .env_remove("AWS_SESSION_TOKEN")
            .env_remove("AWS_ENDPOINT_URL_S3")
            .env_remove("GANTRY_CACHE_DIR");
    });
    let t0 = Instant::now();
    let s = loop {
        let s = node_status(&node).await;
        let models = s["models"].as_array().cloned().unwrap_or_default();
        if models.len() == 2
            && models.iter().all(|m| {
                m["load"]["state"] == "loaded"
                    || m["verdict"]["verdict"] == "unsupported"
                    || m["load"]["state"] == "failed"
            })
        {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let by_id = |id: &str| {
        s["models"]
            .as_array()
            .expect("models")
            .iter()
            .find(|m| m["id"] == id)
            .cloned()
            .expect("model")
    };
    let tiny = by_id("tiny");
    assert_eq!(tiny["artifact"]["state"], "ready", "{tiny}");
    assert_eq!(tiny["load"]["state"], "loaded", "{tiny}");
    let st = by_id("st");
    assert_eq!(st["artifact"]["state"], "ready", "{st}");
    // The verdict comes from config.json, read before any load: the model class selects the
    // native engine, whose load then refuses these stand-in files with the reason.
    assert_eq!(st["architecture"], "LlamaForCausalLM", "{st}");
    assert_eq!(st["verdict"]["verdict"], "supported", "{st}");
    assert_eq!(st["verdict"]["plugin"], "native", "{st}");
    assert_eq!(st["load"]["state"], "failed", "{st}");
    assert_eq!(
        s["ready"], false,
        "one model cannot be served, so the node is not ready"
    );
    let r = http()
        .post(format!("{}/v1/completions", node.base))
        .json(&json!({"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_url_is_verified_by_its_sha256_etag_and_resumed() {
    let hub = Hub::start().await;
    let bytes = blob("direct", 200_000);
    hub.put("org/d", "d-Q4_0.gguf", &bytes);
    hub.faults()
        .drop_after
        .insert("d-Q4_0.gguf".into(), 100_000);
    let cache = tempfile::tempdir().expect("cache");
    let s = store(SourceSettings::default(), cache.path());
    let url = format!("{}/cdn/org/d/d-Q4_0.gguf", hub.base);
    let (r, p) = fetch(&s, &url, Format::Gguf, None).await;
    let f = r.expect("direct download");
    assert_eq!(std::fs::read(&f.primary).expect("read"), bytes);
    assert_eq!(
        (p.snapshot().bytes_done, p.snapshot().bytes_total),
        (200_000, 200_000)
    );
    let gets = hub.downloads_of("d-Q4_0");
    assert_eq!(gets.len(), 2, "{gets:?}");
    assert!(gets[1].contains("range=bytes="), "{gets:?}");
}
