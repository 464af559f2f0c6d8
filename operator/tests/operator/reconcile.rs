//! Model reconcile against a mock API server: each scenario states the exact requests a
//! reconcile makes (method and path, in order) and then checks what was written.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gantry_api::{
    ArtifactState, ArtifactStatus, EngineVerdict, LoadState, LoadStatus, NodeStatus, QueueStatus,
    Rejection, RejectionKind,
};
use gantry_crd::{EnginePlugin, Model, ModelPool, ModelStatus};
use gantry_operator::context::{NodeNetworkPolicy, Settings};
use gantry_operator::model::{self, build, node_config, resolve::resolve, validate::validate};
use gantry_operator::pool;
use http::Method;
use k8s_openapi::api::core::v1::Secret;
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use crate::support::{
    ApiServer, Recorded, Step, condition, context, context_full, context_with, finish,
    fixture_model, fixture_plugins, path, repo_dir, yaml_docs,
};

const POD_IP: &str = "10.0.0.5";

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
            },
            queue: QueueStatus::default(),
            devices: Vec::new(),
            replicas: Vec::new(),
            crashes: None,
            engine_choice: None,
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

#[tokio::test]
async fn first_reconcile_of_a_resolvable_model_records_an_engine_resolved_event() {
    let m = example_model();
    let (ctx, mut server) = context(example_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(status_patch(&m));
    steps.push(Step::event("default"));
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let status = status_body(&recorded);
    assert_eq!(
        status["engine"],
        json!({"id": "llama_cpp", "version": "0.1.0", "plugin": "llama-cpp-cpu"})
    );
    assert_eq!(condition(&status, "EngineResolved")["status"], "True");
    let event = recorded.last().and_then(|r| r.body.clone()).expect("event");
    assert_eq!(
        (event["type"].as_str(), event["reason"].as_str()),
        (Some("Normal"), Some("EngineResolved"))
    );
    assert_eq!(event["regarding"]["kind"], "Model");
}

#[tokio::test]
async fn model_without_supported_engine_sets_engine_resolved_false_and_creates_nothing() {
    let m = fixture_model("cpu");
    // Only the CUDA build exists: wrong backend for a CPU model.
    let plugins: Vec<EnginePlugin> = fixture_plugins()
        .into_iter()
        .filter(|p| p.spec.engine_id == "llama_cpp" && p.spec.gpu_backend.as_str() == "cuda")
        .collect();
    let (ctx, mut server) = context(plugins, BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(status_patch(&m));
    steps.push(Step::event("default"));
    steps.push(Step::event("default"));
    let server = server.run(steps);
    let action = run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(action, Action::await_change());
    assert!(
        recorded.iter().all(|r| r.method == Method::GET
            || r.path.ends_with("/status")
            || r.path.ends_with("/events")),
        "created something: {recorded:#?}"
    );
    let status = status_body(&recorded);
    let engine = condition(&status, "EngineResolved");
    assert_eq!(
        (engine["status"].as_str(), engine["reason"].as_str()),
        (Some("False"), Some("NoMatchingEngine"))
    );
    assert!(
        engine["message"]
            .as_str()
            .is_some_and(|m| m.contains("llama-cpp-cuda: plugin is built for cuda")),
        "{engine}"
    );
    assert_eq!(
        status["candidates"],
        json!([{"plugin": "llama-cpp-cuda", "kind": "backend",
        "reason": "plugin is built for cuda, the model runs on cpu (resources.gpus = 0)"}])
    );
    assert_eq!(condition(&status, "Ready")["reason"], "EngineUnresolved");
    assert_eq!(condition(&status, "Degraded")["reason"], "EngineUnresolved");
    assert_eq!(condition(&status, "Progressing")["reason"], "NotDeployed");
    let reasons: Vec<&str> = recorded
        .iter()
        .filter(|r| r.path.ends_with("/events"))
        .filter_map(|r| r.body.as_ref()?["reason"].as_str())
        .collect();
    assert_eq!(reasons, ["NoMatchingEngine", "EngineUnresolved"]);
}

#[tokio::test]
async fn every_rejected_candidate_is_listed_with_its_reason() {
    let mut m = fixture_model("cpu");
    m.spec.architecture = Some("bert".into());
    let mut plugins = fixture_plugins();
    // An ABI the node image does not speak, and a shadowing duplicate of llama-cpp-cpu.
    let mut old_abi = plugins[0].clone();
    old_abi.metadata.name = Some("aaa-old-abi".into());
    old_abi.spec.engine_id = "old_engine".into();
    old_abi.spec.abi_version = 0;
    let mut duplicate = plugins[0].clone();
    duplicate.metadata.name = Some("zzz-llama-copy".into());
    plugins.push(old_abi);
    plugins.push(duplicate);
    let (ctx, mut server) = context(plugins, BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(status_patch(&m));
    steps.push(Step::event("default"));
    steps.push(Step::event("default"));
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    let kinds: Vec<(String, String)> = status["candidates"]
        .as_array()
        .expect("candidates")
        .iter()
        .map(|c| {
            (
                c["plugin"].as_str().unwrap_or_default().to_string(),
                c["kind"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    // Engine-id order, then name: llama_cpp (cpu, cuda, copy), old_engine, tinyllm.
    assert_eq!(
        kinds,
        [
            ("llama-cpp-cpu".into(), "architecture".into()),
            ("llama-cpp-cuda".into(), "backend".into()),
            ("zzz-llama-copy".into(), "load_error".into()),
            ("aaa-old-abi".into(), "abi".into()),
            ("tinyllm-cpu".into(), "architecture".into()),
        ] as [(String, String); 5]
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
async fn the_first_node_report_narrows_the_mounted_plugins_to_the_one_that_serves() {
    let m = fixture_model("cpu");
    let plugins = fixture_plugins();
    let o = desired(&m, &plugins, None);
    let init = o
        .deployment
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|p| p.init_containers.as_ref())
        .map(Vec::len);
    assert_eq!(
        init,
        Some(1),
        "tinyllm is an image volume, llama.cpp an init container"
    );
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
    assert_eq!(
        deploy["spec"]["template"]["metadata"]["annotations"]["gantry.dev/engine-plugins"],
        "llama-cpp-cpu"
    );
    assert!(
        deploy["spec"].get("replicas").is_none(),
        "a re-apply leaves the autoscaler's replica count alone: {}",
        deploy["spec"]
    );
    let status = status_body(&recorded);
    assert_eq!(status["architecture"], "gemma3");
    assert_eq!(status["engine"]["plugin"], "llama-cpp-cpu");
}

#[tokio::test]
async fn creating_the_deployment_sets_min_replicas_and_hands_the_field_to_the_autoscaler() {
    let mut m = fixture_model("cpu");
    m.spec.replicas = Some(gantry_crd::Replicas { min: 2, max: 6 });
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let (ns, name) = ns_name(&m);
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(Step::apply(path(
        "policy/v1",
        &ns,
        "poddisruptionbudgets",
        &name,
    )));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let deployment_writes: Vec<&Recorded> = recorded
        .iter()
        .filter(|r| r.path.ends_with(&format!("/deployments/{name}")) && r.method == Method::PATCH)
        .collect();
    assert_eq!(deployment_writes.len(), 2);
    assert!(
        deployment_writes[0]
            .query
            .contains("fieldManager=gantry-operator")
    );
    assert_eq!(
        deployment_writes[0].body.as_ref().expect("body")["spec"]["replicas"],
        2,
        "created at replicas.min"
    );
    assert!(
        deployment_writes[1]
            .query
            .contains("fieldManager=gantry-autoscaler")
    );
    assert_eq!(
        deployment_writes[1].body,
        Some(json!({"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": name}, "spec": {"replicas": 2}}))
    );
}

#[tokio::test]
async fn a_deployment_whose_replicas_only_the_operator_owns_is_handed_over_before_a_reapply() {
    // A Deployment an older operator created: gantry-operator alone owns spec.replicas, which
    // something else has since set to 4. The re-apply (new plugins) leaves replicas out, which
    // would drop the field; the autoscaler must own it first, at the live count.
    let m = fixture_model("cpu");
    let plugins = fixture_plugins();
    let o = desired(&m, &plugins, None);
    let mut live = ready_deployment(&o);
    live["spec"]["replicas"] = json!(4);
    live["metadata"]["managedFields"] = json!([{
        "manager": "gantry-operator", "operation": "Apply", "apiVersion": "apps/v1",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}}
    }]);
    let (ctx, mut server) = context(plugins, node_report("gemma-3-270m", "gemma3", supported()));
    let (ns, name) = ns_name(&m);
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(live),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    pods(&mut server, vec![running_pod(&m, &o)]);
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)).by("gantry-autoscaler"));
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)));
    steps.push(status_patch(&m));
    steps.extend([Step::event(&ns), Step::event(&ns)]);
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let writes: Vec<&Recorded> = recorded
        .iter()
        .filter(|r| r.path.ends_with(&format!("/deployments/{name}")) && r.method == Method::PATCH)
        .collect();
    assert_eq!(
        writes[0].body.as_ref().expect("body")["spec"],
        json!({"replicas": 4}),
        "handed over at the live count"
    );
    assert!(
        writes[1].body.as_ref().expect("body")["spec"]
            .get("replicas")
            .is_none()
    );
}

