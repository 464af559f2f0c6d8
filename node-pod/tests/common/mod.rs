//! Shared test support for the node's integration tests: locating built plugins and writing
//! plugin trees, starting the node binary and talking to it over loopback.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt as _;

use gantry_engine_abi::{EngineConfig, Format, ModelDescriptor, Sampling, StepEntry};
use gantry_node::engine_host::{EngineRegistry, ModelExec, Plugin};
use gantry_testkit::{TinyModelSpec, write_tiny_gguf};

/// Held for the whole of a test that must run alone in its binary: tests that capture the
/// plugin's log lines, and tests whose llama.cpp nodes would otherwise share a small CI machine's
/// cores (llama.cpp's threads spin at their barriers, so two nodes on two cores each slow to a
/// crawl and trip the stall limit).
pub fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.blocking_lock()
}

/// [`serial`] for async tests (each test has its own runtime; the lock spans them).
pub async fn serial_async() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

/// A failed test releases the lock without poisoning it, so the others still run.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `target/<profile>`: the test binary lives in `target/<profile>/deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// A cdylib built in this workspace, e.g. `gantry_fault_faulty`.
pub fn built_lib(name: &str) -> PathBuf {
    let p = profile_dir().join(format!("lib{name}.so"));
    assert!(
        p.is_file(),
        "{} is missing: build the workspace first (`cargo build --release --workspace`, which scripts/test.sh does)",
        p.display()
    );
    p
}

/// Write `<root>/<dir_id>/<backend>/manifest.json` and link the library beside it.
pub fn install_plugin(
    root: &Path,
    dir_id: &str,
    backend: &str,
    manifest: serde_json::Value,
    lib: Option<&Path>,
) -> PathBuf {
    let dir = root.join(dir_id).join(backend);
    std::fs::create_dir_all(&dir).expect("plugin dir");
    if let Some(lib) = lib {
        let binary = manifest["binary"].as_str().expect("binary field");
        std::os::unix::fs::symlink(lib, dir.join(binary)).expect("symlink library");
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec_pretty(&manifest).expect("json"),
    )
    .expect("manifest");
    dir
}

pub fn faulty_manifest(id: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id,
        "version": "0.1.0",
        "abi_version": "1",
        "gpu_backend": "cpu",
        "binary": "libgantry_fault_faulty.so",
        "architectures": ["toy"],
        "formats": ["gguf"],
        "modalities": ["completion"],
        "license": "Apache-2.0"
    })
}

/// The `faulty` plugin under `<root>/faulty/cpu/`, as most host tests need it.
pub fn install_faulty(root: &Path) -> PathBuf {
    install_faulty_for(root, &["toy"])
}

/// The `faulty` plugin under `<root>/faulty/cpu/`, its manifest declaring `architectures`.
pub fn install_faulty_for(root: &Path, architectures: &[&str]) -> PathBuf {
    let mut manifest = faulty_manifest("faulty");
    manifest["architectures"] = serde_json::json!(architectures);
    install_plugin(
        root,
        "faulty",
        "cpu",
        manifest,
        Some(&built_lib("gantry_fault_faulty")),
    )
}

pub fn cpu_config() -> EngineConfig {
    EngineConfig {
        n_threads: 2,
        max_batch_size: 8,
        context_length: 512,
        ..EngineConfig::default()
    }
}

/// The llama.cpp plugin, opened straight from the build output.
pub fn llama_plugin(max_batch_size: u32, context_length: u32) -> Plugin {
    let dir = profile_dir().join("engines");
    let cfg = EngineConfig {
        n_threads: 2,
        max_batch_size,
        context_length,
        ..EngineConfig::default()
    };
    let reg = EngineRegistry::discover(&dir, &cfg);
    let rec = reg
        .get("llama_cpp")
        .unwrap_or_else(|| panic!("no llama_cpp plugin under {}", dir.display()));
    rec.plugin()
        .cloned()
        .unwrap_or_else(|| panic!("llama_cpp refused: {:?}", rec.summary().reason))
}

/// `<root>/plugins` holding the `faulty` plugin; the plugin tree for a node serving toy models.
pub fn faulty_plugins(root: &Path) -> PathBuf {
    let plugins = root.join("plugins");
    install_faulty(&plugins);
    plugins
}

/// A toy GGUF (architecture `toy`) whose stem picks the fault plugin's behaviour.
pub fn toy_gguf(dir: &Path, stem: &str) -> PathBuf {
    let p = dir.join(format!("{stem}.gguf"));
    let spec = TinyModelSpec {
        architecture_name_override: Some("toy".into()),
        ..TinyModelSpec::default()
    };
    write_tiny_gguf(&p, &spec).expect("toy gguf");
    p
}

/// A running `gantry-node serve` process; killed on drop.
pub struct NodeProc {
    pub child: std::process::Child,
    pub base: String,
    _dir: tempfile::TempDir,
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port")
}

/// Start the node binary on a free loopback port with `config` written as YAML into `dir`
/// (kept alive as long as the process) and plugins from `plugins`; `customize` adds flags and
/// environment before the spawn.
pub fn spawn_node(
    config: &serde_json::Value,
    plugins: &Path,
    dir: tempfile::TempDir,
    customize: impl FnOnce(&mut std::process::Command),
) -> NodeProc {
    let cfg_path = dir.path().join("node.yaml");
    std::fs::write(&cfg_path, serde_yaml::to_string(config).expect("yaml")).expect("write config");
    spawn_node_with_config(&cfg_path, plugins, dir, customize)
}

