//! The test hub (a Hub-like HTTP server on loopback): tree API, resolve URLs, LFS sha256
//! headers, redirects, `Range`, and the faults a test asks of it.

use super::*;

/// What the test hub does wrong on purpose.
#[derive(Default)]
pub(crate) struct Faults {
    /// Cut the connection after this many body bytes, once per file.
    pub(crate) drop_after: HashMap<String, u64>,
    /// Body bytes per second for every download (0 = unthrottled).
    pub(crate) bytes_per_second: u64,
    /// Files whose listed sha256 is not the content's.
    pub(crate) wrong_sha: BTreeSet<String>,
    /// Answer this many tree-API requests with 503 first.
    pub(crate) tree_503s: u32,
}

pub(crate) struct HubState {
    /// `{root}/{org}/{repo}/{path}`.
    pub(crate) root: PathBuf,
    /// `METHOD path [range]` for every request.
    pub(crate) log: Mutex<Vec<String>>,
    pub(crate) faults: Mutex<Faults>,
}

#[derive(Clone)]
pub(crate) struct Hub {
    pub(crate) base: String,
    pub(crate) state: Arc<HubState>,
    pub(crate) _dir: Arc<tempfile::TempDir>,
}

impl Hub {
    pub(crate) async fn start() -> Hub {
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
    pub(crate) fn put(&self, repo: &str, path: &str, bytes: &[u8]) {
        let p = self.state.root.join(repo).join(path);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, bytes).expect("write");
    }

    pub(crate) fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.state.faults.lock().expect("faults")
    }

    pub(crate) fn log(&self) -> Vec<String> {
        self.state.log.lock().expect("log").clone()
    }

    /// Body downloads (the CDN leg) of files whose path contains `needle`.
    pub(crate) fn downloads_of(&self, needle: &str) -> Vec<String> {
        self.log()
            .into_iter()
            .filter(|l| l.starts_with("GET /cdn/") && l.contains(needle))
            .collect()
    }

    pub(crate) fn settings(&self) -> SourceSettings {
        SourceSettings {
            hf_endpoint: Some(self.base.clone()),
            ..SourceSettings::default()
        }
    }
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

pub(crate) fn is_lfs(path: &str) -> bool {
    path.ends_with(".gguf") || path.ends_with(".safetensors")
}

pub(crate) fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
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

pub(crate) async fn hub_handler(State(s): State<Arc<HubState>>, req: Request) -> Response {
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
pub(crate) fn serve_bytes(
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
