//! Engine isolation tests, plugin updates: a new version delivered by the plugin image's own
//! copy code (as the operator's in-place delivery runs it) is shadow-loaded under load with no
//! failed request, a broken one is refused, a directory whose copy is in progress is left alone
//! until it completes, and a version with no room for a second copy is refused.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::node_status as status;
use crate::common::*;
use crate::{post, process_alive, worker_pid};
use serde_json::{Value, json};

/// Deliver `lib` as the faulty plugin's library with a manifest of `version` into the plugin
/// directory `dir`, as the operator's in-place delivery does: the plugin image's own copy code
/// (`gantry_copy::deliver`, the `/copy` of an ephemeral container) copies a plugin directory
/// laid out as in an image over the live one.
fn put_version(dir: &Path, lib: &Path, version: &str) {
    let image = tempfile::tempdir().expect("image dir");
    std::fs::copy(lib, image.path().join("libgantry_fault_faulty.so")).expect("copy library");
    let mut m = faulty_manifest("faulty");
    m["version"] = json!(version);
    std::fs::write(
        image.path().join("manifest.json"),
        serde_json::to_vec_pretty(&m).expect("json"),
    )
    .expect("manifest");
    let (copied, _) = gantry_copy::deliver(image.path(), dir).expect("deliver");
    assert_eq!(copied, 2);
}

/// A plugin tree holding the faulty plugin at 0.1.0, and the config of a node serving model
/// `slow` from it in `process` isolation (`model` adds fields to the model's entry, `top`
/// top-level keys). The tree is `<dir>/plugins`; the plugin's directory is returned.
fn faulty_plugin_at_0_1(
    model: Value,
    top: Value,
) -> (tempfile::TempDir, std::path::PathBuf, Value) {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin_dir = dir.path().join("plugins/faulty/cpu");
    std::fs::create_dir_all(&plugin_dir).expect("plugin dir");
    put_version(&plugin_dir, &built_lib("gantry_fault_faulty"), "0.1.0");
    let mut entry =
        json!({"id": "slow", "path": toy_gguf(dir.path(), "slow-model"), "format": "gguf"});
    for (k, v) in model.as_object().into_iter().flatten() {
        entry[k] = v.clone();
    }
    let mut config = json!({"models": [entry], "isolation": {"default": "process"}});
    for (k, v) in top.as_object().into_iter().flatten() {
        config[k] = v.clone();
    }
    (dir, plugin_dir, config)
}

async fn plugin_status(node: &NodeProc) -> Value {
    status(node).await["plugins"][0].clone()
}

