//! EnginePlugin reconcile against a mock API server: Accepted from the spec and the node
//! image's ABI, Loaded / loadedBy / loadErrors / versions / updates from the node pods' reports.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gantry_api::{NodeStatus, PluginStatus, PluginUpdate};
use gantry_crd::{EnginePlugin, EnginePluginStatus};
use gantry_operator::plugin;
use http::Method;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use crate::support::{
    Recorded, Step, condition, context, finish, fixture_plugins, repo_dir, yaml_docs,
};

fn llama_cpu() -> EnginePlugin {
    fixture_plugins().remove(0)
}

fn pod(ns: &str, name: &str, ip: &str, plugins: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": ns,
                        "labels": {"app.kubernetes.io/name": "gantry-node", "app.kubernetes.io/managed-by": "gantry-operator"},
                        "annotations": {"gantry.dev/engine-plugins": plugins}},
           "status": {"phase": "Running", "podIP": ip}})
}

fn node(plugins: Vec<PluginStatus>) -> NodeStatus {
    NodeStatus {
        version: "0.1.0".into(),
        backend: "cpu".into(),
        ready: true,
        draining: false,
        plugins,
        models: Vec::new(),
        ..NodeStatus::default()
    }
}

fn plugin_status(loaded: bool, reason: Option<&str>, message: Option<&str>) -> PluginStatus {
    PluginStatus {
        id: "llama_cpp".into(),
        version: Some("0.1.0".into()),
        abi_version: Some("1".into()),
        gpu_backend: Some("cpu".into()),
        build_info: None,
        loaded,
        isolation: "inProcess".into(),
        reason: reason.map(Into::into),
        message: message.map(Into::into),
        update: None,
    }
}

fn status_patch(p: &EnginePlugin) -> Step {
    let name = p.metadata.name.clone().unwrap_or_default();
    Step::apply_status(
        format!("/apis/gantry.dev/v1alpha1/engineplugins/{name}/status"),
        serde_json::to_value(p).expect("json"),
    )
}

fn status_body(recorded: &[Recorded]) -> Value {
    recorded
        .iter()
        .find(|r| r.path.ends_with("/status"))
        .and_then(|r| r.body.clone())
        .expect("status patch")["status"]
        .clone()
}

async fn run(
    p: EnginePlugin,
    ctx: Arc<gantry_operator::context::Context>,
) -> Result<Action, plugin::Error> {
    plugin::reconcile(Arc::new(DeserializeGuard(Ok(p))), ctx).await
}

#[tokio::test]
async fn a_loaded_plugin_is_accepted_and_lists_the_pods_that_loaded_it() {
    let p = llama_cpu();
    let nodes = BTreeMap::from([
        (
            "10.0.0.1".to_string(),
            node(vec![plugin_status(true, None, None)]),
        ),
        (
            "10.0.0.2".to_string(),
            node(vec![plugin_status(true, None, None)]),
        ),
    ]);
    let (ctx, mut server) = context(fixture_plugins(), nodes);
    server.seed([
        pod("default", "gemma-a", "10.0.0.1", "llama-cpp-cpu"),
        pod("team-a", "qwen-b", "10.0.0.2", "llama-cpp-cpu,tinyllm-cpu"),
        pod("default", "other-c", "10.0.0.3", "tinyllm-cpu"),
    ]);
    let server = server.run(vec![
        status_patch(&p),
        Step::event("default"),
        Step::event("default"),
    ]);
    let action = run(p.clone(), ctx.clone()).await.expect("reconcile");
    let recorded = finish(server).await;
    // Report changes wake the plugin through the poller; the requeue is a safety net.
    assert_ne!(action, Action::await_change());
    assert_eq!(
        recorded[0].method,
        Method::PATCH,
        "no read: pods come from the cache"
    );
    let status = status_body(&recorded);
    assert_eq!(condition(&status, "Accepted")["status"], "True");
    assert_eq!(condition(&status, "Loaded")["status"], "True");
    assert_eq!(
        status["loadedBy"],
        json!(["default/gemma-a", "team-a/qwen-b"])
    );
    assert!(status.get("loadErrors").is_none());

    // Stored back, the same world produces no write at all.
    let mut stored = p;
    stored.status = Some(serde_json::from_value::<EnginePluginStatus>(status).expect("status"));
    let nodes = BTreeMap::from([
        (
            "10.0.0.1".to_string(),
            node(vec![plugin_status(true, None, None)]),
        ),
        (
            "10.0.0.2".to_string(),
            node(vec![plugin_status(true, None, None)]),
        ),
    ]);
    let (ctx, mut server) = context(fixture_plugins(), nodes);
    server.seed([
        pod("default", "gemma-a", "10.0.0.1", "llama-cpp-cpu"),
        pod("team-a", "qwen-b", "10.0.0.2", "llama-cpp-cpu,tinyllm-cpu"),
    ]);
    let server = server.run(Vec::new());
    run(stored, ctx.clone()).await.expect("steady state");
    assert!(finish(server).await.is_empty(), "not a read, not a write");
    assert_eq!(ctx.metrics.total_writes(), 0);
}

