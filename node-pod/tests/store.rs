//! Model store tests: a Hub-like HTTP server on loopback (tree API, resolve
//! URLs, LFS sha256 headers, redirects, Range) and a real S3-compatible server
//! (`s3s-fs`), the store fetching from them, and the real `gantry-node`
//! binary downloading in the background (503 + `Retry-After`, readiness).

mod common;

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

// ---------------------------------------------------------------- the hub

/// What the test hub does wrong on purpose.
#[derive(Default)]
struct Faults {
    /// Cut the connection after this many body bytes, once per file.
    drop_after: HashMap<String, u64>,
    /// Body bytes per second for every download (0 = unthrottled).
    bytes_per_second: u64,
    /// Files whose listed sha256 is not the content's.
    wrong_sha: BTreeSet<String>,
    /// Answer this many tree-API requests with 503 first.
    tree_503s: u32,
}

struct HubState {
    /// `{root}/{org}/{repo}/{path}`.
    root: PathBuf,
    /// `METHOD path [range]` for every request.
    log: Mutex<Vec<String>>,
    faults: Mutex<Faults>,
}

#[derive(Clone)]
struct Hub {
    base: String,
    state: Arc<HubState>,
    _dir: Arc<tempfile::TempDir>,
}

impl Hub {
    async fn start() -> Hub {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = Arc::new(HubState {
            root: dir.path().to_path_buf(),
            log: Mutex::new(Vec::new()),
            faults: Mutex::new(Faults::default()),
        });
        let app = axum::Router::new()
            .fallback(hub_handler)
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Hub {
            base,
            state,
            _dir: Arc::new(dir),
        }
    }

    /// Put `bytes` at `{repo}/{path}`.
    fn put(&self, repo: &str, path: &str, bytes: &[u8]) {
        let p = self.state.root.join(repo).join(path);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, bytes).expect("write");
    }

    fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.state.faults.lock().expect("faults")
    }

    fn log(&self) -> Vec<String> {
        self.state.log.lock().expect("log").clone()
    }

    /// Body downloads (the CDN leg) of files whose path contains `needle`.
    fn downloads_of(&self, needle: &str) -> Vec<String> {
        self.log()
            .into_iter()
            .filter(|l| l.starts_with("GET /cdn/") && l.contains(needle))
            .collect()
    }

    fn settings(&self) -> SourceSettings {
        SourceSettings {
            hf_endpoint: Some(self.base.clone()),
            ..SourceSettings::default()
        }
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn is_lfs(path: &str) -> bool {
    path.ends_with(".gguf") || path.ends_with(".safetensors")
}

fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
    for e in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, root, out);
        } else {
            out.push(
                p.strip_prefix(root)
                    .expect("under root")
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
}

async fn hub_handler(State(s): State<Arc<HubState>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let range = req
        .headers()
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    s.log.lock().expect("log").push(format!(
        "{} {path}{}",
        req.method(),
        range
            .as_deref()
            .map(|r| format!(" range={r}"))
            .unwrap_or_default()
    ));
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        // The tree API, three entries a page, paginated by Link like the Hub.
        ["api", "models", org, repo, "tree", _rev] => {
            {
                let mut f = s.faults.lock().expect("f");
                if f.tree_503s > 0 {
                    f.tree_503s -= 1;
                    return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
                }
            }
            let root = s.root.join(org).join(repo);
            if !root.is_dir() {
                return (StatusCode::NOT_FOUND, "Repository not found").into_response();
            }
            let mut files = Vec::new();
            walk(&root, &root, &mut files);
            files.sort();
            let cursor: usize = req
                .uri()
                .query()
                .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("cursor=")))
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            let page: Vec<Value> = files
                .iter()
                .skip(cursor)
                .take(3)
                .map(|f| {
                    let bytes = std::fs::read(root.join(f)).expect("read");
                    let mut sha = sha256_hex(&bytes);
                    if s.faults.lock().expect("f").wrong_sha.contains(f.as_str()) {
                        sha = sha256_hex(b"something else");
                    }
                    let mut e = json!({"type": "file", "oid": "0".repeat(40), "size": bytes.len(), "path": f});
                    if is_lfs(f) {
                        e["lfs"] = json!({"oid": sha, "size": bytes.len(), "pointerSize": 134});
                    }
                    e
                })
                .collect();
            let mut headers = HeaderMap::new();
            if cursor + 3 < files.len() {
                let next = format!(
                    "<{}?recursive=true&cursor={}>; rel=\"next\"",
                    path,
                    cursor + 3
                );
                // The Hub sends absolute URLs; a relative one would not resolve, so build it.
                let host = req
                    .headers()
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or("127.0.0.1");
                let next = next.replacen('<', &format!("<http://{host}"), 1);
                headers.insert(header::LINK, next.parse().expect("link"));
            }
            (headers, axum::Json(page)).into_response()
        }
        // Resolve: LFS files redirect to the CDN with the sha256 in X-Linked-Etag.
        [org, repo, "resolve", _rev, rest @ ..] => {
            let file = rest.join("/");
            let p = s.root.join(org).join(repo).join(&file);
            let Ok(bytes) = std::fs::read(&p) else {
                return (StatusCode::NOT_FOUND, "Entry not found").into_response();
            };
            if is_lfs(&file) {
                let mut sha = sha256_hex(&bytes);
                if s.faults
                    .lock()
                    .expect("f")
                    .wrong_sha
                    .contains(file.as_str())
                {
                    sha = sha256_hex(b"something else");
                }
                return Response::builder()
                    .status(StatusCode::FOUND)
                    .header(header::LOCATION, format!("/cdn/{org}/{repo}/{file}"))
                    .header("x-linked-etag", format!("\"{sha}\""))
                    .header("x-linked-size", bytes.len().to_string())
                    .body(Body::empty())
                    .expect("redirect");
            }
            serve_bytes(&s, &file, bytes, range.as_deref(), "0".repeat(40))
        }
        ["cdn", org, repo, rest @ ..] => {
            let file = rest.join("/");
            match std::fs::read(s.root.join(org).join(repo).join(&file)) {
                Ok(bytes) => {
                    let etag = sha256_hex(&bytes);
                    serve_bytes(&s, &file, bytes, range.as_deref(), etag)
                }
                Err(_) => (StatusCode::NOT_FOUND, "no such object").into_response(),
            }
        }
        _ => (StatusCode::NOT_FOUND, "unknown route").into_response(),
    }
}

