//! Model reconcile against a mock API server: each scenario states the exact requests a
//! reconcile makes (method and path, in order) and then checks what was written. Here the first
//! reconcile, the steady state and deletion, and the helpers the other reconcile scenarios use.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gantry_api::{
    ArtifactState, ArtifactStatus, EngineVerdict, LoadState, LoadStatus, NodeStatus, QueueStatus,
};
use gantry_crd::{EnginePlugin, Model, ModelStatus};
use gantry_operator::context::Settings;
use gantry_operator::model::{self, build, node_config, resolve::resolve, validate::validate};
use http::Method;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use crate::support::{
    ApiServer, Recorded, Step, condition, context, finish, fixture_model, fixture_plugins, path,
    repo_dir, yaml_docs,
};

pub(crate) const POD_IP: &str = "10.0.0.5";

/// The docs example, as the apiserver would hand it over.
pub(crate) fn example_model() -> Model {
    let mut m: Model =
        yaml_docs(&repo_dir().join("docs/examples/model-gemma-3-270m.yaml")).remove(0);
    m.metadata.uid = Some(UID_EXAMPLE.into());
    m.metadata.generation = Some(1);
    m
}

/// The `cpu` fixture Model's uid.
pub(crate) const UID_CPU: &str = "3f1c2b4a-0000-4000-8000-000000000001";

/// The example Model's uid.
pub(crate) const UID_EXAMPLE: &str = "9b2f6c1d-0000-4000-8000-00000000e2e0";

/// The example Model, for closures that cannot borrow a test's own copy.
fn base_model() -> Model {
    example_model()
}

pub(crate) fn example_plugins() -> Vec<EnginePlugin> {
    yaml_docs(&repo_dir().join("docs/examples/engineplugin-llama-cpp-cpu.yaml"))
}

pub(crate) fn ns_name(m: &Model) -> (String, String) {
    (
        m.metadata.namespace.clone().unwrap_or_default(),
        m.metadata.name.clone().unwrap_or_default(),
    )
}

/// Put the owned objects that exist into the controller's caches (a reconcile reads them
/// there, not from the API server), and return the requests that reading makes: none.
pub(crate) fn reads(
    server: &mut ApiServer,
    cm: Option<Value>,
    deploy: Option<Value>,
    svc: Option<Value>,
    pdb: Option<Value>,
) -> Vec<Step> {
    server.seed([cm, deploy, svc, pdb].into_iter().flatten());
    Vec::new()
}

pub(crate) fn applies(m: &Model) -> Vec<Step> {
    let (ns, name) = ns_name(m);
    vec![
        Step::apply(path("v1", &ns, "configmaps", &name)),
        Step::apply(path("apps/v1", &ns, "deployments", &name)),
        // Creation hands `spec.replicas` to the autoscaler's field manager.
        Step::apply(path("apps/v1", &ns, "deployments", &name)).by("gantry-autoscaler"),
        Step::apply(path("v1", &ns, "services", &name)),
    ]
}

pub(crate) fn status_patch(m: &Model) -> Step {
    let (ns, name) = ns_name(m);
    Step::apply_status(
        format!(
            "{}/status",
            path("gantry.dev/v1alpha1", &ns, "models", &name)
        ),
        serde_json::to_value(m).expect("json"),
    )
}

/// The status patch of `m`, then `events` events in its namespace: a reconcile's writes.
pub(crate) fn status_then_events(m: &Model, events: usize) -> Vec<Step> {
    let (ns, _) = ns_name(m);
    std::iter::once(status_patch(m))
        .chain((0..events).map(|_| Step::event(&ns)))
        .collect()
}

/// Node pods, as the pod watch delivers them.
pub(crate) fn pods(server: &mut ApiServer, items: Vec<Value>) {
    server.seed(items);
}

/// The objects the build step makes for `m` (what a previous reconcile applied): the config
/// rendered as the reconcile renders it (the isolation of every plugin the pods may mount),
/// the pods mounting what selection with `arch` chooses.
pub(crate) fn desired(
    m: &Model,
    plugins: &[EnginePlugin],
    arch: Option<&str>,
) -> build::OwnedObjects {
    let v = validate(m, &Settings::default()).expect("valid");
    let r = resolve(&v, arch, plugins, 1);
    let may_mount = resolve(&v, None, plugins, 1);
    let config = node_config::render(&v, &may_mount.mounted()).expect("render");
    build::assemble(&v, &config, &r.mounted(), &Settings::default()).expect("build")
}

