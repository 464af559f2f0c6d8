//! In-place plugin delivery (Model reconcile, build and deliver steps), against a mock API
//! server: a new image of a `process`-isolated plugin keeps the pod template as it is (no
//! rollout) and reaches the running pods as an ephemeral copy container, one pod first, then
//! a quarter at a time; a refusal halts it and says so in the Model's conditions. Here the
//! reconcile's requests, and the helpers the other delivery files use.

use std::collections::BTreeMap;

use gantry_api::config::Isolation;
use gantry_api::{NodeStatus, PluginUpdate};
use gantry_crd::{EnginePlugin, Model, ModelPool};
use gantry_operator::context::{PluginDelivery, Settings};
use gantry_operator::model::build::{self, OwnedObjects};
use gantry_operator::model::node_config::RenderedConfig;
use gantry_operator::pool::admit;
use http::{Method, StatusCode};
use serde_json::{Value, json};

use crate::reconcile::{
    desired, example_model, example_plugins, llama_cpp_entry, node_report, ns_name, pods, reads,
    ready_deployment, run, status_body, status_then_events, supported,
};
use crate::support::{
    Recorded, Reply, Step, condition, context_with, finish, path, status_body as api_status,
};

pub(crate) const SLOT: &str = "plugin-0-llama-cpp-cpu";
pub(crate) const IMAGE_V1: &str = "ghcr.io/gantry-dev/engine-llama-cpp-cpu:0.1.0";
pub(crate) const IMAGE_V2: &str = "ghcr.io/gantry-dev/engine-llama-cpp-cpu:0.2.0";
pub(crate) const POD_IPS: [&str; 2] = ["10.0.0.5", "10.0.0.6"];

/// The example plugin in `process` isolation at `version` (image tag = version).
pub(crate) fn plugins_at(version: &str) -> Vec<EnginePlugin> {
    let mut plugins = example_plugins();
    for p in &mut plugins {
        p.spec.isolation = Some(Isolation::Process);
        p.spec.version = version.to_string();
        p.spec.image = format!("ghcr.io/gantry-dev/engine-llama-cpp-cpu:{version}");
    }
    plugins
}

pub(crate) fn built(m: &Model, plugins: &[EnginePlugin]) -> OwnedObjects {
    desired(m, plugins, Some("gemma3"))
}

/// A running node pod of `o`'s template, named `gemma-3-270m-7c9d-{suffix}`, whose plugin init
/// container ran `init_image` and which has the ephemeral containers `ephemeral`
/// (name, image, state).
pub(crate) fn node_pod(
    o: &OwnedObjects,
    suffix: &str,
    ip: &str,
    init_image: &str,
    ephemeral: &[(&str, &str, Value)],
) -> Value {
    let template = o
        .deployment
        .spec
        .template
        .metadata
        .clone()
        .unwrap_or_default();
    let eph: Vec<Value> = ephemeral
        .iter()
        .map(|(name, image, _)| json!({"name": name, "image": image}))
        .collect();
    let states: Vec<Value> = ephemeral
        .iter()
        .map(|(name, image, state)| json!({"name": name, "image": image, "imageID": "", "ready": false, "restartCount": 0, "state": state}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": format!("gemma-3-270m-7c9d-{suffix}"), "namespace": "default",
                        "uid": format!("uid-{suffix}"), "labels": template.labels,
                        "annotations": template.annotations},
           "spec": {"initContainers": [{"name": SLOT, "image": init_image}],
                    "containers": [{"name": "node", "image": "ghcr.io/gantry-dev/gantry-node:0.1.0"}],
                    "ephemeralContainers": eph},
           "status": {"phase": "Running", "podIP": ip,
                      "conditions": [{"type": "Ready", "status": "True"}],
                      "ephemeralContainerStatuses": states}})
}