#[tokio::test]
async fn switching_from_hpa_back_to_builtin_deletes_the_hpa() {
    let m = fixture_model("cpu");
    let plugins = fixture_plugins();
    let o = desired(&m, &plugins, None);
    let (ns, name) = ns_name(&m);
    let mut hpa_model = m.clone();
    hpa_model.spec.autoscaling = Some(gantry_crd::Autoscaling {
        mode: gantry_crd::AutoscalingMode::Hpa,
        ..Default::default()
    });
    let old_hpa = desired(&hpa_model, &plugins, None).hpa.expect("hpa");
    let (ctx, mut server) = context(plugins, BTreeMap::new());
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(ready_deployment(&o)),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    server.seed([serde_json::to_value(&old_hpa).expect("json")]);
    pods(&mut server, Vec::new());
    steps.push(Step::delete(path(
        "autoscaling/v2",
        &ns,
        "horizontalpodautoscalers",
        &name,
    )));
    steps.push(status_patch(&m));
    steps.push(Step::event(&ns));
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert!(
        recorded
            .iter()
            .any(|r| r.method == Method::DELETE && r.path.contains("horizontalpodautoscalers"))
    );
}

#[tokio::test]
async fn a_node_that_rejects_the_model_sets_rejected_by_node_and_keeps_its_pods() {
    let m = example_model();
    let plugins = example_plugins();
    let o = desired(&m, &plugins, Some("gemma3"));
    let verdict = EngineVerdict::Unsupported {
        rejections: vec![Rejection { plugin: "llama_cpp".into(), kind: RejectionKind::LoadError, reason: "plugin not loaded: Binary not found: /opt/gantry/engines/llama_cpp/cpu/libgantry_engine_llama_cpp.so".into() }],
    };
    let (ctx, mut server) = context(plugins, node_report("gemma-3-270m", "gemma3", verdict));
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(ready_deployment(&o)),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    pods(&mut server, vec![running_pod(&m, &o)]);
    steps.push(status_patch(&m));
    steps.extend([
        Step::event("default"),
        Step::event("default"),
        Step::event("default"),
    ]);
    let server = server.run(steps);
    let action = run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(
        action,
        Action::requeue(model::resync(UID_EXAMPLE)),
        "pods stay: the safety-net resync"
    );
    let status = status_body(&recorded);
    let engine = condition(&status, "EngineResolved");
    assert_eq!(
        (engine["status"].as_str(), engine["reason"].as_str()),
        (Some("False"), Some("RejectedByNode"))
    );
    assert_eq!(status["candidates"][0]["kind"], "load_error");
    assert_eq!(condition(&status, "Ready")["status"], "False");
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

#[tokio::test]
async fn a_model_that_loses_its_engine_has_its_deployment_deleted_but_keeps_config_and_service() {
    let m = example_model();
    let o = desired(&m, &example_plugins(), Some("gemma3"));
    let (ns, name) = ns_name(&m);
    // The plugin was deleted: nothing serves llama_cpp any more.
    let (ctx, mut server) = context(
        Vec::new(),
        node_report("gemma-3-270m", "gemma3", supported()),
    );
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(ready_deployment(&o)),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    pods(&mut server, vec![running_pod(&m, &o)]);
    steps.push(Step::delete(path("apps/v1", &ns, "deployments", &name)));
    steps.push(status_patch(&m));
    steps.extend([Step::event(&ns), Step::event(&ns)]);
    let server = server.run(steps);
    let action = run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(action, Action::await_change());
    let status = status_body(&recorded);
    assert_eq!(
        condition(&status, "EngineResolved")["reason"],
        "NoMatchingEngine"
    );
    assert_eq!(status["candidates"][0]["plugin"], "llama_cpp");
    assert_eq!(status["candidates"][0]["kind"], "pin");
}

#[tokio::test]
async fn a_server_error_on_apply_requeues_with_backoff_and_the_retry_finishes_the_job() {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(Step::apply(path("v1", &ns, "configmaps", &name)));
    steps.push(Step::fail(
        Method::PATCH,
        path("apps/v1", &ns, "deployments", &name),
        500,
    ));
    let server = server.run(steps);
    let obj = Arc::new(DeserializeGuard(Ok(m.clone())));
    let err = model::reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("500 fails the reconcile");
    let recorded = finish(server).await;
    assert_eq!(err.metric_label(), "apply_transient");
    assert!(
        recorded.iter().all(|r| !r.path.ends_with("/status")),
        "a transient failure does not touch status"
    );
    assert_eq!(
        model::error_policy(obj.clone(), &err, ctx.clone()),
        Action::requeue(Duration::from_secs(5))
    );
    assert_eq!(
        model::error_policy(obj, &err, ctx.clone()),
        Action::requeue(Duration::from_secs(10))
    );
    assert!(ctx.metrics.encode().expect("metrics").contains(
        "gantry_operator_reconcile_errors_total{controller=\"model\",error=\"apply_transient\"} 1"
    ));

    // The retry sees the ConfigMap already applied and picks up where it failed.
    let applied_cm = recorded[0].body.clone().expect("configmap");
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, Some(applied_cm), None, None, None);
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)));
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)).by("gantry-autoscaler"));
    steps.push(Step::apply(path("v1", &ns, "services", &name)));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    run(m, ctx).await.expect("retry");
    finish(server).await;
}

