//! Model store tests: a Hub-like HTTP server on loopback (tree API, resolve
//! URLs, LFS sha256 headers, redirects, Range) and a real S3-compatible server
//! (`s3s-fs`), the store fetching from them, and the real `gantry-node`
//! binary downloading in the background (503 + `Retry-After`, readiness). The hub is `hub.rs`,
//! the S3 server and its test `s3.rs`, the node's tests `node.rs`; the store's own tests
//! against the hub are here.

#[path = "../common/mod.rs"]
mod common;
mod hub;
mod node;
mod s3;

use hub::*;
use s3::*;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use common::{NodeProc, free_port, profile_dir, spawn_node};
use futures::StreamExt;
use gantry_api::ArtifactState;
use gantry_engine_abi::Format;
use gantry_node::store::{DownloadProgress, FetchRequest, ModelStore, SourceSettings, StoreError};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------- helpers

pub(crate) fn store(hub_settings: SourceSettings, cache: &Path) -> ModelStore {
    ModelStore::new(cache.to_path_buf(), hub_settings).expect("store")
}

pub(crate) async fn fetch(
    store: &ModelStore,
    source: &str,
    format: Format,
    quantization: Option<&str>,
) -> (
    Result<gantry_node::store::Fetched, StoreError>,
    Arc<DownloadProgress>,
) {
    let progress = Arc::new(DownloadProgress::default());
    let req = FetchRequest {
        model_id: "m",
        source,
        format,
        quantization,
        files: &[],
    };
    (store.fetch(&req, &progress).await, progress)
}

/// Distinct bytes per file so a mix-up shows in the checksum.
pub(crate) fn blob(tag: &str, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut h = Sha256::digest(tag.as_bytes()).to_vec();
    while v.len() < len {
        v.extend_from_slice(&h);
        h = Sha256::digest(&h).to_vec();
    }
    v.truncate(len);
    v
}

