//! Engine isolation through the Model reconcile, against a mock API server: an EnginePlugin's
//! `spec.isolation` in the rendered node config (and so on the pods' config hash), and the
//! node pods' engine worker crashes folded into `EngineHealthy` and `Degraded`.

use std::collections::BTreeMap;

use gantry_api::config::Isolation;
use gantry_api::{CrashStatus, NodeStatus};
use gantry_crd::{EnginePlugin, Model, ModelStatus};
use gantry_operator::report_cache::fingerprint;
use http::Method;
use serde_json::{Value, json};

use crate::reconcile::{
    applies, desired, example_model, example_plugins, llama_cpp_entry, node_report, ns_name, pods,
    reads, ready_deployment, run, running_pod, status_body, status_patch, status_then_events,
    supported,
};
use crate::support::{
    ApiServer, Recorded, Step, condition, context, finish, fixture_model, fixture_plugins, path,
};

const POD_IP: &str = "10.0.0.5";

/// `plugins` with `spec.isolation` set on the one named `name`.
fn with_isolation(
    mut plugins: Vec<EnginePlugin>,
    name: &str,
    mode: Isolation,
) -> Vec<EnginePlugin> {
    for p in &mut plugins {
        if p.metadata.name.as_deref() == Some(name) {
            p.spec.isolation = Some(mode);
        }
    }
    plugins
}

/// The body of the ConfigMap apply among `recorded`.
fn config_map_body(recorded: &[Recorded]) -> Value {
    recorded
        .iter()
        .find(|r| r.method == Method::PATCH && r.path.contains("/configmaps/"))
        .and_then(|r| r.body.clone())
        .expect("a ConfigMap apply")
}

/// The node config (`models.yaml`) of a ConfigMap, as YAML the node would read.
fn node_config(config_map: &Value) -> serde_yaml::Value {
    let text = config_map["data"]["models.yaml"]
        .as_str()
        .expect("models.yaml");
    serde_yaml::from_str(text).expect("yaml")
}

/// The first reconcile of `m` with `plugins` and no node pod yet: what it applies.
async fn first_reconcile(m: &Model, plugins: Vec<EnginePlugin>, events: usize) -> Vec<Recorded> {
    let (ctx, mut server) = context(plugins, BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(m));
    steps.push(status_patch(m));
    steps.extend((0..events).map(|_| Step::event("default")));
    let server = server.run(steps);
    run(m.clone(), ctx).await.expect("reconcile");
    finish(server).await
}

#[tokio::test]
async fn an_engine_plugin_in_process_isolation_puts_its_mode_in_the_rendered_config_map() {
    let m = example_model();
    let plugins = with_isolation(example_plugins(), "llama-cpp-cpu", Isolation::Process);
    // The example declares its architecture: EngineResolved turns True at once (one Event).
    let recorded = first_reconcile(&m, plugins, 1).await;
    let cm = config_map_body(&recorded);
    let yaml = cm["data"]["models.yaml"].as_str().expect("models.yaml");
    assert!(
        yaml.ends_with("isolation:\n  default: inProcess\n  plugins:\n    llama_cpp: process\n"),
        "{yaml}"
    );
    let config: gantry_api::NodeConfig = serde_yaml::from_str(yaml).expect("a node config");
    assert_eq!(config.isolation.default, Isolation::InProcess);
    assert_eq!(config.isolation.for_plugin("llama_cpp"), Isolation::Process);
    // The pod template carries the hash of exactly this document.
    let deploy = recorded
        .iter()
        .find(|r| r.method == Method::PATCH && r.path.ends_with("/deployments/gemma-3-270m"))
        .and_then(|r| r.body.clone())
        .expect("deployment");
    assert_eq!(
        deploy["spec"]["template"]["metadata"]["annotations"]["gantry.dev/config-hash"],
        gantry_operator::model::node_config::short_hash(yaml.as_bytes())
    );
}