#[tokio::test]
async fn a_conflict_on_the_status_patch_requeues_without_losing_the_applied_objects() {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(Step::fail(
        Method::PATCH,
        format!(
            "{}/status",
            path("gantry.dev/v1alpha1", &ns, "models", &name)
        ),
        409,
    ));
    let server = server.run(steps);
    let obj = Arc::new(DeserializeGuard(Ok(m)));
    let err = model::reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("409 fails the reconcile");
    finish(server).await;
    assert_eq!(err.metric_label(), "status_patch");
    assert_eq!(
        model::error_policy(obj, &err, ctx),
        Action::requeue(Duration::from_secs(5))
    );
}

#[tokio::test]
async fn an_apply_the_apiserver_refuses_is_reported_as_degraded_and_retried_late() {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(Step::apply(path("v1", &ns, "configmaps", &name)));
    steps.push(Step::fail(
        Method::PATCH,
        path("apps/v1", &ns, "deployments", &name),
        422,
    ));
    steps.push(status_patch(&m));
    steps.push(Step::event(&ns));
    let server = server.run(steps);
    let obj = Arc::new(DeserializeGuard(Ok(m)));
    let err = model::reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("422 fails the reconcile");
    let recorded = finish(server).await;
    assert_eq!(err.metric_label(), "apply_refused");
    let degraded = condition(&status_body(&recorded), "Degraded").clone();
    assert_eq!(
        (degraded["status"].as_str(), degraded["reason"].as_str()),
        (Some("True"), Some("ApplyFailed"))
    );
    assert_eq!(
        model::error_policy(obj, &err, ctx),
        Action::requeue(Duration::from_secs(300))
    );
}