/// Start the node binary as [`spawn_node`] does, on the config file already at `cfg_path`.
pub fn spawn_node_with_config(
    cfg_path: &Path,
    plugins: &Path,
    dir: tempfile::TempDir,
    customize: impl FnOnce(&mut std::process::Command),
) -> NodeProc {
    let port = free_port();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gantry-node"));
    cmd.args(["serve", "--config"])
        .arg(cfg_path)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--plugins-dir"])
        .arg(plugins)
        .env("GANTRY_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit());
    customize(&mut cmd);
    let child = cmd.spawn().expect("spawn gantry-node");
    NodeProc {
        child,
        base: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    }
}

/// An HTTP client with a generous overall timeout.
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// Wait (at most 60 s) for `/readyz` to answer 200; `/readyz` needs no node token.
pub async fn wait_ready(node: &NodeProc) {
    let c = http();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        if let Ok(r) = c.get(format!("{}/readyz", node.base)).send().await
            && r.status() == 200
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("node did not become ready within 60 s");
}

/// Read SSE `data:` payloads from a streaming response.
pub async fn sse_lines(resp: reqwest::Response, tx: tokio::sync::mpsc::UnboundedSender<String>) {
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
}

/// POST a streaming request and collect its SSE `data:` payloads on a channel.
pub async fn stream(
    node: &NodeProc,
    path: &str,
    body: serde_json::Value,
) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let resp = http()
        .post(format!("{}{path}", node.base))
        .json(&body)
        .send()
        .await
        .expect("stream");
    assert_eq!(resp.status(), 200);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(sse_lines(resp, tx));
    rx
}

/// The descriptor of a GGUF model at `path`, loaded as `id`.
pub fn desc(id: &str, path: &Path) -> ModelDescriptor {
    ModelDescriptor::new(id, path, Format::Gguf)
}

pub fn tiny(dir: &Path, spec: &TinyModelSpec) -> PathBuf {
    let p = dir.join(format!("{}.gguf", spec.name));
    write_tiny_gguf(&p, spec).expect("write tiny gguf");
    p
}

/// Greedy-generate `n` tokens for each prompt, all sequences stepped together.
pub fn generate_batched(exec: &mut ModelExec, prompts: &[Vec<i32>], n: usize) -> Vec<Vec<i32>> {
    let seqs: Vec<u64> = prompts
        .iter()
        .map(|_| exec.seq_open().expect("seq_open"))
        .collect();
    let outs = decode_together(exec, &seqs, prompts.to_vec(), n);
    for s in seqs {
        exec.seq_release(s);
    }
    outs
}

/// Step the open sequences `seqs` together `n` times, greedily: the first step feeds each its
/// `feed`, every later one the token it sampled. Returns each sequence's `n` tokens.
pub fn decode_together(
    exec: &mut ModelExec,
    seqs: &[u64],
    mut feed: Vec<Vec<i32>>,
    n: usize,
) -> Vec<Vec<i32>> {
    let g = Sampling::greedy();
    let mut outs: Vec<Vec<i32>> = vec![Vec::new(); seqs.len()];
    for _ in 0..n {
        let entries: Vec<StepEntry<'_>> = seqs
            .iter()
            .zip(&feed)
            .map(|(&seq, toks)| StepEntry {
                seq,
                tokens: toks,
                sample: Some(&g),
                fresh: false,
                allowed: None,
                sample_all: false,
            })
            .collect();
        let res = exec.step(&entries).expect("step");
        for (i, r) in res.into_iter().enumerate() {
            let t = r.expect("sampled").token;
            outs[i].push(t);
            feed[i] = vec![t];
        }
    }
    outs
}

/// The real Gemma 3 270M GGUF (`gantry_testkit::gemma_gguf`).
pub fn gemma_path() -> PathBuf {
    gantry_testkit::gemma_gguf()
}

/// One greedy step of `tokens` as the first entry of a new sequence of `exec`: its id and the
/// token sampled after it. The sequence stays open (the caller reads what the engine reports
/// about it, then releases it).
pub fn step_new_sequence(exec: &mut ModelExec, tokens: &[i32], fresh: bool) -> (u64, i32) {
    let seq = exec.seq_open().expect("seq_open");
    let g = Sampling::greedy();
    let out = exec
        .step(&[StepEntry {
            seq,
            tokens,
            sample: Some(&g),
            fresh,
            allowed: None,
            sample_all: false,
        }])
        .expect("step");
    (seq, out[0].as_ref().expect("sampled").token)
}

/// POST `body` as JSON to `path`; the status and the JSON answer (null when not JSON).
pub async fn post_json(
    node: &NodeProc,
    path: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let r = http()
        .post(format!("{}{path}", node.base))
        .json(&body)
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// `GET /v1/status`.
pub async fn node_status(node: &NodeProc) -> serde_json::Value {
    http()
        .get(format!("{}/v1/status", node.base))
        .send()
        .await
        .expect("status")
        .json()
        .await
        .expect("json")
}

/// `GET /metrics` as text.
pub async fn node_metrics(node: &NodeProc) -> String {
    http()
        .get(format!("{}/metrics", node.base))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}
