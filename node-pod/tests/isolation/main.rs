//! Engine isolation tests: the real `gantry-node` binary with plugins in `process` isolation
//! (a worker process per model) — every fault of the fault plugin (segfault, abort, SIGKILL
//! as the OOM killer sends it, a hang, a panic) ends one worker, the request gets the right
//! error, `/v1/status` and the metrics say what happened, the model comes back, and the
//! node keeps serving its other models; a worker killed during eight streams retries the
//! streams that had not started and ends the others with a clear error. Plugin updates: a new
//! version delivered by the plugin image's own copy code (as the operator's in-place delivery
//! runs it) is shadow-loaded under load with no failed request, a broken one is refused, and a
//! directory whose copy is in progress is left alone until it completes.

#[path = "../common/mod.rs"]
mod common;
mod updates;

use std::path::Path;
use std::time::{Duration, Instant};

use common::node_status as status;
use common::*;

pub(crate) async fn post(node: &NodeProc, body: Value) -> (u16, Value) {
    post_json(node, "/v1/completions", body).await
}
use serde_json::{Value, json};

pub(crate) fn model<'a>(status: &'a Value, id: &str) -> &'a Value {
    status["models"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["id"] == id))
        .unwrap_or_else(|| panic!("model {id} in {status}"))
}

pub(crate) fn worker_pid(status: &Value, id: &str) -> Option<u64> {
    model(status, id)["replicas"][0]["workerPid"].as_u64()
}