#[tokio::test]
async fn an_object_of_the_same_name_owned_by_someone_else_is_never_overwritten() {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let users_cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns}, "data": {"mine": "yes"}});
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, Some(users_cm), None, None, None);
    steps.push(status_patch(&m));
    steps.push(Step::event(&ns));
    let server = server.run(steps);
    let err = run(m, ctx).await.expect_err("not owned");
    let recorded = finish(server).await;
    assert_eq!(err.metric_label(), "apply_not_owned");
    assert!(
        recorded
            .iter()
            .all(|r| !r.path.ends_with("/configmaps/gemma-3-270m") || r.method == Method::GET)
    );
    let degraded = condition(&status_body(&recorded), "Degraded").clone();
    assert!(degraded["message"].as_str().is_some_and(|s| {
        s.contains("ConfigMap gemma-3-270m exists and is not controlled by this Model")
    }));
}

#[tokio::test]
async fn an_invalid_model_patches_invalid_spec_and_waits_for_a_change() {
    let mut m = fixture_model("cpu");
    m.spec.source.uri = "ftp://example.com/x.gguf".into();
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(status_patch(&m));
    steps.push(Step::event("default"));
    let server = server.run(steps);
    let action = run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(action, Action::await_change());
    let ready = condition(&status_body(&recorded), "Ready").clone();
    assert_eq!(ready["reason"], "InvalidSpec");
    assert!(
        ready["message"]
            .as_str()
            .is_some_and(|s| s.contains("spec.source.uri"))
    );
}