/// The node report of a pod running plugin `version`, with its last `update`.
pub(crate) fn report(version: &str, update: Option<(&str, &str, &str)>) -> NodeStatus {
    let mut status = node_report("gemma-3-270m", "gemma3", supported())
        .into_values()
        .next()
        .expect("report");
    status.plugins = vec![llama_cpp_entry(
        version,
        update.map(|(v, state, message)| PluginUpdate {
            version: Some(v.into()),
            state: state.into(),
            message: message.into(),
            models: Vec::new(),
            seconds_ago: 3,
        }),
    )];
    status
}

pub(crate) fn ephemeral_patch(pod: &str, reply: Value) -> Step {
    Step {
        manager: "gantry-operator",
        method: Method::PATCH,
        path: format!("/api/v1/namespaces/default/pods/{pod}/ephemeralcontainers"),
        status: StatusCode::OK,
        reply: Reply::Json(reply),
    }
}

pub(crate) fn writes_to(recorded: &[Recorded], what: &str) -> usize {
    recorded
        .iter()
        .filter(|r| r.method != Method::GET && r.path.contains(what))
        .count()
}

// --- the reconcile: the requests it makes ---

/// One reconcile of the example Model whose live objects were built with plugin 0.1.0, with
/// plugin `plugins` now, the node `pods` and their `reports` (by pod IP); the requests after
/// the cache reads are `steps`.
async fn reconcile_live(
    plugins: Vec<EnginePlugin>,
    pod_list: Vec<Value>,
    reports: Vec<NodeStatus>,
    steps: Vec<Step>,
    settings: Settings,
) -> (
    Vec<Recorded>,
    Result<kube::runtime::controller::Action, gantry_operator::model::Error>,
) {
    let m = example_model();
    let live = built(&m, &plugins_at("0.1.0"));
    let nodes: BTreeMap<String, NodeStatus> = POD_IPS
        .iter()
        .map(|ip| ip.to_string())
        .zip(reports)
        .collect();
    let (ctx, mut server) = context_with(settings, plugins, nodes);
    reads(
        &mut server,
        Some(serde_json::to_value(&live.config_map).expect("json")),
        Some(ready_deployment(&live)),
        Some(serde_json::to_value(&live.service).expect("json")),
        None,
    );
    pods(&mut server, pod_list);
    let server = server.run(steps);
    let result = run(m, ctx).await;
    (finish(server).await, result)
}

/// The example Model's pods `aaaaa` and `bbbbb` as of plugin 0.1.0's template, each with the
/// copy containers of 0.2.0 listed for it (`Some(state)`: one, `-u1`, in that state).
pub(crate) fn two_pods(copies: [Option<Value>; 2]) -> Vec<Value> {
    let live = built(&example_model(), &plugins_at("0.1.0"));
    let u1 = format!("{SLOT}-u1");
    ["aaaaa", "bbbbb"]
        .into_iter()
        .zip(POD_IPS)
        .zip(copies)
        .map(|((suffix, ip), copy)| {
            let ephemeral: Vec<(&str, &str, Value)> = copy
                .into_iter()
                .map(|state| (u1.as_str(), IMAGE_V2, state))
                .collect();
            node_pod(&live, suffix, ip, IMAGE_V1, &ephemeral)
        })
        .collect()
}

pub(crate) fn two_pods_at_v1() -> Vec<Value> {
    two_pods([None, None])
}

/// A copy container that finished its copy.
pub(crate) fn copied() -> Value {
    json!({"terminated": {"exitCode": 0, "reason": "Completed"}})
}

/// A node's report of an update of 0.2.0 in `state`.
pub(crate) fn update(
    state: &'static str,
    message: &'static str,
) -> Option<(&'static str, &'static str, &'static str)> {
    Some(("0.2.0", state, message))
}

/// One reconcile that must write no delivery (status and `events` Events only): the status.
async fn reconcile_writing_no_copy(
    pod_list: Vec<Value>,
    reports: Vec<NodeStatus>,
    events: usize,
) -> Value {
    let m = example_model();
    let (recorded, result) = reconcile_live(
        plugins_at("0.2.0"),
        pod_list,
        reports,
        status_then_events(&m, events),
        Settings::default(),
    )
    .await;
    result.expect("reconcile");
    assert_eq!(writes_to(&recorded, "/ephemeralcontainers"), 0);
    status_body(&recorded)
}