/// Wait (at most 15 s) until the plugin's last update is in `state`; the plugin's status.
async fn wait_update(node: &NodeProc, state: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let p = plugin_status(node).await;
        if p["update"]["state"] == state {
            return p;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "no update {state}: {p}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 6)]
async fn a_new_plugin_version_is_shadow_loaded_under_load_and_a_broken_one_is_refused() {
    let (dir, plugin_dir, config) = faulty_plugin_at_0_1(
        json!({"maxBatchSize": 8}),
        json!({"scheduler": {"responseCacheRamFraction": 0.0}}),
    );
    let plugins = dir.path().join("plugins");
    let node = spawn_node(&config, &plugins, dir, |c| {
        c.args(["--plugin-reload-seconds", "1"]);
    });
    wait_ready(&node).await;
    let first = worker_pid(&status(&node).await, "slow").expect("worker");
    assert_eq!(plugin_status(&node).await["version"], "0.1.0");

    // Four clients stream one-second answers back to back for 24 s (bounded), while the
    // plugin is replaced by a new version and then by a broken one.
    let stop_at = Instant::now() + Duration::from_secs(24);
    let mut clients = Vec::new();
    for c in 0..4 {
        let base = node.base.clone();
        clients.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while Instant::now() < stop_at {
                let r = http()
                    .post(format!("{base}/v1/completions"))
                    .json(&json!({"model": "slow", "prompt": format!("c{c}"), "max_tokens": 40, "stream": true}))
                    .send()
                    .await
                    .expect("post");
                if r.status() != 200 {
                    failed.push(format!("HTTP {}: {}", r.status(), r.text().await.unwrap_or_default()));
                    continue;
                }
                let body = r.text().await.expect("body");
                if body.contains("\"finish_reason\":\"length\"") && body.trim_end().ends_with("data: [DONE]") {
                    ok += 1;
                } else {
                    failed.push(body);
                }
            }
            (ok, failed)
        }));
    }

    tokio::time::sleep(Duration::from_secs(4)).await;
    put_version(&plugin_dir, &built_lib("gantry_fault_faulty"), "0.2.0");
    let applied = wait_update(&node, "applied").await;
    assert_eq!(applied["version"], "0.2.0", "{applied}");
    assert_eq!(applied["update"]["models"], json!(["slow"]), "{applied}");
    let second = worker_pid(&status(&node).await, "slow").expect("worker");
    assert_ne!(second, first, "the model runs in a new worker");
    // The old worker finishes the streams it had, then stops.
    let t1 = Instant::now();
    while process_alive(first) {
        assert!(
            t1.elapsed() < Duration::from_secs(10),
            "the old worker still runs"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    tokio::time::sleep(Duration::from_secs(3)).await;
    put_version(&plugin_dir, &built_lib("gantry_fault_wrong_abi"), "0.3.0");
    let refused = wait_update(&node, "refused").await;
    let msg = refused["update"]["message"].as_str().expect("message");
    assert!(msg.contains("ABI"), "the refusal says why: {msg}");
    assert_eq!(refused["update"]["version"], "0.3.0", "{refused}");
    assert_eq!(
        refused["version"], "0.2.0",
        "the old version keeps serving: {refused}"
    );
    assert_eq!(refused["loaded"], true, "{refused}");
    assert_eq!(
        worker_pid(&status(&node).await, "slow"),
        Some(second),
        "no switch for a refused version"
    );

    let mut total = 0;
    for c in clients {
        let (ok, failed) = c.await.expect("client");
        assert!(
            failed.is_empty(),
            "failed requests during the updates: {failed:?}"
        );
        total += ok;
    }
    assert!(total >= 40, "the load ran throughout ({total} requests)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plugin_directory_marked_as_being_copied_is_left_alone_until_the_copy_completes() {
    // The marker the plugin image's `/copy` helper puts in a directory while it delivers.
    assert_eq!(
        gantry_node::engine_host::COPY_IN_PROGRESS,
        gantry_copy::IN_PROGRESS
    );
    let (dir, plugin_dir, config) = faulty_plugin_at_0_1(json!({}), json!({}));
    let plugins = dir.path().join("plugins");
    let node = spawn_node(&config, &plugins, dir, |c| {
        c.args(["--plugin-reload-seconds", "1"]);
    });
    wait_ready(&node).await;
    let first = worker_pid(&status(&node).await, "slow").expect("worker");

    // A new version's files arrive while the marker is there: three checks later the node
    // still runs the old version and has not looked at the new one.
    // A copy stopped half-way: the marker, the new library, and the new manifest.
    let marker = plugin_dir.join(gantry_copy::IN_PROGRESS);
    std::fs::write(&marker, b"").expect("marker");
    std::fs::copy(
        built_lib("gantry_fault_faulty"),
        plugin_dir.join("libgantry_fault_faulty.so.new"),
    )
    .expect("library");
    std::fs::rename(
        plugin_dir.join("libgantry_fault_faulty.so.new"),
        plugin_dir.join("libgantry_fault_faulty.so"),
    )
    .expect("rename");
    let mut manifest = faulty_manifest("faulty");
    manifest["version"] = json!("0.2.0");
    std::fs::write(
        plugin_dir.join("manifest.json"),
        serde_json::to_vec_pretty(&manifest).expect("json"),
    )
    .expect("manifest");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let during = plugin_status(&node).await;
    assert_eq!(during["version"], "0.1.0", "{during}");
    assert!(during["update"].is_null(), "no update yet: {during}");
    assert_eq!(worker_pid(&status(&node).await, "slow"), Some(first));

    // The copy completes: the next check shadow-loads the new version.
    std::fs::remove_file(&marker).expect("unmark");
    let applied = wait_update(&node, "applied").await;
    assert_eq!(applied["version"], "0.2.0", "{applied}");
    assert_ne!(worker_pid(&status(&node).await, "slow"), Some(first));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_version_with_no_room_for_a_second_copy_is_refused_and_the_old_one_serves() {
    // What the model holds, measured on a node without a limit.
    let held = {
        let (dir, _, config) = faulty_plugin_at_0_1(json!({}), json!({}));
        let plugins = dir.path().join("plugins");
        let node = spawn_node(&config, &plugins, dir, |_| {});
        wait_ready(&node).await;
        status(&node).await["memory"]["usedBytes"]
            .as_u64()
            .expect("usedBytes")
    };
    assert!(held > 0);

    // A RAM limit with room for one and a half copies: the update cannot load beside the
    // running version, so it is refused before anything loads.
    let (dir, plugin_dir, config) = faulty_plugin_at_0_1(json!({}), json!({}));
    let plugins = dir.path().join("plugins");
    let limit = held * 3 / 2;
    let node = spawn_node(&config, &plugins, dir, |c| {
        c.args([
            "--plugin-reload-seconds",
            "1",
            "--ram-limit",
            &limit.to_string(),
        ]);
    });
    wait_ready(&node).await;
    let first = worker_pid(&status(&node).await, "slow").expect("worker");
    put_version(&plugin_dir, &built_lib("gantry_fault_faulty"), "0.2.0");
    let refused = wait_update(&node, "refused").await;
    let msg = refused["update"]["message"].as_str().expect("message");
    assert!(
        msg.contains("no room for a second copy while both versions run")
            && msg.contains("OOM_RAM"),
        "{msg}"
    );
    assert_eq!(refused["version"], "0.1.0", "{refused}");
    assert_eq!(worker_pid(&status(&node).await, "slow"), Some(first));
    let (code, body) = post(
        &node,
        json!({"model": "slow", "prompt": "still here", "max_tokens": 2}),
    )
    .await;
    assert_eq!(code, 200, "{body}");
}