#[tokio::test]
async fn a_malformed_object_gets_a_warning_event_and_does_not_block_the_controller() {
    let (ctx, server) = context(fixture_plugins(), BTreeMap::new());
    let server = server.run(vec![Step::event("default")]);
    let invalid = InvalidObject {
        error: "spec.format: unknown variant `onnx`".into(),
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("broken".into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
    };
    let action = model::reconcile(Arc::new(DeserializeGuard(Err(invalid))), ctx)
        .await
        .expect("reconcile");
    assert_eq!(action, Action::await_change());
    let recorded = finish(server).await;
    let event = recorded[0].body.clone().expect("event");
    assert_eq!(
        (event["type"].as_str(), event["reason"].as_str()),
        (Some("Warning"), Some("Malformed"))
    );
    assert_eq!(event["regarding"]["name"], "broken");
}

#[tokio::test]
async fn a_model_scaling_up_stays_ready_while_the_new_pods_start() {
    let m = example_model();
    let plugins = example_plugins();
    let o = desired(&m, &plugins, Some("gemma3"));
    // The autoscaler asked for 3; one pod serves, two are starting.
    let mut deploy = ready_deployment(&o);
    deploy["spec"]["replicas"] = json!(3);
    deploy["status"] = json!({"observedGeneration": 1, "replicas": 3, "updatedReplicas": 3,
                              "readyReplicas": 1, "availableReplicas": 1});
    let (ctx, mut server) = context(plugins, node_report("gemma-3-270m", "gemma3", supported()));
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(deploy),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    pods(&mut server, vec![running_pod(&m, &o)]);
    steps.push(status_patch(&m));
    steps.extend([
        Step::event("default"),
        Step::event("default"),
        Step::event("default"),
    ]);
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    let ready = condition(&status, "Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["message"].as_str()),
        (Some("True"), Some("1/3 node pods ready"))
    );
    assert_eq!(condition(&status, "Progressing")["reason"], "RollingOut");
    assert_eq!(
        status["replicas"],
        json!({"desired": 3, "current": 3, "ready": 1})
    );
}

const INSTALL_TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// The operator as the chart runs it: an install token and per-Model NetworkPolicies.
fn secured_settings() -> Settings {
    Settings {
        node_token: Some(INSTALL_TOKEN.parse().expect("token")),
        network_policy: Some(NodeNetworkPolicy {
            peer_namespace: "gantry-system".into(),
            peer_labels: BTreeMap::from([
                ("app.kubernetes.io/name".into(), "gantry".into()),
                ("app.kubernetes.io/instance".into(), "gantry".into()),
            ]),
            metrics_namespace: Some("monitoring".into()),
            download_cidrs: Vec::new(),
        }),
        ..Settings::default()
    }
}

/// The node-token Secret's metadata GET: Secrets are never cached, so the apply step reads
/// the Model's one by name in every reconcile that builds it.
fn secret_get(m: &Model, secret: Option<Value>) -> Step {
    let (ns, name) = ns_name(m);
    Step::get(
        path("v1", &ns, "secrets", &format!("{name}-node-token")),
        secret,
    )
}

fn body_of<'a>(recorded: &'a [Recorded], method: Method, suffix: &str) -> &'a Value {
    recorded
        .iter()
        .find(|r| r.method == method && r.path.ends_with(suffix))
        .and_then(|r| r.body.as_ref())
        .unwrap_or_else(|| panic!("no {method} …{suffix}"))
}