#[tokio::test]
async fn a_model_whose_plugins_set_no_isolation_renders_no_isolation_key() {
    let m = example_model();
    let recorded = first_reconcile(&m, example_plugins(), 1).await;
    let config = node_config(&config_map_body(&recorded));
    assert!(
        config.get("isolation").is_none(),
        "the node's default applies: {config:?}"
    );
}

#[tokio::test]
async fn isolation_covers_every_plugin_the_pods_may_mount_and_no_other() {
    // No architecture yet: both CPU plugins are mounted. The CUDA build of llama_cpp asks for
    // `process` too, but a CPU Model's pods never mount it: its wish must not reach them.
    let m = fixture_model("cpu");
    let plugins = with_isolation(fixture_plugins(), "tinyllm-cpu", Isolation::Process);
    let plugins = with_isolation(plugins, "llama-cpp-cpu", Isolation::InProcess);
    let plugins = with_isolation(plugins, "llama-cpp-cuda", Isolation::Process);
    let recorded = first_reconcile(&m, plugins, 0).await;
    let config = node_config(&config_map_body(&recorded));
    assert_eq!(
        serde_json::to_value(&config["isolation"]).expect("json"),
        json!({"default": "inProcess",
               "plugins": {"llama_cpp": "inProcess", "tinyllm": "process"}})
    );
}

/// The Deployment's `gantry.dev/config-hash` for `m` with `plugins`.
fn pod_config_hash(m: &Model, plugins: &[EnginePlugin]) -> Value {
    let o = desired(m, plugins, Some("gemma3"));
    serde_json::to_value(&o.deployment).expect("json")["spec"]["template"]["metadata"]
        ["annotations"]["gantry.dev/config-hash"]
        .clone()
}

#[test]
fn changing_a_plugins_isolation_changes_the_config_hash_so_the_pods_roll() {
    // The node opens a plugin once, in the mode it started with: only new pods change it.
    let m = example_model();
    let unset = pod_config_hash(&m, &example_plugins());
    let process = pod_config_hash(
        &m,
        &with_isolation(example_plugins(), "llama-cpp-cpu", Isolation::Process),
    );
    let in_process = pod_config_hash(
        &m,
        &with_isolation(example_plugins(), "llama-cpp-cpu", Isolation::InProcess),
    );
    assert!(unset.is_string());
    assert_ne!(unset, process);
    assert_ne!(process, in_process);
    assert_ne!(unset, in_process, "an explicit mode is written as set");
}

#[tokio::test]
async fn the_first_report_narrows_the_mounts_but_keeps_the_config_and_its_isolation() {
    // The pods started with both CPU plugins mounted; the report names the architecture, so
    // the Deployment drops tinyllm, but the config (and its isolation) is the one they run.
    let m = fixture_model("cpu");
    let plugins = with_isolation(fixture_plugins(), "llama-cpp-cpu", Isolation::Process);
    let o = desired(&m, &plugins, None);
    let (ctx, mut server) = context(plugins, node_report("gemma-3-270m", "gemma3", supported()));
    let (ns, name) = ns_name(&m);
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(ready_deployment(&o)),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    pods(&mut server, vec![running_pod(&m, &o)]);
    // The Deployment only: no ConfigMap write.
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)));
    steps.push(status_patch(&m));
    steps.extend([Step::event(&ns), Step::event(&ns)]);
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let deploy = recorded
        .iter()
        .find(|r| r.method == Method::PATCH && r.path.contains("/deployments/"))
        .and_then(|r| r.body.clone())
        .expect("deployment");
    let annotations = &deploy["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["gantry.dev/engine-plugins"], "llama-cpp-cpu");
    assert_eq!(
        annotations["gantry.dev/config-hash"],
        o.config_hash.as_str()
    );
    assert!(o.config_map.data.as_ref().is_some_and(|d| {
        d.values()
            .any(|y| y.contains("  plugins:\n    llama_cpp: process\n"))
    }));
}

// --- EngineHealthy: engine worker crashes from the node reports ---

