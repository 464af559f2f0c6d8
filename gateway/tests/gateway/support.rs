//! Test support for the gateway tests (outside the request path): real node processes, an
//! in-process gateway on a static endpoints file, and HTTP helpers.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use gantry_gateway::scale::RecordingScaler;
use gantry_gateway::{Discovery, GatewayConfig, GatewaySettings, auth::KeySource};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};
use serde_json::{Value, json};

/// Every phase that starts nodes or generates takes this, so that tests do not share the
/// machine's few cores with each other: a node starved by another test's model load or
/// generation would skew what the measuring tests see (least-loaded routing rightly favours the
/// faster replica). Only the scale-from-zero test's 20 s wait runs beside the others.
pub async fn measuring() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// `target/<profile>`: the test binary lives in `target/<profile>/deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port")
}

pub fn reqwest_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// A `gantry-node` serving one tiny model under `id`; killed on drop.
pub struct Node {
    child: Option<Child>,
    pub base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Node {
    pub fn start(id: &str, port: u16) -> Node {
        Self::start_with_token(id, port, None)
    }

    /// A node that requires `token` in `X-Gantry-Node-Token` (`GANTRY_NODE_TOKEN`).
    pub fn start_with_token(id: &str, port: u16, token: Option<&str>) -> Node {
        let bin = profile_dir().join("gantry-node");
        assert!(
            bin.is_file(),
            "{} is missing: build the workspace first (`cargo build --release --workspace --all-targets`)",
            bin.display()
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let model = dir.path().join("tiny.gguf");
        write_tiny_gguf(&model, &TinyModelSpec::default()).expect("tiny gguf");
        let config = json!({
            "models": [{"id": id, "path": model, "format": "gguf", "contextLength": 2048,
                        "maxBatchSize": 8, "threads": 1, "requestTimeoutSeconds": 0}],
            // No response cache: every request really runs on the node.
            "scheduler": {"responseCacheRamFraction": 0.0},
        });
        let cfg = dir.path().join("node.yaml");
        std::fs::write(&cfg, serde_yaml::to_string(&config).expect("yaml")).expect("config");
        let mut cmd = Command::new(bin);
        cmd.args(["serve", "--config"])
            .arg(&cfg)
            .args(["--listen", &format!("127.0.0.1:{port}"), "--plugins-dir"])
            .arg(profile_dir().join("engines"))
            .env("GANTRY_LOG", "warn")
            .env_remove("GANTRY_NODE_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if let Some(t) = token {
            cmd.env("GANTRY_NODE_TOKEN", t);
        }
        let child = cmd.spawn().expect("spawn gantry-node");
        Node {
            child: Some(child),
            base: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub async fn wait_ready(&self) {
        let c = reqwest_client();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(30) {
            if let Ok(r) = c.get(format!("{}/readyz", self.base)).send().await
                && r.status() == 200
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("node {} not ready within 30 s", self.base);
    }

    pub async fn status(&self) -> Value {
        reqwest_client()
            .get(format!("{}/v1/status", self.base))
            .send()
            .await
            .expect("status")
            .json()
            .await
            .expect("json")
    }

    pub async fn running(&self) -> u64 {
        self.status().await["models"][0]["queue"]["running"]
            .as_u64()
            .expect("running")
    }

    /// Wait until the node runs `n` sequences.
    pub async fn wait_running(&self, n: u64) {
        let t0 = Instant::now();
        loop {
            let r = self.running().await;
            if r == n {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{} runs {r}, not {n}",
                self.base
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn metrics(&self) -> String {
        reqwest_client()
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text")
    }

    /// The node's own count of successful completions for `model`.
    pub async fn requests_ok(&self, model: &str) -> f64 {
        let series = format!(
            "gantry_requests_total{{code=\"200\",endpoint=\"completions\",model=\"{model}\"}}"
        );
        metric(&self.metrics().await, &series).unwrap_or(0.0)
    }

    /// Wait (2 s at most) until the node has counted `n` successful completions for `model`.
    pub async fn wait_requests_ok(&self, model: &str, n: f64) {
        let t0 = Instant::now();
        loop {
            let got = self.requests_ok(model).await;
            if got == n {
                return;
            }
            assert!(
                got < n && t0.elapsed() < Duration::from_secs(2),
                "{} counted {got} successful requests, expected {n}",
                self.base
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Every request the node counted, any model, endpoint or code.
    pub async fn requests_total(&self) -> f64 {
        self.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("gantry_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// The value of one exact series in Prometheus text, if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|v| v.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// `promtool check metrics` accepts the text (Debian's prometheus package; scripts/setup.sh
/// installs it).
pub fn promtool_check(text: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; scripts/setup.sh installs it)");
    std::io::Write::write_all(promtool.stdin.as_mut().expect("stdin"), text.as_bytes())
        .expect("write metrics");
    let out = promtool.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Settings for tests: quick probes, the rest as shipped.
pub fn fast_settings() -> GatewaySettings {
    GatewaySettings {
        probe_interval: Duration::from_millis(100),
        ..GatewaySettings::default()
    }
}

/// Two nodes serving the tiny model as `tiny`, behind a gateway with `settings`, both ready and
/// probed.
pub async fn two_nodes_behind_a_gateway(settings: GatewaySettings) -> ([Node; 2], Gateway) {
    let nodes = [
        Node::start("tiny", free_port()),
        Node::start("tiny", free_port()),
    ];
    let gw = Gateway::start(
        serde_json::json!({"models": {"tiny": [nodes[0].base, nodes[1].base]}}),
        settings,
        None,
    )
    .await;
    for n in &nodes {
        n.wait_ready().await;
    }
    gw.wait_probed("tiny").await;
    (nodes, gw)
}

/// An in-process gateway on an ephemeral loopback port; stopped on drop.
#[derive(Clone)]
pub struct Gateway {
    pub base: String,
    _inner: Arc<GatewayInner>,
}

struct GatewayInner {
    task: tokio::task::JoinHandle<Result<(), gantry_gateway::ServeError>>,
    _endpoints: tempfile::NamedTempFile,
}

impl Drop for GatewayInner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Gateway {
    pub async fn start(
        endpoints: Value,
        settings: GatewaySettings,
        scaler: Option<RecordingScaler>,
    ) -> Gateway {
        Self::start_inner(endpoints, settings, scaler, None).await
    }

    pub async fn start_with_keys(
        endpoints: Value,
        settings: GatewaySettings,
        keys: &Path,
    ) -> Gateway {
        Self::start_inner(endpoints, settings, None, Some(keys.to_path_buf())).await
    }

    async fn start_inner(
        endpoints: Value,
        settings: GatewaySettings,
        scaler: Option<RecordingScaler>,
        keys: Option<PathBuf>,
    ) -> Gateway {
        let file = tempfile::NamedTempFile::new().expect("endpoints file");
        std::fs::write(
            file.path(),
            serde_yaml::to_string(&endpoints).expect("yaml"),
        )
        .expect("write");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let config = GatewayConfig {
            settings,
            discovery: Discovery::File(file.path().to_path_buf()),
            keys: keys.map(KeySource::File),
            client: None,
            scaler: scaler.map(|s| Arc::new(s) as _),
        };
        let task = tokio::spawn(gantry_gateway::serve(
            listener,
            config,
            std::future::pending(),
        ));
        Gateway {
            base,
            _inner: Arc::new(GatewayInner {
                task,
                _endpoints: file,
            }),
        }
    }

    pub async fn post_raw(&self, path: &str, body: &str, key: Option<&str>) -> (u16, Value) {
        let mut req = reqwest_client()
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.expect("request");
        let s = r.status().as_u16();
        (s, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn post(&self, path: &str, body: Value, key: Option<&str>) -> (u16, Value) {
        self.post_raw(path, &body.to_string(), key).await
    }

    pub async fn get(&self, path: &str, key: Option<&str>) -> (u16, Value) {
        let mut req = reqwest_client().get(format!("{}{path}", self.base));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.expect("request");
        let s = r.status().as_u16();
        (s, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn metrics(&self) -> String {
        reqwest_client()
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text")
    }

    /// Wait until `/v1/models` lists `id` (a replica probed ready).
    pub async fn wait_routable(&self, id: &str) {
        self.wait_routable_with(id, None).await
    }

    pub async fn wait_routable_with(&self, id: &str, key: Option<&str>) {
        let t0 = Instant::now();
        loop {
            if let Ok(r) =
                tokio::time::timeout(Duration::from_secs(2), self.get("/v1/models", key)).await
                && r.1["data"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|m| m["id"] == id))
            {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "gateway never listed {id}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Wait until `id` is listed and then three probe intervals more (the tests probe every
    /// 100 ms), so that every replica whose node was already ready has been probed up.
    pub async fn wait_probed(&self, id: &str) {
        self.wait_routable(id).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// POST a streaming request and forward its SSE `data:` payloads on a channel.
    pub async fn stream(
        &self,
        path: &str,
        body: Value,
        key: Option<&str>,
    ) -> tokio::sync::mpsc::UnboundedReceiver<String> {
        let mut req = reqwest_client()
            .post(format!("{}{path}", self.base))
            .json(&body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.expect("stream");
        assert_eq!(resp.status(), 200);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut buf = String::new();
            let mut body = resp.bytes_stream();
            while let Some(Ok(chunk)) = body.next().await {
                buf.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(i) = buf.find("\n\n") {
                    let ev: String = buf.drain(..i + 2).collect();
                    if let Some(d) = ev.trim().strip_prefix("data: ")
                        && tx.send(d.to_string()).is_err()
                    {
                        return;
                    }
                }
            }
        });
        rx
    }
}

/// How a stream ended.
#[derive(Debug)]
pub struct StreamOutcome {
    pub events: usize,
    /// It ended with `[DONE]`.
    pub finished: bool,
}

pub async fn drain(mut rx: tokio::sync::mpsc::UnboundedReceiver<String>) -> StreamOutcome {
    let mut events = 0;
    let mut last = String::new();
    while let Some(d) = rx.recv().await {
        events += 1;
        last = d;
    }
    StreamOutcome {
        events,
        finished: last == "[DONE]",
    }
}

/// Send a streaming request; each SSE event's arrival time since the send, and its payload.
pub async fn timed_events(req: reqwest::RequestBuilder) -> Vec<(Duration, String)> {
    let t0 = Instant::now();
    let resp = req.send().await.expect("send");
    assert_eq!(resp.status(), 200);
    let mut out = Vec::new();
    let mut buf = String::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.expect("chunk");
        let at = t0.elapsed();
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            if let Some(d) = ev.trim().strip_prefix("data: ") {
                out.push((at, d.to_string()));
            }
        }
    }
    out
}