#[tokio::test]
async fn with_an_install_token_and_policies_the_model_gets_its_token_secret_and_network_policy_before_its_pods()
 {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let (ctx, mut server) = context_with(secured_settings(), fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(Step::apply(path("v1", &ns, "configmaps", &name)));
    steps.push(secret_get(&m, None));
    steps.push(Step::apply(path(
        "v1",
        &ns,
        "secrets",
        &format!("{name}-node-token"),
    )));
    steps.push(Step::apply(path(
        "networking.k8s.io/v1",
        &ns,
        "networkpolicies",
        &name,
    )));
    steps.extend(applies(&m).into_iter().skip(1));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    run(m.clone(), ctx).await.expect("reconcile");
    let recorded = finish(server).await;

    // The Secret holds the Model's derived token, owned by the Model.
    let token = INSTALL_TOKEN
        .parse::<gantry_api::node_token::InstallToken>()
        .expect("token")
        .for_model(&ns, &name);
    let secret: Secret = serde_json::from_value(
        body_of(&recorded, Method::PATCH, "/secrets/gemma-3-270m-node-token").clone(),
    )
    .expect("a Secret");
    let data = secret.data.expect("data");
    assert_eq!(data["token"].0, token.as_str().as_bytes());
    assert_eq!(data.len(), 1);
    let owner = &secret.metadata.owner_references.expect("owned")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("Model", Some(true))
    );

    // The node container reads it by reference; the token is nowhere in the Deployment.
    let deploy = body_of(&recorded, Method::PATCH, "/deployments/gemma-3-270m");
    let env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env");
    let token_env: Vec<&Value> = env
        .iter()
        .filter(|e| e["name"] == "GANTRY_NODE_TOKEN")
        .collect();
    assert_eq!(
        token_env,
        [
            &json!({"name": "GANTRY_NODE_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "gemma-3-270m-node-token", "key": "token", "optional": false}}})
        ]
    );
    assert!(!deploy.to_string().contains(token.as_str()));
    let hash = &deploy["spec"]["template"]["metadata"]["annotations"]["gantry.dev/node-token-hash"];
    assert!(hash.as_str().is_some_and(|h| !h.is_empty()), "{hash}");

    // Ingress to the node port only from the operator's pods and Prometheus; egress DNS + 443.
    let policy = body_of(&recorded, Method::PATCH, "/networkpolicies/gemma-3-270m");
    assert_eq!(
        policy["spec"],
        json!({
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gantry-node",
                                            "gantry.dev/model": "gemma-3-270m"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gantry-system"}},
                           "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "gantry",
                                                           "app.kubernetes.io/name": "gantry"}}}],
                 "ports": [{"port": 8080, "protocol": "TCP"}]},
                {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                 "ports": [{"port": 8080, "protocol": "TCP"}]},
            ],
            "egress": [
                {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
                {"ports": [{"port": 443, "protocol": "TCP"}]},
            ],
        })
    );
    assert_eq!(
        policy["metadata"]["ownerReferences"][0]["uid"],
        "3f1c2b4a-0000-4000-8000-000000000001"
    );
}