// ---------------------------------------------------------------- store against the hub

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exact_quantization_and_its_mmproj_are_downloaded_and_nothing_else() {
    let hub = Hub::start().await;
    let want = blob("q4km", 50_000);
    hub.put("org/m", "m-Q4_K_M.gguf", &want);
    hub.put("org/m", "m-q4-k-m.gguf", &blob("lower", 1000));
    hub.put("org/m", "m-Q8_0.gguf", &blob("q8", 1000));
    hub.put("org/m", "mmproj-m-F16.gguf", &blob("mmproj", 2000));
    hub.put("org/m", "README.md", b"# m");
    let cache = tempfile::tempdir().expect("cache");
    let s = store(hub.settings(), cache.path());

    let (r, p) = fetch(&s, "hf://org/m", Format::Gguf, Some("Q4_K_M")).await;
    let f = r.expect("Q4_K_M fetched");
    assert_eq!(std::fs::read(&f.primary).expect("read"), want);
    assert!(f.primary.ends_with("hf/org--m/main/m-Q4_K_M.gguf"), "{f:?}");
    assert!(
        f.mmproj
            .as_ref()
            .is_some_and(|m| m.ends_with("mmproj-m-F16.gguf"))
    );
    let st = p.snapshot();
    assert_eq!(st.state, ArtifactState::Ready);
    assert_eq!((st.bytes_done, st.bytes_total), (52_000, 52_000));
    assert!(hub.downloads_of("Q8_0").is_empty() && hub.downloads_of("q4-k-m").is_empty());
    assert!(
        hub.log()
            .iter()
            .any(|l| l.contains("tree/main") && l.contains("GET")),
        "the tree API was used: {:?}",
        hub.log()
    );

    // The `name:QUANT` form picks the same file, already in the cache.
    let before = hub.downloads_of("Q4_K_M").len();
    let (r, _) = fetch(&s, "hf://org/m:Q4_K_M", Format::Gguf, None).await;
    assert_eq!(r.expect("name:QUANT").primary, f.primary);
    assert_eq!(
        hub.downloads_of("Q4_K_M").len(),
        before,
        "cached, not fetched again"
    );

    // Case and separators count.
    let (r, p) = fetch(&s, "hf://org/m", Format::Gguf, Some("q4_k_m")).await;
    let msg = r.expect_err("no such quantization").to_string();
    assert!(msg.contains("no GGUF with quantization `q4_k_m`"), "{msg}");
    assert_eq!(p.snapshot().state, ArtifactState::Failed);
    assert!(
        p.snapshot()
            .message
            .expect("message")
            .contains("m-Q8_0.gguf")
    );

    // No quantization and several candidates: the list.
    let (r, _) = fetch(&s, "hf://org/m", Format::Gguf, None).await;
    let msg = r.expect_err("ambiguous").to_string();
    assert!(
        msg.contains("several GGUF candidates")
            && msg.contains("m-Q4_K_M.gguf, m-Q8_0.gguf, m-q4-k-m.gguf"),
        "{msg}"
    );
    // Conflicting quantizations are refused, not guessed.
    let (r, _) = fetch(&s, "hf://org/m:Q8_0", Format::Gguf, Some("Q4_K_M")).await;
    assert!(r.expect_err("conflict").to_string().contains("Q8_0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_download_resumes_with_range_and_verifies() {
    let hub = Hub::start().await;
    let bytes = blob("big", 300_000);
    hub.put("org/r", "r-Q4_0.gguf", &bytes);
    hub.faults()
        .drop_after
        .insert("r-Q4_0.gguf".into(), 120_000);
    let cache = tempfile::tempdir().expect("cache");
    let s = store(hub.settings(), cache.path());
    let (r, p) = fetch(&s, "hf://org/r", Format::Gguf, None).await;
    let f = r.expect("resumed and verified");
    assert_eq!(std::fs::read(&f.primary).expect("read"), bytes);
    let gets = hub.downloads_of("r-Q4_0.gguf");
    assert_eq!(gets.len(), 2, "{gets:?}");
    assert!(!gets[0].contains("range="), "{gets:?}");
    let resumed_at: u64 = gets[1]
        .split("range=bytes=")
        .nth(1)
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse().ok())
        .expect("second request asks for a range");
    assert!(resumed_at > 0 && resumed_at <= 120_000, "{resumed_at}");
    assert_eq!(p.snapshot().bytes_done, 300_000);
    assert!(!f.primary.with_extension("gguf.partial").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_checksum_is_rejected_and_the_file_removed() {
    let hub = Hub::start().await;
    hub.put("org/bad", "bad-F16.gguf", &blob("bad", 10_000));
    hub.faults().wrong_sha.insert("bad-F16.gguf".into());
    let cache = tempfile::tempdir().expect("cache");
    let s = store(hub.settings(), cache.path());
    let (r, p) = fetch(&s, "hf://org/bad", Format::Gguf, None).await;
    let e = r.expect_err("checksum");
    assert!(matches!(e, StoreError::Checksum { .. }), "{e}");
    assert!(e.to_string().contains("sha256 mismatch"), "{e}");
    let dir = cache.path().join("hf/org--bad/main");
    assert!(!dir.join("bad-F16.gguf").exists() && !dir.join("bad-F16.gguf.partial").exists());
    assert_eq!(p.snapshot().state, ArtifactState::Failed);
    assert_eq!(
        hub.downloads_of("bad-F16").len(),
        1,
        "a checksum failure is not retried"
    );

    // A missing repo fails with the status code, no retries.
    let (r, _) = fetch(&s, "hf://org/nope", Format::Gguf, None).await;
    assert!(r.expect_err("404").to_string().contains("404"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_both_formats_only_the_registered_one_is_ever_requested() {
    let hub = Hub::start().await;
    for (name, len) in [
        ("config.json", 0),
        ("tokenizer.json", 0),
        ("tokenizer_config.json", 0),
        ("model.safetensors", 4000),
        ("m-Q4_K_M.gguf", 3000),
        ("onnx/model.onnx", 100),
    ] {
        let bytes = if len == 0 {
            br#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}"#.to_vec()
        } else {
            blob(name, len)
        };
        hub.put("org/both", name, &bytes);
    }
    let cache = tempfile::tempdir().expect("cache");
    let s = store(hub.settings(), cache.path());
    let (r, _) = fetch(&s, "hf://org/both", Format::Gguf, None).await;
    r.expect("gguf");
    let touched: Vec<String> = hub
        .log()
        .into_iter()
        .filter(|l| l.contains("safetensors") || l.contains("/resolve/"))
        .collect();
    assert!(
        touched.iter().all(|l| !l.contains("safetensors")),
        "format: gguf never requests safetensors: {touched:?}"
    );
    hub.state.log.lock().expect("log").clear();
    let st_cache = tempfile::tempdir().expect("cache");
    let s = store(hub.settings(), st_cache.path());
    let (r, _) = fetch(&s, "hf://org/both", Format::Safetensors, None).await;
    let f = r.expect("safetensors");
    assert!(f.primary.ends_with("model.safetensors"));
    let names: BTreeSet<String> = f
        .files
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
        .into_iter()
        .map(String::from)
        .collect()
    );
    assert!(
        hub.log()
            .iter()
            .all(|l| !l.contains(".gguf") && !l.contains("onnx")),
        "{:?}",
        hub.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_gguf_is_one_artifact_fetched_whole() {
    let hub = Hub::start().await;
    let a = blob("s1", 5000);
    let b = blob("s2", 4000);
    hub.put("org/sh", "Q4_K_M/sh-Q4_K_M-00001-of-00002.gguf", &a);
    hub.put("org/sh", "Q4_K_M/sh-Q4_K_M-00002-of-00002.gguf", &b);
    hub.put("org/sh", "sh-Q8_0.gguf", &blob("q8", 100));
    let cache = tempfile::tempdir().expect("cache");
    let s = store(hub.settings(), cache.path());
    let (r, p) = fetch(&s, "hf://org/sh", Format::Gguf, Some("Q4_K_M")).await;
    let f = r.expect("sharded");
    assert!(f.primary.ends_with("Q4_K_M/sh-Q4_K_M-00001-of-00002.gguf"));
    assert_eq!(f.files.len(), 2);
    assert_eq!(std::fs::read(&f.files[1]).expect("shard 2"), b);
    assert_eq!(p.snapshot().bytes_total, 9000);
    let (r, _) = fetch(&s, "hf://org/sh", Format::Gguf, None).await;
    assert!(
        r.expect_err("two artifacts")
            .to_string()
            .contains("(2 shards)")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_sharing_a_cache_download_each_file_once() {
    let hub = Hub::start().await;
    let bytes = blob("shared", 60_000);
    hub.put("org/s", "s-Q4_K_M.gguf", &bytes);
    hub.faults().bytes_per_second = 120_000; // about half a second
    let cache = tempfile::tempdir().expect("cache");
    let (a, b) = (
        store(hub.settings(), cache.path()),
        store(hub.settings(), cache.path()),
    );
    let ((ra, _), (rb, pb)) = tokio::join!(
        fetch(&a, "hf://org/s", Format::Gguf, None),
        fetch(&b, "hf://org/s", Format::Gguf, None)
    );
    let (fa, fb) = (ra.expect("first"), rb.expect("second"));
    assert_eq!(fa.primary, fb.primary);
    assert_eq!(std::fs::read(&fa.primary).expect("read"), bytes);
    assert_eq!(
        hub.downloads_of("s-Q4_K_M").len(),
        1,
        "one replica downloads, the other waits for the lock and finds it complete: {:?}",
        hub.log()
    );
    assert_eq!(pb.snapshot().bytes_done, 60_000);
}