/// A file body honouring `Range: bytes=N-`, throttled and cut as the faults say.
fn serve_bytes(
    s: &HubState,
    file: &str,
    bytes: Vec<u8>,
    range: Option<&str>,
    etag: String,
) -> Response {
    let total = bytes.len() as u64;
    let start: u64 = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if start > total {
        return StatusCode::RANGE_NOT_SATISFIABLE.into_response();
    }
    let (cut, bps) = {
        let mut f = s.faults.lock().expect("f");
        (f.drop_after.remove(file), f.bytes_per_second)
    };
    let body: Vec<u8> = bytes[start as usize..].to_vec();
    let len = body.len() as u64;
    let chunk = if bps > 0 {
        (bps / 20).max(1) as usize
    } else {
        64 * 1024
    };
    let chunks: Vec<Vec<u8>> = body.chunks(chunk).map(<[u8]>::to_vec).collect();
    let stream = futures::stream::iter(chunks.into_iter().scan(0u64, move |sent, c| {
        let before = *sent;
        *sent += c.len() as u64;
        Some((before, c))
    }))
    .then(move |(before, c)| async move {
        if bps > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        match cut {
            Some(n) if before + c.len() as u64 > n => {
                // Let the bytes already sent reach the client before the cut.
                tokio::time::sleep(Duration::from_millis(200)).await;
                Err(std::io::Error::other("connection dropped by the test hub"))
            }
            _ => Ok::<_, std::io::Error>(c),
        }
    });
    let mut b = Response::builder()
        .header(header::CONTENT_LENGTH, len.to_string())
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::ETAG, format!("\"{etag}\""));
    b = if range.is_some() {
        b.status(StatusCode::PARTIAL_CONTENT).header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{total}", total.saturating_sub(1)),
        )
    } else {
        b.status(StatusCode::OK)
    };
    b.body(Body::from_stream(stream)).expect("body")
}

// ---------------------------------------------------------------- helpers

fn store(hub_settings: SourceSettings, cache: &Path) -> ModelStore {
    ModelStore::new(cache.to_path_buf(), hub_settings).expect("store")
}