/// The example Model built with `secured_settings`, and a context and mock server whose caches
/// hold its objects as a previous reconcile left them: the Deployment current with all its
/// pods ready, the NetworkPolicy current, a node pod running. Only the Secret is not there:
/// Secrets are never cached.
fn settled_secured_model() -> (
    Model,
    build::OwnedObjects,
    Arc<gantry_operator::context::Context>,
    ApiServer,
) {
    let m = example_model();
    let plugins = example_plugins();
    let settings = secured_settings();
    let v = validate(&m, &settings).expect("valid");
    let o = build::build(
        &v,
        &resolve(&v, Some("gemma3"), &plugins, 1).mounted(),
        &settings,
    )
    .expect("build");
    let (ctx, mut server) = context_with(
        settings,
        plugins,
        node_report("gemma-3-270m", "gemma3", supported()),
    );
    reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(ready_deployment(&o)),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    server.seed([serde_json::to_value(&o.network_policy).expect("json")]);
    pods(&mut server, vec![running_pod(&m, &o)]);
    (m, o, ctx, server)
}

/// The path of the example Model's node-token Secret.
const EXAMPLE_SECRET: &str = "/api/v1/namespaces/default/secrets/gemma-3-270m-node-token";

#[tokio::test]
async fn an_unchanged_token_secret_and_network_policy_are_not_rewritten() {
    let (m, o, ctx, server) = settled_secured_model();
    // The Deployment is current with all its pods ready and the cached NetworkPolicy is
    // current; the Secret is read by name (Secrets are never cached) and found current.
    let secret = o.node_token_secret.as_ref().expect("a token Secret");
    let live = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                      "metadata": secret.metadata});
    let mut steps = vec![secret_get(&m, Some(live))];
    steps.push(status_patch(&m));
    steps.extend([
        Step::event("default"),
        Step::event("default"),
        Step::event("default"),
    ]);
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let writes: Vec<&str> = recorded
        .iter()
        .filter(|r| r.method == Method::PATCH)
        .map(|r| r.path.as_str())
        .collect();
    assert_eq!(
        writes,
        ["/apis/gantry.dev/v1alpha1/namespaces/default/models/gemma-3-270m/status"]
    );
    let reads: Vec<(&Method, &str, &str)> = recorded
        .iter()
        .filter(|r| r.method == Method::GET)
        .map(|r| (&r.method, r.path.as_str(), r.query.as_str()))
        .collect();
    assert_eq!(
        reads,
        [(&Method::GET, EXAMPLE_SECRET, "")],
        "one GET, by name"
    );
}