#[tokio::test]
async fn load_errors_reported_by_node_pods_are_listed_with_their_reasons() {
    let p = llama_cpu();
    let failures = [
        (
            "10.0.0.1",
            "abi_mismatch",
            "ABI version mismatch: expected 1, got 2",
        ),
        (
            "10.0.0.2",
            "id_conflict",
            "Plugin ID conflict: llama_cpp already loaded",
        ),
        (
            "10.0.0.3",
            "binary_not_found",
            "Binary not found: /opt/gantry/engines/llama_cpp/cpu/lib.so",
        ),
        (
            "10.0.0.4",
            "sha256_mismatch",
            "sha256 mismatch for lib.so: expected aa, got bb",
        ),
    ];
    let nodes: BTreeMap<String, NodeStatus> = failures
        .iter()
        .map(|(ip, reason, msg)| {
            (
                ip.to_string(),
                node(vec![plugin_status(false, Some(reason), Some(msg))]),
            )
        })
        .collect();
    let pods: Vec<Value> = failures
        .iter()
        .enumerate()
        .map(|(i, (ip, _, _))| pod("default", &format!("node-{i}"), ip, "llama-cpp-cpu"))
        .collect();
    let (ctx, mut server) = context(fixture_plugins(), nodes);
    server.seed(pods);
    let server = server.run(vec![
        status_patch(&p),
        Step::event("default"),
        Step::event("default"),
    ]);
    run(p, ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    let loaded = condition(&status, "Loaded");
    assert_eq!(
        (loaded["status"].as_str(), loaded["reason"].as_str()),
        (Some("False"), Some("LoadErrors"))
    );
    let reasons: Vec<&str> = status["loadErrors"]
        .as_array()
        .expect("errors")
        .iter()
        .filter_map(|e| e["reason"].as_str())
        .collect();
    assert_eq!(
        reasons,
        [
            "abi_mismatch",
            "id_conflict",
            "binary_not_found",
            "sha256_mismatch"
        ]
    );
    assert_eq!(status["loadErrors"][0]["pod"], "default/node-0");
}

#[tokio::test]
async fn a_plugin_for_another_abi_is_not_accepted() {
    let mut p = llama_cpu();
    p.spec.abi_version = 2;
    let (ctx, server) = context(vec![p.clone()], BTreeMap::new());
    let server = server.run(vec![status_patch(&p), Step::event("default")]);
    run(p, ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    let accepted = condition(&status, "Accepted");
    assert_eq!(
        (accepted["status"].as_str(), accepted["reason"].as_str()),
        (Some("False"), Some("AbiMismatch"))
    );
    assert!(
        accepted["message"]
            .as_str()
            .is_some_and(|m| m.contains("supports ABI 1, the plugin declares 2"))
    );
    assert_eq!(condition(&status, "Loaded")["reason"], "NotMounted");
}

#[tokio::test]
async fn a_second_plugin_for_the_same_engine_and_backend_is_not_accepted() {
    let first = llama_cpu();
    let mut second = first.clone();
    second.metadata.name = Some("llama-cpp-cpu-nightly".into());
    second.spec.version = "0.2.0".into();
    let (ctx, server) = context(vec![first, second.clone()], BTreeMap::new());
    let server = server.run(vec![status_patch(&second), Step::event("default")]);
    run(second, ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    let accepted = condition(&status, "Accepted");
    assert_eq!(accepted["reason"], "EngineIdConflict");
    assert!(
        accepted["message"]
            .as_str()
            .is_some_and(|m| m.contains("already provided by EnginePlugin llama-cpp-cpu"))
    );
}

#[tokio::test]
async fn a_failing_status_write_backs_off() {
    let p = llama_cpu();
    let (ctx, server) = context(fixture_plugins(), BTreeMap::new());
    let server = server.run(vec![Step::fail(
        Method::PATCH,
        "/apis/gantry.dev/v1alpha1/engineplugins/llama-cpp-cpu/status",
        500,
    )]);
    let obj = Arc::new(DeserializeGuard(Ok(p)));
    let err = plugin::reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("500");
    finish(server).await;
    assert_eq!(err.metric_label(), "status_patch");
    assert_eq!(
        plugin::error_policy(obj, &err, ctx),
        Action::requeue(Duration::from_secs(5))
    );
}

fn on_version(version: &str, isolation: &str) -> PluginStatus {
    PluginStatus {
        version: Some(version.into()),
        isolation: isolation.into(),
        ..plugin_status(true, None, None)
    }
}

fn with_update(mut p: PluginStatus, version: &str, state: &str, message: &str) -> PluginStatus {
    p.update = Some(PluginUpdate {
        version: Some(version.into()),
        state: state.into(),
        message: message.into(),
        models: Vec::new(),
        seconds_ago: 12,
    });
    p
}

/// Three node pods (`default/node-0..2`, `10.0.0.1..3`) mounting the plugin, their reports.
fn three_pods(statuses: [PluginStatus; 3]) -> (BTreeMap<String, NodeStatus>, Vec<Value>) {
    let nodes = statuses
        .into_iter()
        .enumerate()
        .map(|(i, p)| (format!("10.0.0.{}", i + 1), node(vec![p])))
        .collect();
    let pods = (0..3)
        .map(|i| {
            pod(
                "default",
                &format!("node-{i}"),
                &format!("10.0.0.{}", i + 1),
                "llama-cpp-cpu",
            )
        })
        .collect();
    (nodes, pods)
}

#[tokio::test]
async fn versions_count_the_node_pods_per_version_and_updates_list_the_ones_not_applied() {
    let p = llama_cpu();
    let refused = "plugin llama_cpp 0.3.0 refused: warm-up failed for model gemma (engine error: \
                   out of memory); 0.1.0 keeps serving";
    let world = || {
        three_pods([
            with_update(on_version("0.1.0", "process"), "0.3.0", "refused", refused),
            on_version("0.2.0", "process"),
            // An applied update is already the version in force: not listed again.
            with_update(
                on_version("0.1.0", "process"),
                "0.1.0",
                "applied",
                "2 model(s) switched",
            ),
        ])
    };
    let (nodes, pods) = world();
    let (ctx, mut server) = context(fixture_plugins(), nodes);
    server.seed(pods);
    let server = server.run(vec![
        status_patch(&p),
        Step::event("default"),
        Step::event("default"),
    ]);
    run(p.clone(), ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    assert_eq!(
        status["versions"],
        json!([
            {"version": "0.1.0", "isolation": "process", "pods": 2,
             "examplePods": ["default/node-0", "default/node-2"]},
            {"version": "0.2.0", "isolation": "process", "pods": 1,
             "examplePods": ["default/node-1"]},
        ])
    );
    assert_eq!(
        status["updates"],
        json!([{"pod": "default/node-0", "version": "0.3.0", "state": "refused",
                "message": refused}])
    );
    assert!(status.get("versionsOmitted").is_none());
    assert!(status.get("updatesOmitted").is_none());
    // A refused update leaves the plugin loaded.
    assert_eq!(condition(&status, "Loaded")["status"], "True");

    // Stored back, the same world with only the updates' ages counting up writes nothing.
    let mut stored = p;
    stored.status = Some(serde_json::from_value::<EnginePluginStatus>(status).expect("status"));
    let (mut nodes, pods) = world();
    for n in nodes.values_mut() {
        for u in n.plugins.iter_mut().filter_map(|p| p.update.as_mut()) {
            u.seconds_ago += 300;
        }
    }
    let (ctx, mut server) = context(fixture_plugins(), nodes);
    server.seed(pods);
    let server = server.run(Vec::new());
    run(stored, ctx.clone()).await.expect("steady state");
    assert!(finish(server).await.is_empty(), "not a read, not a write");
    assert_eq!(ctx.metrics.total_writes(), 0);
}

#[tokio::test]
async fn an_in_process_plugin_waiting_for_a_restart_shows_in_updates() {
    let p = llama_cpu();
    let message = "llama_cpp 0.2.0 is in place; an inProcess plugin changes on the next restart";
    let (nodes, pods) = three_pods([
        on_version("0.1.0", "inProcess"),
        on_version("0.1.0", "inProcess"),
        with_update(
            on_version("0.1.0", "inProcess"),
            "0.2.0",
            "restartRequired",
            message,
        ),
    ]);
    let (ctx, mut server) = context(fixture_plugins(), nodes);
    server.seed(pods);
    let server = server.run(vec![
        status_patch(&p),
        Step::event("default"),
        Step::event("default"),
    ]);
    run(p, ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    assert_eq!(
        status["versions"],
        json!([{"version": "0.1.0", "isolation": "inProcess", "pods": 3,
                "examplePods": ["default/node-0", "default/node-1", "default/node-2"]}])
    );
    assert_eq!(
        status["updates"],
        json!([{"pod": "default/node-2", "version": "0.2.0", "state": "restartRequired",
                "message": message}])
    );
}

#[tokio::test]
async fn versions_and_updates_stay_bounded_for_many_node_pods() {
    let p = llama_cpu();
    // 30 pods on 12 versions (0.1.0 .. 0.12.0; pod i on 0.(i % 12 + 1).0), each with a
    // refused update.
    let mut nodes = BTreeMap::new();
    let mut pods = Vec::new();
    for i in 0..30 {
        let ip = format!("10.0.1.{i}");
        let status = with_update(
            on_version(&format!("0.{}.0", i % 12 + 1), "process"),
            "0.13.0",
            "refused",
            "sha256 mismatch",
        );
        nodes.insert(ip.clone(), node(vec![status]));
        pods.push(pod(
            "default",
            &format!("node-{i:02}"),
            &ip,
            "llama-cpp-cpu",
        ));
    }
    let (ctx, mut server) = context(fixture_plugins(), nodes);
    server.seed(pods);
    let server = server.run(vec![
        status_patch(&p),
        Step::event("default"),
        Step::event("default"),
    ]);
    run(p, ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    // 0.1.0 .. 0.6.0 have 3 pods, 0.7.0 .. 0.12.0 have 2: the six with 3 and the four lowest
    // with 2 stay, in numeric version order (0.10.0 after 0.9.0); 0.11.0 and 0.12.0 are left
    // out with their 4 pods.
    let rows: Vec<(&str, i64)> = status["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .map(|r| {
            (
                r["version"].as_str().unwrap_or_default(),
                r["pods"].as_i64().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("0.1.0", 3),
            ("0.2.0", 3),
            ("0.3.0", 3),
            ("0.4.0", 3),
            ("0.5.0", 3),
            ("0.6.0", 3),
            ("0.7.0", 2),
            ("0.8.0", 2),
            ("0.9.0", 2),
            ("0.10.0", 2),
        ]
    );
    assert_eq!(
        status["versions"][0]["examplePods"],
        json!(["default/node-00", "default/node-12", "default/node-24"])
    );
    assert_eq!(status["versionsOmitted"], 4);
    let updates = status["updates"].as_array().expect("updates");
    assert_eq!(updates.len(), 20);
    assert_eq!(updates[0]["pod"], "default/node-00");
    assert_eq!(updates[19]["pod"], "default/node-19");
    assert_eq!(status["updatesOmitted"], 10);
}

#[test]
fn the_example_engine_plugin_mirrors_the_llama_cpp_manifest() {
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_dir().join("engines/llama-cpp/manifest.json"))
            .expect("manifest"),
    )
    .expect("json");
    let plugin: EnginePlugin =
        yaml_docs(&repo_dir().join("docs/examples/engineplugin-llama-cpp-cpu.yaml")).remove(0);
    assert_eq!(manifest["id"], plugin.spec.engine_id.as_str());
    assert_eq!(manifest["version"], plugin.spec.version.as_str());
    assert_eq!(
        manifest["abi_version"],
        plugin.spec.abi_version.to_string().as_str()
    );
    assert_eq!(manifest["gpu_backend"], plugin.spec.gpu_backend.as_str());
    assert_eq!(
        manifest["formats"],
        serde_json::to_value(&plugin.spec.formats).expect("json")
    );
    assert_eq!(
        manifest["modalities"],
        serde_json::to_value(&plugin.spec.modalities).expect("json")
    );
    assert_eq!(
        manifest["architectures"],
        serde_json::to_value(&plugin.spec.architectures).expect("json")
    );
}