pub(crate) fn ready_deployment(o: &build::OwnedObjects) -> Value {
    let mut d = serde_json::to_value(&o.deployment).expect("json");
    d["metadata"]["generation"] = json!(1);
    // The apiserver always returns the count (set at creation, kept by the autoscaler).
    d["spec"]["replicas"] = json!(1);
    d["status"] = json!({"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
                         "readyReplicas": 1, "availableReplicas": 1});
    d
}

pub(crate) fn running_pod(m: &Model, o: &build::OwnedObjects) -> Value {
    let (ns, name) = ns_name(m);
    let annotations = o
        .deployment
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|t| t.annotations.clone());
    // The pod template's labels, as the ReplicaSet gives them to its pods.
    let labels = o
        .deployment
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|t| t.labels.clone());
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": format!("{name}-7c9d-abcde"), "namespace": ns,
                        "uid": format!("{name}-pod-uid"), "labels": labels, "annotations": annotations},
           "status": {"phase": "Running", "podIP": POD_IP}})
}

pub(crate) fn node_report(
    served: &str,
    arch: &str,
    verdict: EngineVerdict,
) -> BTreeMap<String, NodeStatus> {
    let status = NodeStatus {
        version: "0.1.0".into(),
        backend: "cpu".into(),
        ready: true,
        draining: false,
        plugins: Vec::new(),
        models: vec![gantry_api::ModelStatus {
            id: served.into(),
            format: "gguf".into(),
            architecture: Some(arch.into()),
            verdict: Some(verdict),
            artifact: ArtifactStatus {
                state: ArtifactState::Ready,
                bytes_done: 253_000_000,
                bytes_total: 253_000_000,
                bytes_per_second: 0.0,
                message: None,
            },
            load: LoadStatus {
                state: LoadState::Loaded,
                plugin: Some("llama_cpp".into()),
                message: None,
                bytes_used: 1,
                measured_vram_bytes: None,
                recurrent_state_bytes_per_sequence: None,
            },
            queue: QueueStatus::default(),
            devices: Vec::new(),
            replicas: Vec::new(),
            crashes: None,
            engine_choice: None,
            adapters: Vec::new(),
            draft: None,
        }],
        ..NodeStatus::default()
    };
    BTreeMap::from([(POD_IP.to_string(), status)])
}

/// A node's entry for the llama.cpp CPU plugin in `process` isolation, loaded at `version`,
/// with its last `update`.
pub(crate) fn llama_cpp_entry(
    version: &str,
    update: Option<gantry_api::PluginUpdate>,
) -> gantry_api::PluginStatus {
    gantry_api::PluginStatus {
        id: "llama_cpp".into(),
        version: Some(version.into()),
        abi_version: Some("1".into()),
        gpu_backend: Some("cpu".into()),
        build_info: None,
        loaded: true,
        isolation: "process".into(),
        reason: None,
        message: None,
        update,
    }
}

pub(crate) fn supported() -> EngineVerdict {
    EngineVerdict::Supported {
        plugin: "llama_cpp".into(),
        version: "0.1.0".into(),
    }
}

pub(crate) fn status_body(recorded: &[Recorded]) -> Value {
    recorded
        .iter()
        .find(|r| r.path.ends_with("/status"))
        .and_then(|r| r.body.clone())
        .expect("a status patch")["status"]
        .clone()
}

pub(crate) async fn run(
    model: Model,
    ctx: Arc<gantry_operator::context::Context>,
) -> Result<Action, model::Error> {
    model::reconcile(Arc::new(DeserializeGuard(Ok(model))), ctx).await
}