#[tokio::test]
async fn a_token_secret_deleted_by_hand_comes_back_at_the_next_reconcile_of_a_settled_model() {
    let (m, o, ctx, server) = settled_secured_model();
    // Everything else is current and ready; the Secret GET answers 404. Then it is deleted
    // again right after: the GET is the apiserver's answer, not a cache that lags the write
    // of moments ago, so it comes back again (the status, written moments ago, is not).
    let steps = vec![
        secret_get(&m, None),
        Step::apply(EXAMPLE_SECRET),
        status_patch(&m),
        Step::event("default"),
        Step::event("default"),
        Step::event("default"),
        secret_get(&m, None),
        Step::apply(EXAMPLE_SECRET),
    ];
    let server = server.run(steps);
    run(m.clone(), ctx.clone()).await.expect("reconcile");
    run(m, ctx).await.expect("reconcile again");
    let recorded = finish(server).await;
    // The apply is exactly the built Secret, under the operator's field manager, forced.
    let apply = &recorded[1];
    assert_eq!(apply.content_type, "application/apply-patch+yaml");
    assert!(
        apply.query.contains("fieldManager=gantry-operator") && apply.query.contains("force=true"),
        "{}",
        apply.query
    );
    assert_eq!(
        apply.body.as_ref(),
        Some(
            &serde_json::to_value(o.node_token_secret.as_ref().expect("a token Secret"))
                .expect("json")
        )
    );
    // Nothing else is written: the Deployment keeps running with the same token.
    let writes: Vec<&str> = recorded
        .iter()
        .filter(|r| r.method == Method::PATCH)
        .map(|r| r.path.as_str())
        .collect();
    assert_eq!(
        writes,
        [
            EXAMPLE_SECRET,
            "/apis/gantry.dev/v1alpha1/namespaces/default/models/gemma-3-270m/status",
            EXAMPLE_SECRET,
        ]
    );
}

#[tokio::test]
async fn a_pools_token_secret_is_read_every_reconcile_and_comes_back_when_deleted_by_hand() {
    use crate::deliver::{delivery_pool, pool_built, pool_status_patch, settled_pool_objects};
    let (mut pool, members) = delivery_pool();
    let settings = secured_settings();
    let plugins = example_plugins();
    let live = pool_built(&pool, &members, &plugins, &settings);
    let secret = live.node_token_secret.clone().expect("a pool token Secret");
    let secret_path = "/api/v1/namespaces/default/secrets/small-pool-node-token";
    // The pool's objects current, its Deployment's pods ready; the Secret is never cached.
    let start = |pool: &ModelPool| {
        let (ctx, mut server) = context_full(
            settings.clone(),
            plugins.clone(),
            BTreeMap::new(),
            members.clone(),
            vec![pool.clone()],
        );
        server.seed(settled_pool_objects(&live));
        server.seed([serde_json::to_value(&live.network_policy).expect("json")]);
        (ctx, server)
    };
    let run_pool =
        |pool: &ModelPool, ctx| pool::reconcile(Arc::new(DeserializeGuard(Ok(pool.clone()))), ctx);

    // Deleted by hand: the GET answers 404 and the Secret is applied again, nothing else.
    let (ctx, server) = start(&pool);
    let server = server.run(vec![
        Step::get(secret_path, None),
        Step::apply(secret_path),
        pool_status_patch(&pool),
    ]);
    run_pool(&pool, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(
        recorded[1].body,
        Some(serde_json::to_value(&secret).expect("json"))
    );
    pool.status = Some(serde_json::from_value(status_body(&recorded)).expect("status"));

    // There and current: the one GET, no write.
    let (ctx, server) = start(&pool);
    let found = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                       "metadata": secret.metadata});
    let server = server.run(vec![Step::get(secret_path, Some(found))]);
    run_pool(&pool, ctx.clone()).await.expect("reconcile");
    finish(server).await;
    assert_eq!(ctx.metrics.total_writes(), 0);
}