/// One reconcile that must add one copy container, to `pod_list[to]` (then status and three
/// Events): what it requested, and its `Progressing` message.
pub(crate) async fn reconcile_sending_one_copy(
    pod_list: Vec<Value>,
    reports: Vec<NodeStatus>,
    to: usize,
) -> (Vec<Recorded>, Value) {
    let m = example_model();
    let name = pod_list[to]["metadata"]["name"]
        .as_str()
        .expect("pod name")
        .to_string();
    let mut steps = vec![ephemeral_patch(&name, pod_list[to].clone())];
    steps.extend(status_then_events(&m, 3));
    let (recorded, result) = reconcile_live(
        plugins_at("0.2.0"),
        pod_list,
        reports,
        steps,
        Settings::default(),
    )
    .await;
    result.expect("reconcile");
    assert_eq!(writes_to(&recorded, "/ephemeralcontainers"), 1);
    let progressing = condition(&status_body(&recorded), "Progressing")["message"].clone();
    (recorded, progressing)
}

/// The Degraded condition of a halted delivery, whose message contains `why`.
fn assert_halted(status: &Value, why: &str) {
    let degraded = condition(status, "Degraded");
    assert_eq!(
        (degraded["status"].as_str(), degraded["reason"].as_str()),
        (Some("True"), Some("PluginUpdateHalted")),
        "{degraded}"
    );
    assert!(
        degraded["message"]
            .as_str()
            .is_some_and(|s| s.contains(why)),
        "{degraded}"
    );
}

#[tokio::test]
async fn a_new_plugin_version_is_copied_into_the_first_pod_without_touching_the_deployment() {
    let (recorded, _) = reconcile_sending_one_copy(
        two_pods_at_v1(),
        vec![report("0.1.0", None), report("0.1.0", None)],
        0,
    )
    .await;
    assert_eq!(writes_to(&recorded, "/deployments/"), 0, "no rollout");
    assert_eq!(writes_to(&recorded, "/configmaps/"), 0);
    let patch = &recorded[0];
    assert_eq!(patch.content_type, "application/strategic-merge-patch+json");
    assert!(
        patch.query.contains("fieldManager=gantry-operator"),
        "{}",
        patch.query
    );
    let container = &patch.body.as_ref().expect("body")["spec"]["ephemeralContainers"][0];
    assert_eq!(
        container,
        &json!({
            "name": format!("{SLOT}-u1"),
            "image": IMAGE_V2,
            "imagePullPolicy": "IfNotPresent",
            "command": ["/copy", "/engines/llama_cpp/cpu", "/opt/gantry/engines/llama_cpp/cpu"],
            "volumeMounts": [{"name": "engines", "mountPath": "/opt/gantry/engines", "readOnly": false}],
            "securityContext": {
                "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"]},
                "privileged": false,
                "readOnlyRootFilesystem": true,
                "runAsNonRoot": true,
                "seccompProfile": {"type": "RuntimeDefault"}
            },
            "terminationMessagePolicy": "FallbackToLogsOnError"
        })
    );
    let status = status_body(&recorded);
    let progressing = condition(&status, "Progressing");
    assert_eq!(
        (
            progressing["status"].as_str(),
            progressing["reason"].as_str()
        ),
        (Some("True"), Some("PluginUpdating"))
    );
    assert_eq!(
        progressing["message"],
        "EnginePlugin llama-cpp-cpu 0.2.0 delivered in place: 0 of 2 node pods run it"
    );
    assert_eq!(condition(&status, "Degraded")["status"], "False");
}