#[tokio::test]
async fn first_reconcile_applies_config_map_deployment_service_and_patches_status() {
    let m = fixture_model("cpu");
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    let action = run(m.clone(), ctx.clone()).await.expect("reconcile");
    let recorded = finish(server).await;
    // Watches bring every change; the requeue is the slow safety net, jittered per Model.
    assert_eq!(action, Action::requeue(model::resync(UID_CPU)));
    assert!(model::resync(UID_CPU) >= Duration::from_secs(600));

    let applied_kinds: Vec<&str> = recorded
        .iter()
        .filter(|r| r.method == Method::PATCH)
        .filter_map(|r| r.body.as_ref()?["kind"].as_str())
        .collect();
    assert_eq!(
        applied_kinds,
        ["ConfigMap", "Deployment", "Deployment", "Service", "Model"]
    );
    let status = status_body(&recorded);
    assert_eq!(status["observedGeneration"], 1);
    // No architecture yet: both CPU plugins are mounted and the first report will decide.
    let engine = condition(&status, "EngineResolved");
    assert_eq!(
        (engine["status"].as_str(), engine["reason"].as_str()),
        (Some("Unknown"), Some("ArchitecturePending"))
    );
    assert_eq!(condition(&status, "Ready")["reason"], "ReplicasNotReady");
    assert_eq!(condition(&status, "Progressing")["status"], "True");
    assert_eq!(condition(&status, "Degraded")["status"], "False");
    assert_eq!(
        condition(&status, "ArtifactReady")["reason"],
        "AwaitingReport"
    );
    assert_eq!(
        status["endpoint"],
        "http://gemma-3-270m.default.svc:8080/v1"
    );
    assert_eq!(
        status["observedSource"],
        "hf://unsloth/gemma-3-270m-it-GGUF (Q4_K_M)"
    );
    assert_eq!(
        condition(&status, "Ready")["lastTransitionTime"],
        "2023-11-14T22:13:20Z"
    );
    // The Deployment mounts what the build step says, with an owner reference to the Model.
    let deploy = recorded
        .iter()
        .find(|r| r.method == Method::PATCH && r.path.ends_with("/deployments/gemma-3-270m"))
        .and_then(|r| r.body.clone())
        .expect("deployment");
    assert_eq!(
        deploy["metadata"]["ownerReferences"][0]["uid"],
        "3f1c2b4a-0000-4000-8000-000000000001"
    );
    assert_eq!(
        deploy["spec"]["template"]["metadata"]["annotations"]["gantry.dev/engine-plugins"],
        "llama-cpp-cpu,tinyllm-cpu"
    );
}

/// Pass 1 converges a running Model; pass 2 (its status stored) must write nothing.
#[tokio::test]
async fn steady_state_reconcile_writes_nothing() {
    let mut m = example_model();
    let plugins = example_plugins();
    let o = desired(&m, &plugins, Some("gemma3"));
    let live = |server: &mut ApiServer| {
        pods(server, vec![running_pod(&base_model(), &o)]);
        reads(
            server,
            Some(serde_json::to_value(&o.config_map).expect("json")),
            Some(ready_deployment(&o)),
            Some(serde_json::to_value(&o.service).expect("json")),
            None,
        )
    };
    let reports = node_report("gemma-3-270m", "gemma3", supported());

    let (ctx, mut server) = context(plugins.clone(), reports.clone());
    let mut steps = live(&mut server);
    steps.push(status_patch(&m));
    // Ready, EngineResolved and ArtifactReady turn True: one Normal event each.
    steps.extend([
        Step::event("default"),
        Step::event("default"),
        Step::event("default"),
    ]);
    let server = server.run(steps);
    let action = run(m.clone(), ctx).await.expect("pass 1");
    let recorded = finish(server).await;
    assert_eq!(action, Action::requeue(model::resync(UID_EXAMPLE)));
    let status = status_body(&recorded);
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(condition(&status, "ArtifactReady")["reason"], "Downloaded");
    assert_eq!(
        status["replicas"],
        json!({"desired": 1, "current": 1, "ready": 1})
    );
    assert_eq!(
        status["download"],
        json!({"bytesDone": 253_000_000, "bytesTotal": 253_000_000})
    );
    assert!(
        condition(&status, "EngineResolved")["message"]
            .as_str()
            .is_some_and(|s| s.contains("confirmed by node pod default/gemma-3-270m-7c9d-abcde"))
    );

    m.status = Some(serde_json::from_value::<ModelStatus>(status).expect("status"));
    let (ctx, mut server) = context(plugins, reports);
    let steps = live(&mut server);
    let server = server.run(steps);
    let action = run(m, ctx.clone()).await.expect("pass 2");
    let recorded = finish(server).await;
    assert_eq!(action, Action::requeue(model::resync(UID_EXAMPLE)));
    // Everything came from the caches: not a read, not a write.
    assert!(recorded.is_empty(), "{recorded:#?}");
    assert_eq!(ctx.metrics.total_writes(), 0);
}

#[tokio::test]
async fn deleting_a_model_makes_no_requests_because_owner_references_cascade() {
    let mut m = example_model();
    m.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        crate::support::t0(),
    ));
    m.metadata.finalizers = Some(vec!["someone-else.example.com/hold".into()]);
    let (ctx, server) = context(example_plugins(), BTreeMap::new());
    let server = server.run(Vec::new());
    let action = run(m.clone(), ctx).await.expect("reconcile");
    assert!(finish(server).await.is_empty());
    assert_eq!(action, Action::await_change());
    // No finalizer of ours exists to remove: nothing outside the cluster needs cleanup.
    assert!(
        m.metadata
            .finalizers
            .iter()
            .flatten()
            .all(|f| !f.contains("gantry"))
    );
}
