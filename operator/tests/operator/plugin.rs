//! EnginePlugin reconcile against a mock API server: Accepted from the spec and the node
//! image's ABI, Loaded / loadedBy / loadErrors from the node pods' reports.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gantry_api::{NodeStatus, PluginStatus};
use gantry_crd::{EnginePlugin, EnginePluginStatus};
use gantry_operator::plugin;
use http::Method;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use crate::support::{Recorded, Step, condition, context, finish, fixture_plugins};

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