#[tokio::test]
async fn once_the_first_pod_runs_it_the_next_goes_and_then_nothing_more_is_written() {
    let applied = update(
        "applied",
        "1 model(s) switched to the new version with no downtime",
    );
    let (_, progressing) = reconcile_sending_one_copy(
        two_pods([Some(copied()), None]),
        vec![report("0.2.0", applied), report("0.1.0", None)],
        1,
    )
    .await;
    assert_eq!(
        progressing,
        "EnginePlugin llama-cpp-cpu 0.2.0 delivered in place: 1 of 2 node pods run it"
    );

    // Both run it: the rollout condition is back, and the reconcile writes nothing but status.
    let status = reconcile_writing_no_copy(
        two_pods([Some(copied()), Some(copied())]),
        vec![report("0.2.0", applied), report("0.2.0", applied)],
        3,
    )
    .await;
    let progressing = condition(&status, "Progressing");
    assert_eq!(progressing["reason"], "RolloutComplete", "{progressing}");
}

#[tokio::test]
async fn a_version_the_node_refuses_halts_the_delivery_and_degrades_the_model() {
    let refused = update(
        "refused",
        "the new version was refused: model `gemma-3-270m`: the warm-up failed",
    );
    // The second pod keeps 0.1.0: no copy is written.
    let status = reconcile_writing_no_copy(
        two_pods([Some(copied()), None]),
        vec![report("0.1.0", refused), report("0.1.0", None)],
        4,
    )
    .await;
    assert_halted(
        &status,
        "EnginePlugin llama-cpp-cpu 0.2.0: node pod gemma-3-270m-7c9d-aaaaa: its node refused: \
         the new version was refused: model `gemma-3-270m`: the warm-up failed; the delivery is \
         halted and 0 of 2 node pods run it, the others keep the version they run",
    );
    let progressing = condition(&status, "Progressing");
    assert_eq!(
        (
            progressing["status"].as_str(),
            progressing["reason"].as_str()
        ),
        (Some("False"), Some("PluginUpdateHalted"))
    );
    // Serving is not affected: the old version runs everywhere.
    assert_eq!(condition(&status, "Ready")["status"], "True");
}