/// Wait (at most `limit`) until `id` is loaded in a worker other than `old`; its new pid.
pub(crate) async fn wait_restarted(
    node: &NodeProc,
    id: &str,
    old: Option<u64>,
    limit: Duration,
) -> u64 {
    let t0 = Instant::now();
    loop {
        let s = status(node).await;
        if let Some(pid) = worker_pid(&s, id)
            && Some(pid) != old
            && model(&s, id)["load"]["state"] == "loaded"
        {
            return pid;
        }
        assert!(
            t0.elapsed() < limit,
            "{id} was not back within {limit:?}: {}",
            model(&s, id)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) fn process_alive(pid: u64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.split(' ').nth(2) == Some("Z"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_fault_in_a_worker_ends_that_model_only_and_the_model_comes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugins = faulty_plugins(dir.path());
    let m = |id: &str, stem: &str| json!({"id": id, "path": toy_gguf(dir.path(), stem), "format": "gguf"});
    let config = json!({
        "models": [
            m("healthy", "healthy-model"),
            m("segv", "segv-model"),
            m("abort", "abort-model"),
            m("oomkill", "oomkill-model"),
            m("hang", "hang-model"),
            m("panicky", "panic-model"),
        ],
        "scheduler": {"stepTimeoutSeconds": 1, "responseCacheRamFraction": 0.0},
        "isolation": {"default": "process"}
    });
    let node = spawn_node(&config, &plugins, dir, |_| {});
    wait_ready(&node).await;

    let s = status(&node).await;
    assert_eq!(s["plugins"][0]["isolation"], "process", "{s}");
    let mut pids = std::collections::BTreeSet::new();
    for id in ["healthy", "segv", "abort", "oomkill", "hang", "panicky"] {
        let pid = worker_pid(&s, id).unwrap_or_else(|| panic!("{id} has no worker: {s}"));
        assert!(process_alive(pid), "{id}'s worker {pid} runs");
        pids.insert(pid);
    }
    assert_eq!(pids.len(), 6, "one worker per model");

    let healthy = json!({"model": "healthy", "prompt": "ab", "max_tokens": 3, "temperature": 0});
    for (id, signal, how) in [
        ("segv", Some("SIGSEGV"), "killed by SIGSEGV"),
        ("abort", Some("SIGABRT"), "killed by SIGABRT"),
        ("oomkill", Some("SIGKILL"), "killed by SIGKILL"),
        ("hang", Some("SIGKILL"), "killed by the watchdog"),
    ] {
        let old = worker_pid(&status(&node).await, id);
        let (code, v) = post(&node, json!({"model": id, "prompt": "hi", "max_tokens": 2})).await;
        // No token was sent: the request was retried once on the restarted model, which
        // failed the same way, and only then answered.
        assert_eq!(code, 503, "{id}: {v}");
        assert_eq!(v["error"]["code"], "engine_crashed", "{id}: {v}");
        let msg = v["error"]["message"].as_str().expect("message");
        assert!(
            msg.contains("plugin `faulty`") && msg.contains(how),
            "{id}: the error names the plugin and the signal: {msg}"
        );
        // The node and its other models are untouched.
        let (code, v) = post(&node, healthy.clone()).await;
        assert_eq!(
            (code, v["choices"][0]["text"].as_str()),
            (200, Some("cde")),
            "{id}: {v}"
        );
        let h = http()
            .get(format!("{}/healthz", node.base))
            .send()
            .await
            .expect("healthz");
        assert_eq!(
            h.status(),
            200,
            "{id}: a crashed worker does not fail the node's liveness"
        );

        let s = status(&node).await;
        let crashes = &model(&s, id)["crashes"];
        assert_eq!(
            crashes["count"], 2,
            "{id}: the crash and the retry's: {crashes}"
        );
        assert_eq!(crashes["signal"].as_str(), signal, "{id}: {crashes}");
        assert_eq!(
            crashes["reason"],
            if id == "hang" { "hung" } else { "crashed" },
            "{id}: {crashes}"
        );
        assert!(
            crashes["message"].as_str().is_some_and(|m| m.contains(how)),
            "{crashes}"
        );
        if let Some(pid) = old {
            assert!(!process_alive(pid), "{id}: the old worker is gone");
        }
        // The second crash in a row waits 1 s before the restart: meanwhile the model says so.
        let (code, v) = post(&node, json!({"model": id, "prompt": "hi", "max_tokens": 2})).await;
        if code == 503 && v["error"]["code"] == "engine_restarting" {
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(how)),
                "{v}"
            );
        }
        wait_restarted(&node, id, old, Duration::from_secs(15)).await;
    }

    // A panic is caught by the plugin's SDK inside the worker: an engine error, not a crash.
    let (code, v) = post(
        &node,
        json!({"model": "panicky", "prompt": "hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(code, 500, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("plugin panicked")),
        "{v}"
    );
    let s = status(&node).await;
    assert!(
        model(&s, "panicky")["crashes"].is_null(),
        "a panic is no crash: {s}"
    );
    assert!(model(&s, "healthy")["crashes"].is_null(), "{s}");

    let metrics = node_metrics(&node).await;
    for line in [
        r#"gantry_engine_crashes_total{model="segv",plugin="faulty",reason="crashed"} 2"#,
        r#"gantry_engine_crashes_total{model="hang",plugin="faulty",reason="hung"} 2"#,
        r#"gantry_engine_crash_retries_total{model="abort",result="retried"} 1"#,
    ] {
        assert!(metrics.contains(line), "missing `{line}`");
    }
    assert!(
        metrics.contains("gantry_engine_hung 0"),
        "a hung worker is killed; the node is not marked hung"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_during_eight_streams_retries_the_unstarted_and_ends_the_rest_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugins = faulty_plugins(dir.path());
    let config = json!({
        "models": [{"id": "slow", "path": toy_gguf(dir.path(), "slow-model"), "format": "gguf", "maxBatchSize": 4}],
        "scheduler": {"responseCacheRamFraction": 0.0},
        "isolation": {"plugins": {"faulty": "process"}}
    });
    let node = spawn_node(&config, &plugins, dir, |_| {});
    wait_ready(&node).await;
    let old = worker_pid(&status(&node).await, "slow").expect("worker");

    // Eight streams of 120 tokens at 25 ms a step: four run, four wait for a slot.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, &'static str, String)>();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (tx, base) = (tx.clone(), node.base.clone());
        tasks.push(tokio::spawn(async move {
            let r = http()
                .post(format!("{base}/v1/completions"))
                .json(&json!({"model": "slow", "prompt": "a", "max_tokens": 120, "stream": true}))
                .send()
                .await
                .expect("post");
            if r.status() != 200 {
                let body = r.text().await.unwrap_or_default();
                let _ = tx.send((i, "status", body));
                return;
            }
            let (etx, mut erx) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(sse_lines(r, etx));
            let mut first = true;
            while let Some(d) = erx.recv().await {
                if first {
                    let _ = tx.send((i, "first", String::new()));
                    first = false;
                }
                if d.contains("\"error\"") {
                    let _ = tx.send((i, "error", d));
                    return;
                }
                if d == "[DONE]" {
                    break;
                }
                if d.contains("\"finish_reason\":\"length\"") {
                    let _ = tx.send((i, "finished", d));
                }
            }
        }));
    }
    drop(tx);
    let mut started = std::collections::BTreeSet::new();
    let t0 = Instant::now();
    while started.len() < 4 {
        let (i, what, _) = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("four streams start")
            .expect("event");
        assert_eq!(what, "first", "stream {i}");
        started.insert(i);
    }
    assert!(t0.elapsed() < Duration::from_secs(20));
    let killed_at = Instant::now();
    // kill(1) by pid, as an operator or the OOM killer would.
    let st = std::process::Command::new("kill")
        .args(["-KILL", &old.to_string()])
        .status()
        .expect("kill");
    assert!(st.success());

    let new = wait_restarted(&node, "slow", Some(old), Duration::from_secs(10)).await;
    let back = killed_at.elapsed();
    eprintln!("the model was back {back:?} after its worker was killed");
    assert!(
        back < Duration::from_secs(10),
        "the model was back in {back:?}"
    );
    let mut ended = std::collections::BTreeMap::new();
    while let Ok(Some((i, what, body))) =
        tokio::time::timeout(Duration::from_secs(60), rx.recv()).await
    {
        if what == "first" {
            continue;
        }
        ended.insert(i, (what, body));
    }
    for t in tasks {
        t.await.expect("stream task");
    }
    assert_eq!(ended.len(), 8, "every stream ended: {ended:?}");
    for (i, (what, body)) in &ended {
        if started.contains(i) {
            assert_eq!(
                *what, "error",
                "stream {i} had tokens: it ends with an error: {body}"
            );
            assert!(
                body.contains("engine_crashed")
                    && body.contains("SIGKILL")
                    && body.contains("plugin `faulty`"),
                "stream {i}: {body}"
            );
        } else {
            assert_eq!(
                *what, "finished",
                "stream {i} had not started: it was retried and completed: {body}"
            );
        }
    }
    assert_ne!(new, old);
    let s = status(&node).await;
    let crashes = &model(&s, "slow")["crashes"];
    assert_eq!(crashes["count"], 1, "{crashes}");
    assert_eq!(crashes["signal"], "SIGKILL", "{crashes}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unloading_a_model_in_a_worker_ends_its_process() {
    // The memory policy's unload and a reload's removal both drop the model: its worker
    // exits, so every byte it held goes back to the system.
    let dir = tempfile::tempdir().expect("tempdir");
    let plugins = faulty_plugins(dir.path());
    let path = dir.path().to_path_buf();
    let cfg = path.join("node.yaml");
    let models = |ids: &[&str]| {
        json!({
            "models": ids.iter().map(|id| json!({"id": id, "path": toy_gguf(&path, id), "format": "gguf"})).collect::<Vec<_>>(),
            "isolation": {"default": "process"}
        })
    };
    std::fs::write(
        &cfg,
        serde_yaml::to_string(&models(&["a", "b"])).expect("yaml"),
    )
    .expect("write");
    let node = spawn_node_with_config(&cfg, &plugins, dir, |c| {
        c.args(["--config-reload-seconds", "1"]);
    });
    wait_ready(&node).await;
    let s = status(&node).await;
    let pid_b = worker_pid(&s, "b").expect("b's worker");
    assert!(process_alive(pid_b));
    std::fs::write(
        path.join("node.yaml"),
        serde_yaml::to_string(&models(&["a"])).expect("yaml"),
    )
    .expect("rewrite");
    let t0 = Instant::now();
    while process_alive(pid_b) {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "b's worker still runs after its removal"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, v) = post(
        &node,
        json!({"model": "a", "prompt": "ab", "max_tokens": 1, "temperature": 0}),
    )
    .await;
    assert_eq!(
        (code, v["choices"][0]["text"].as_str()),
        (200, Some("c")),
        "{v}"
    );
    // A node that stops takes its worker directory (sockets, pinned libraries) with it.
    let pid = node.child.id();
    let private = std::env::temp_dir().join(format!("gantry-workers-{pid}"));
    assert!(
        private.is_dir(),
        "{} exists while the node runs",
        private.display()
    );
    let mut node = node;
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(st.success());
    let t0 = Instant::now();
    while node.child.try_wait().expect("wait").is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "the node did not stop"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!private.exists(), "{} is left behind", private.display());
}