/// A crash record as the node reports it.
fn crash(seconds_ago: u64, restart_in_seconds: u64) -> CrashStatus {
    CrashStatus {
        count: 3,
        consecutive: 2,
        plugin: "llama_cpp".into(),
        reason: "crashed".into(),
        signal: Some("SIGSEGV".into()),
        exit_code: None,
        message: "the engine worker of plugin `llama_cpp` for model `gemma-3-270m` (pid 4242) killed by SIGSEGV".into(),
        seconds_ago,
        restart_in_seconds,
    }
}

/// The example Model's node report, its model entry carrying `crashes`.
fn report_with(crashes: Option<CrashStatus>) -> BTreeMap<String, NodeStatus> {
    let mut nodes = node_report("gemma-3-270m", "gemma3", supported());
    for status in nodes.values_mut() {
        status.models[0].crashes = crashes.clone();
    }
    nodes
}

/// Seed the example Model's running objects and pod (as a previous reconcile left them).
fn live(server: &mut ApiServer) {
    let m = example_model();
    let o = desired(&m, &example_plugins(), Some("gemma3"));
    pods(server, vec![running_pod(&m, &o)]);
    reads(
        server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(ready_deployment(&o)),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
}

/// One reconcile of the running example Model (stored `status`) with `nodes`' reports; the
/// requests it makes beyond the cache reads are `steps`.
async fn reconcile_running(
    status: Option<ModelStatus>,
    nodes: BTreeMap<String, NodeStatus>,
    steps: Vec<Step>,
) -> Vec<Recorded> {
    let mut m = example_model();
    m.status = status;
    let (ctx, mut server) = context(example_plugins(), nodes);
    live(&mut server);
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    finish(server).await
}

fn event_reasons(recorded: &[Recorded]) -> Vec<String> {
    recorded
        .iter()
        .filter(|r| r.path.ends_with("/events"))
        .filter_map(|r| r.body.as_ref()?["reason"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn a_recent_engine_worker_crash_sets_engine_healthy_false_and_degraded_engine_crashed() {
    let m = example_model();
    let steps = status_then_events(&m, 4);
    let recorded = reconcile_running(None, report_with(Some(crash(5, 2))), steps).await;
    let status = status_body(&recorded);
    let healthy = condition(&status, "EngineHealthy");
    assert_eq!(
        (healthy["status"].as_str(), healthy["reason"].as_str()),
        (Some("False"), Some("EngineCrashed"))
    );
    assert_eq!(
        healthy["message"],
        "node pod default/gemma-3-270m-7c9d-abcde: the engine worker of plugin `llama_cpp` for \
         model `gemma-3-270m` (pid 4242) killed by SIGSEGV (crashed, SIGSEGV); 3 crash(es) \
         since the node started, 2 in a row; its restart waits out the backoff"
    );
    let degraded = condition(&status, "Degraded");
    assert_eq!(
        (degraded["status"].as_str(), degraded["reason"].as_str()),
        (Some("True"), Some("EngineCrashed"))
    );
    assert_eq!(degraded["message"], healthy["message"]);
    // The node still serves (the worker restarts): Ready stays as the pods say.
    assert_eq!(condition(&status, "Ready")["status"], "True");
    // One Warning for the crash (through Degraded), after the three Normal transitions.
    assert_eq!(
        event_reasons(&recorded),
        ["Ready", "EngineResolved", "Downloaded", "EngineCrashed"]
    );
    let warning = recorded.last().and_then(|r| r.body.clone()).expect("event");
    assert_eq!(warning["type"], "Warning");
}

#[tokio::test]
async fn a_restarted_worker_still_counts_as_crashed_for_a_minute() {
    let m = example_model();
    let steps = status_then_events(&m, 4);
    let recorded = reconcile_running(None, report_with(Some(crash(59, 0))), steps).await;
    let healthy = condition(&status_body(&recorded), "EngineHealthy").clone();
    assert_eq!(healthy["reason"], "EngineCrashed");
    assert!(
        healthy["message"]
            .as_str()
            .is_some_and(|s| s.ends_with("; the node restarted it")),
        "{healthy}"
    );
}

#[tokio::test]
async fn an_engine_crash_over_a_minute_ago_leaves_engine_healthy_true_and_not_degraded() {
    let m = example_model();
    let steps = status_then_events(&m, 3);
    let recorded = reconcile_running(None, report_with(Some(crash(61, 0))), steps).await;
    let status = status_body(&recorded);
    let healthy = condition(&status, "EngineHealthy");
    assert_eq!(
        (healthy["status"].as_str(), healthy["reason"].as_str()),
        (Some("True"), Some("NoRecentCrash"))
    );
    assert_eq!(
        healthy["message"],
        "no engine crash in the last minute; node pod default/gemma-3-270m-7c9d-abcde counts 3 \
         since it started, the last: the engine worker of plugin `llama_cpp` for model \
         `gemma-3-270m` (pid 4242) killed by SIGSEGV (crashed, SIGSEGV)"
    );
    assert_eq!(condition(&status, "Degraded")["reason"], "AsExpected");
    assert_eq!(
        event_reasons(&recorded),
        ["Ready", "EngineResolved", "Downloaded"]
    );
}

#[tokio::test]
async fn engine_healthy_is_unknown_before_a_report_and_true_without_crashes() {
    let m = example_model();
    let recorded = first_reconcile(&m, example_plugins(), 1).await;
    let healthy = condition(&status_body(&recorded), "EngineHealthy").clone();
    assert_eq!(
        (healthy["status"].as_str(), healthy["reason"].as_str()),
        (Some("Unknown"), Some("AwaitingReport"))
    );

    let steps = status_then_events(&m, 3);
    let recorded = reconcile_running(None, report_with(None), steps).await;
    let healthy = condition(&status_body(&recorded), "EngineHealthy").clone();
    assert_eq!(
        (healthy["status"].as_str(), healthy["reason"].as_str()),
        (Some("True"), Some("NoRecentCrash"))
    );
    assert_eq!(
        healthy["message"],
        "no node pod reports a crash of the model's engine"
    );
}

#[tokio::test]
async fn a_crash_record_that_only_ages_neither_wakes_the_model_nor_rewrites_its_status() {
    // The poller wakes a Model only when the fingerprint changes: the seconds count up on
    // every poll, but only the end of the quiet minute (or of a restart's wait) counts.
    let fp = |c: CrashStatus| fingerprint(&Ok(report_with(Some(c)).remove(POD_IP).expect("pod")));
    assert_eq!(fp(crash(5, 2)), fp(crash(40, 1)));
    assert_ne!(fp(crash(5, 2)), fp(crash(40, 0)), "the restart ran");
    assert_ne!(fp(crash(40, 0)), fp(crash(61, 0)), "the minute passed");
    assert_eq!(fp(crash(61, 0)), fp(crash(3600, 0)));
    // Likewise a plugin update's age (hot reload).
    let updated = |seconds_ago| {
        let mut status = report_with(None).remove(POD_IP).expect("pod");
        status.plugins.push(llama_cpp_entry(
            "0.1.1",
            Some(gantry_api::PluginUpdate {
                version: Some("0.1.1".into()),
                state: "applied".into(),
                message: "every model moved to 0.1.1".into(),
                models: vec!["gemma-3-270m".into()],
                seconds_ago,
            }),
        ));
        fingerprint(&Ok(status))
    };
    assert_eq!(updated(1), updated(500));

    // And a reconcile of the aged record folds to the status already stored: no request.
    let m = example_model();
    let steps = status_then_events(&m, 4);
    let recorded = reconcile_running(None, report_with(Some(crash(5, 2))), steps).await;
    let stored: ModelStatus =
        serde_json::from_value(status_body(&recorded)).expect("a Model status");
    let recorded =
        reconcile_running(Some(stored), report_with(Some(crash(40, 1))), Vec::new()).await;
    assert!(recorded.is_empty(), "{recorded:#?}");
}