async fn fetch(
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
fn blob(tag: &str, len: usize) -> Vec<u8> {
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

// ---------------------------------------------------------------- S3 against a real server

/// The `s3s-fs` server `scripts/setup.sh` installs, on a free loopback port.
struct S3Server {
    child: Child,
    endpoint: String,
    _root: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const S3_KEY: &str = "gantrytest";
const S3_SECRET: &str = "gantrytestsecret";

fn s3s_binary() -> PathBuf {
    let p = std::env::var_os("GANTRY_S3_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("s3s-fs"));
    assert!(
        p.is_file(),
        "the S3 test needs a real S3-compatible server: run `eval \"$(scripts/setup.sh)\"`, which installs s3s-fs and sets GANTRY_S3_SERVER (now {p:?})"
    );
    p
}

async fn start_s3() -> S3Server {
    let root = tempfile::tempdir().expect("s3 root");
    let port = free_port();
    let child = Command::new(s3s_binary())
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", S3_KEY, "--secret-key", S3_SECRET])
        .arg(root.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn s3s-fs");
    let endpoint = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "s3s-fs did not listen"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    S3Server {
        child,
        endpoint,
        _root: root,
    }
}

fn s3_settings(endpoint: &str) -> SourceSettings {
    SourceSettings {
        s3_endpoint: Some(endpoint.to_string()),
        s3_region: Some("us-east-1".into()),
        aws_access_key_id: Some(S3_KEY.into()),
        aws_secret_access_key: Some(S3_SECRET.into()),
        ..SourceSettings::default()
    }
}

/// Create the bucket and upload objects through the S3 API.
async fn s3_upload(endpoint: &str, bucket: &str, objects: &[(&str, Vec<u8>)]) {
    use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
    let b = Bucket::new(
        endpoint.parse().expect("url"),
        UrlStyle::Path,
        bucket.to_string(),
        "us-east-1",
    )
    .expect("bucket");
    let creds = Credentials::new(S3_KEY, S3_SECRET);
    let c = reqwest::Client::new();
    let ttl = Duration::from_secs(600);
    let r = c
        .put(b.create_bucket(&creds).sign(ttl))
        .send()
        .await
        .expect("create bucket");
    assert!(r.status().is_success(), "create bucket: {}", r.status());
    for (key, bytes) in objects {
        let r = c
            .put(b.put_object(Some(&creds), key).sign(ttl))
            .body(bytes.clone())
            .send()
            .await
            .expect("put");
        assert!(r.status().is_success(), "put {key}: {}", r.status());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_sources_select_exactly_and_download_verified_from_a_real_server() {
    let s3 = start_s3().await;
    let gguf = blob("s3-q4", 40_000);
    s3_upload(
        &s3.endpoint,
        "models",
        &[
            ("tiny/t-Q4_K_M.gguf", gguf.clone()),
            ("tiny/t-Q8_0.gguf", blob("s3-q8", 1000)),
            ("tiny/mmproj-t-f16.gguf", blob("s3-mm", 500)),
            ("tiny/model.safetensors", blob("s3-st", 3000)),
            ("tiny/config.json", br#"{"model_type": "llama"}"#.to_vec()),
            ("other/x.gguf", blob("other", 10)),
        ],
    )
    .await;
    let cache = tempfile::tempdir().expect("cache");
    let s = store(s3_settings(&s3.endpoint), cache.path());
    let (r, p) = fetch(&s, "s3://models/tiny", Format::Gguf, Some("Q4_K_M")).await;
    let f = r.expect("s3 fetch");
    assert_eq!(std::fs::read(&f.primary).expect("read"), gguf);
    assert!(f.primary.ends_with("s3/models/tiny/t-Q4_K_M.gguf"));
    assert!(f.mmproj.is_some());
    assert_eq!(p.snapshot().bytes_done, 40_500);
    let on_disk: Vec<String> = std::fs::read_dir(cache.path().join("s3/models/tiny"))
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert!(
        on_disk
            .iter()
            .all(|n| n.ends_with(".gguf") && !n.contains("Q8_0")),
        "only the chosen GGUF and its mmproj: {on_disk:?}"
    );
    // The ambiguity list, the same rules as the Hub.
    let (r, _) = fetch(&s, "s3://models/tiny", Format::Gguf, None).await;
    let msg = r.expect_err("ambiguous").to_string();
    assert!(msg.contains("t-Q4_K_M.gguf, t-Q8_0.gguf"), "{msg}");
    // Wrong credentials are a clear failure.
    let mut bad = s3_settings(&s3.endpoint);
    bad.aws_secret_access_key = Some("wrong".into());
    let (r, _) = fetch(
        &store(bad, cache.path()),
        "s3://models/tiny",
        Format::Gguf,
        Some("Q4_K_M"),
    )
    .await;
    assert!(r.expect_err("bad secret").to_string().contains("HTTP 403"));
}

// ---------------------------------------------------------------- the node downloading

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