#[tokio::test]
async fn an_image_that_cannot_be_pulled_halts_the_delivery() {
    let waiting =
        json!({"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}});
    let status = reconcile_writing_no_copy(
        two_pods([Some(waiting), None]),
        vec![report("0.1.0", None), report("0.1.0", None)],
        4,
    )
    .await;
    assert_halted(
        &status,
        "the copy container cannot start: ImagePullBackOff: Back-off pulling image",
    );
}

#[tokio::test]
async fn a_refused_copy_container_is_reported_and_retried_late() {
    let m = example_model();
    let mut refused = Step::fail(
        Method::PATCH,
        "/api/v1/namespaces/default/pods/gemma-3-270m-7c9d-aaaaa/ephemeralcontainers",
        403,
    );
    refused.reply = Reply::Json(api_status(
        403,
        "Forbidden",
        "ephemeral containers are not allowed",
    ));
    let mut steps = vec![refused];
    steps.extend(status_then_events(&m, 4));
    let (recorded, result) = reconcile_live(
        plugins_at("0.2.0"),
        two_pods_at_v1(),
        vec![report("0.1.0", None), report("0.1.0", None)],
        steps,
        Settings::default(),
    )
    .await;
    let err = result.expect_err("a refused delivery fails the reconcile");
    assert_eq!(err.metric_label(), "deliver_refused");
    assert_halted(&status_body(&recorded), "--plugin-delivery rollout");
}

#[tokio::test]
async fn with_rollout_delivery_a_new_version_rolls_the_deployment() {
    let m = example_model();
    let (ns, name) = ns_name(&m);
    let settings = Settings {
        plugin_delivery: PluginDelivery::Rollout,
        ..Settings::default()
    };
    let mut steps = vec![Step::apply(path("apps/v1", &ns, "deployments", &name))];
    steps.extend(status_then_events(&m, 2));
    let (recorded, result) = reconcile_live(
        plugins_at("0.2.0"),
        two_pods_at_v1(),
        vec![report("0.1.0", None), report("0.1.0", None)],
        steps,
        settings,
    )
    .await;
    result.expect("reconcile");
    let deploy = recorded[0].body.clone().expect("deployment");
    assert_eq!(
        deploy["spec"]["template"]["spec"]["initContainers"][0]["image"],
        IMAGE_V2
    );
    assert_eq!(writes_to(&recorded, "/ephemeralcontainers"), 0);
}

// --- a pool's pods: the pool and its objects, for deliver_pool.rs and reconcile_secret.rs ---

const POOL_UID: &str = "6a1e0c55-0000-4000-8000-0000000000d1";

/// A pool of two pods with one member, the example Model's weights under its served name (so
/// `report` speaks for it), allowed only the example plugin.
pub(crate) fn delivery_pool() -> (ModelPool, Vec<Model>) {
    let pool: ModelPool = serde_json::from_value(json!({
        "apiVersion": "gantry.dev/v1alpha1", "kind": "ModelPool",
        "metadata": {"name": "small", "namespace": "default", "uid": POOL_UID, "generation": 1},
        "spec": {"resources": {"cpu": "2", "memory": "3Gi"}, "replicas": {"min": 2, "max": 2},
                 "enginePlugins": ["llama-cpp-cpu"]},
    }))
    .expect("pool");
    let member: Model = serde_json::from_value(json!({
        "apiVersion": "gantry.dev/v1alpha1", "kind": "Model",
        "metadata": {"name": "gemma", "namespace": "default", "uid": "member-0", "generation": 1,
                     "creationTimestamp": "2023-11-14T22:13:20Z"},
        "spec": {"pool": "small", "format": "gguf", "architecture": "gemma3",
                 "servedName": "gemma-3-270m",
                 "source": {"uri": "hf://unsloth/gemma-3-270m-it-GGUF", "quantization": "Q4_K_M"},
                 "resources": {"memory": "600Mi"}},
    }))
    .expect("member");
    (pool, vec![member])
}

/// What a pool reconcile with `plugins` under operator `settings` builds for `pool` and
/// `members`.
pub(crate) fn pool_built(
    pool: &ModelPool,
    members: &[Model],
    plugins: &[EnginePlugin],
    settings: &Settings,
) -> OwnedObjects {
    let template = admit::template(pool, settings).expect("valid pool");
    let allowed = admit::allowed_plugins(pool, plugins.to_vec());
    let admission = admit::admit(pool, &template, members, &[], &allowed, settings);
    let config = admit::render(pool, &admission).expect("render");
    let pod = RenderedConfig {
        yaml: config.config.yaml.clone(),
        hash: config.pod_hash.clone(),
    };
    build::assemble(&template, &pod, &admission.mounted(), settings).expect("build")
}

/// The cached objects of a settled pool built as `live`: ConfigMap, Service, PDB and the
/// Deployment with its two pods ready.
pub(crate) fn settled_pool_objects(live: &OwnedObjects) -> Vec<Value> {
    let mut deployment = serde_json::to_value(&live.deployment).expect("json");
    deployment["metadata"]["generation"] = json!(1);
    deployment["spec"]["replicas"] = json!(2);
    deployment["status"] = json!({"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2,
                                  "readyReplicas": 2, "availableReplicas": 2});
    let mut objects = vec![
        serde_json::to_value(&live.config_map).expect("json"),
        deployment,
        serde_json::to_value(&live.service).expect("json"),
    ];
    objects.extend(
        live.pdb
            .iter()
            .map(|p| serde_json::to_value(p).expect("json")),
    );
    objects
}

pub(crate) fn pool_status_patch(pool: &ModelPool) -> Step {
    Step::apply_status(
        "/apis/gantry.dev/v1alpha1/namespaces/default/modelpools/small/status",
        serde_json::to_value(pool).expect("json"),
    )
}
