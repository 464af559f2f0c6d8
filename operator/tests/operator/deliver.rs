//! In-place plugin delivery (Model reconcile, build and deliver steps), against a mock API
//! server: a new image of a `process`-isolated plugin keeps the pod template as it is (no
//! rollout) and reaches the running pods as an ephemeral copy container, one pod first, then
//! a quarter at a time; a refusal halts it and says so in the Model's conditions, or in a
//! ModelPool's for the pool's pods.

use std::collections::BTreeMap;
use std::sync::Arc;

use gantry_api::config::Isolation;
use gantry_api::{NodeStatus, PluginUpdate};
use gantry_crd::{EnginePlugin, Model, ModelPool};
use gantry_operator::context::{PluginDelivery, Settings};
use gantry_operator::model::build::{self, OwnedObjects};
use gantry_operator::model::deliver::{Delivery, PodState, Slot, plan};
use gantry_operator::model::node_config::RenderedConfig;
use gantry_operator::pool::{self, admit};
use http::{Method, StatusCode};
use kube::core::DeserializeGuard;
use serde_json::{Value, json};

use crate::reconcile::{
    desired, example_model, example_plugins, llama_cpp_entry, node_report, ns_name, pods, reads,
    ready_deployment, run, status_body, status_then_events, supported,
};
use crate::support::{
    Recorded, Reply, Step, condition, context_full, context_with, finish, path,
    status_body as api_status,
};

const SLOT: &str = "plugin-0-llama-cpp-cpu";
const IMAGE_V1: &str = "ghcr.io/gantry-dev/engine-llama-cpp-cpu:0.1.0";
const IMAGE_V2: &str = "ghcr.io/gantry-dev/engine-llama-cpp-cpu:0.2.0";
const POD_IPS: [&str; 2] = ["10.0.0.5", "10.0.0.6"];

/// The example plugin in `process` isolation at `version` (image tag = version).
fn plugins_at(version: &str) -> Vec<EnginePlugin> {
    let mut plugins = example_plugins();
    for p in &mut plugins {
        p.spec.isolation = Some(Isolation::Process);
        p.spec.version = version.to_string();
        p.spec.image = format!("ghcr.io/gantry-dev/engine-llama-cpp-cpu:{version}");
    }
    plugins
}

fn built(m: &Model, plugins: &[EnginePlugin]) -> OwnedObjects {
    desired(m, plugins, Some("gemma3"))
}

/// A running node pod of `o`'s template, named `gemma-3-270m-7c9d-{suffix}`, whose plugin init
/// container ran `init_image` and which has the ephemeral containers `ephemeral`
/// (name, image, state).
fn node_pod(
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
fn report(version: &str, update: Option<(&str, &str, &str)>) -> NodeStatus {
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

fn ephemeral_patch(pod: &str, reply: Value) -> Step {
    Step {
        manager: "gantry-operator",
        method: Method::PATCH,
        path: format!("/api/v1/namespaces/default/pods/{pod}/ephemeralcontainers"),
        status: StatusCode::OK,
        reply: Reply::Json(reply),
    }
}

fn writes_to(recorded: &[Recorded], what: &str) -> usize {
    recorded
        .iter()
        .filter(|r| r.method != Method::GET && r.path.contains(what))
        .count()
}

// --- the build step: which image changes roll and which do not ---

#[test]
fn a_new_image_of_a_process_plugin_keeps_the_live_template_so_nothing_rolls() {
    let m = example_model();
    let live = built(&m, &plugins_at("0.1.0"));
    let mut next = built(&m, &plugins_at("0.2.0"));
    assert_ne!(
        live.deployment, next.deployment,
        "the image is in the template"
    );
    let annotations = next
        .deployment
        .metadata
        .annotations
        .clone()
        .unwrap_or_default();
    assert_eq!(
        annotations["gantry.dev/plugin-images"],
        format!("{{\"{SLOT}\":\"{IMAGE_V2}\"}}")
    );

    let held = build::hold_plugin_images(&mut next, Some(&live.deployment)).expect("hold");
    assert!(held);
    // Exactly what runs: same hash, same template, so the apply step writes nothing.
    assert_eq!(next.deployment, live.deployment);
    assert_eq!(template_plugin_image(&next), Some(IMAGE_V1));
}

/// The image of the plugin init container in `o`'s pod template.
fn template_plugin_image(o: &OwnedObjects) -> Option<&str> {
    o.deployment
        .spec
        .template
        .spec
        .as_ref()?
        .init_containers
        .as_ref()?[0]
        .image
        .as_deref()
}

/// The objects for `m` with `plugins` under operator `settings`.
fn build_with(m: &Model, plugins: &[EnginePlugin], settings: &Settings) -> OwnedObjects {
    let v = gantry_operator::model::validate::validate(m, settings).expect("valid");
    let refs: Vec<&EnginePlugin> = plugins.iter().collect();
    build::build(&v, &refs, settings).expect("build")
}

#[test]
fn any_other_change_rolls_the_pods_with_the_new_image_in_the_new_template() {
    let m = example_model();
    let live = built(&m, &plugins_at("0.1.0"));
    // A new node image (an operator upgrade) and a new plugin version at once: one rollout.
    let settings = Settings {
        node_image: "ghcr.io/gantry-dev/gantry-node:0.2.0".into(),
        ..Settings::default()
    };
    let mut next = build_with(&m, &plugins_at("0.2.0"), &settings);
    let before = next.clone();
    assert!(!build::hold_plugin_images(&mut next, Some(&live.deployment)).expect("hold"));
    assert_eq!(next, before);
    assert_eq!(template_plugin_image(&next), Some(IMAGE_V2));
}

#[test]
fn an_in_process_plugin_or_rollout_delivery_rolls_for_a_new_image() {
    let m = example_model();
    // In-process: the node cannot replace its code, so the new image goes into the template.
    let mut v1 = example_plugins();
    let mut v2 = example_plugins();
    v2[0].spec.image = IMAGE_V2.into();
    v2[0].spec.version = "0.2.0".into();
    v1[0].spec.isolation = Some(Isolation::InProcess);
    v2[0].spec.isolation = Some(Isolation::InProcess);
    let live = built(&m, &v1);
    let mut next = built(&m, &v2);
    assert!(!build::hold_plugin_images(&mut next, Some(&live.deployment)).expect("hold"));
    let annotations = next
        .deployment
        .metadata
        .annotations
        .clone()
        .unwrap_or_default();
    assert!(
        !annotations.contains_key("gantry.dev/plugin-images"),
        "no plugin-images annotation for in-process plugins: {annotations:?}"
    );

    // `--plugin-delivery rollout`: the same for a process plugin.
    let settings = Settings {
        plugin_delivery: PluginDelivery::Rollout,
        ..Settings::default()
    };
    let live = build_with(&m, &plugins_at("0.1.0"), &settings);
    let mut next = build_with(&m, &plugins_at("0.2.0"), &settings);
    assert!(!build::hold_plugin_images(&mut next, Some(&live.deployment)).expect("hold"));
}

// --- the plan: pacing and halting ---

fn slot_of(plugins: &[EnginePlugin]) -> Slot<'_> {
    Slot {
        container: SLOT.into(),
        plugin: &plugins[0],
    }
}

fn stale(serving: bool) -> PodState {
    PodState::Stale {
        serving,
        ordinal: 0,
    }
}

fn named(states: Vec<PodState>) -> Vec<(String, PodState)> {
    states
        .into_iter()
        .enumerate()
        .map(|(i, s)| (format!("p{i}"), s))
        .collect()
}

fn pods_sent(sends: &[Delivery]) -> Vec<&str> {
    sends.iter().map(|s| s.pod.as_str()).collect()
}

#[test]
fn one_pod_goes_first_and_the_rest_wait_for_it() {
    let plugins = plugins_at("0.2.0");
    let slot = slot_of(&plugins);
    let (sends, progress) = plan(&slot, &named(vec![stale(true), stale(true), stale(true)]));
    assert_eq!(pods_sent(&sends), ["p0"]);
    assert_eq!(sends[0].container, format!("{SLOT}-u1"));
    assert_eq!((progress.done, progress.pods), (0, 3));
    assert!(progress.delivering());
    // While it is on its way, nobody else goes.
    let (sends, _) = plan(
        &slot,
        &named(vec![PodState::InFlight, stale(true), stale(true)]),
    );
    assert!(sends.is_empty());
}

#[test]
fn after_the_first_success_a_quarter_goes_at_a_time_and_only_to_serving_pods() {
    let plugins = plugins_at("0.2.0");
    let slot = slot_of(&plugins);
    // 9 pods: a quarter is 3; one is in flight, so two more go. The pod not serving yet (its
    // init container may still copy the older image) waits; so would one still copying.
    let mut states = vec![
        PodState::Done,
        PodState::InFlight,
        PodState::Stale {
            serving: false,
            ordinal: 0,
        },
        PodState::Stale {
            serving: true,
            ordinal: 2,
        },
    ];
    states.extend((0..5).map(|_| stale(true)));
    let (sends, progress) = plan(&slot, &named(states));
    assert_eq!(pods_sent(&sends), ["p3", "p4"]);
    assert_eq!(
        sends[0].container,
        format!("{SLOT}-u3"),
        "numbered after its last delivery"
    );
    assert_eq!((progress.done, progress.pods), (1, 9));

    let (sends, progress) = plan(&slot, &named(vec![PodState::Done, PodState::Done]));
    assert!(sends.is_empty());
    assert!(!progress.delivering());
}

#[test]
fn a_failed_pod_halts_the_delivery() {
    let plugins = plugins_at("0.2.0");
    let slot = slot_of(&plugins);
    let states = named(vec![
        PodState::Failed("its node refused: bad ABI".into()),
        stale(true),
        stale(false),
    ]);
    let (sends, progress) = plan(&slot, &states);
    assert!(sends.is_empty());
    assert_eq!(
        progress.halted,
        Some(("p0".to_string(), "its node refused: bad ABI".to_string()))
    );
    assert!(!progress.delivering());
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
fn two_pods(copies: [Option<Value>; 2]) -> Vec<Value> {
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

fn two_pods_at_v1() -> Vec<Value> {
    two_pods([None, None])
}

/// A copy container that finished its copy.
fn copied() -> Value {
    json!({"terminated": {"exitCode": 0, "reason": "Completed"}})
}

/// A node's report of an update of 0.2.0 in `state`.
fn update(
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
async fn reconcile_sending_one_copy(
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

// --- which refusal answers which copy ---

#[test]
fn only_a_refusal_after_the_copy_finished_halts_a_delivery() {
    use gantry_operator::model::deliver::pod_state;
    use gantry_operator::node_report::NodeReport;
    let m = example_model();
    let live = built(&m, &plugins_at("0.1.0"));
    let plugins = plugins_at("0.2.0");
    let t0 = crate::support::t0();
    let at = |secs: i64| {
        t0.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(secs))
            .expect("time")
            .to_string()
    };
    let u1 = format!("{SLOT}-u1");
    let state_of = |pod_state_json: Value, refused_secs_ago: u64| {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(node_pod(
            &live,
            "aaaaa",
            POD_IPS[0],
            IMAGE_V1,
            &[(&u1, IMAGE_V2, pod_state_json)],
        ))
        .expect("pod");
        let mut status = report("0.1.0", Some(("0.2.0", "refused", "warm-up failed")));
        if let Some(u) = status.plugins[0].update.as_mut() {
            u.seconds_ago = refused_secs_ago;
        }
        let report = NodeReport {
            pod: "default/gemma-3-270m-7c9d-aaaaa".into(),
            config_hash: None,
            plugins: vec!["llama-cpp-cpu".into()],
            status: Ok(status),
        };
        pod_state(&pod, SLOT, &plugins[0], Some(&report), false, t0).expect("a state")
    };
    let finished = |secs_ago: i64| json!({"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": at(secs_ago)}});
    // Still copying: an older refusal of this version (a fixed image, same version) is not its
    // answer.
    assert_eq!(
        state_of(json!({"running": {"startedAt": at(1)}}), 30),
        PodState::InFlight
    );
    // Copied 10 s ago; the refusal is 60 s old: an earlier delivery's.
    assert_eq!(state_of(finished(10), 60), PodState::InFlight);
    // Refused 5 s ago, after this copy: the answer.
    assert_eq!(
        state_of(finished(10), 5),
        PodState::Failed("its node refused: warm-up failed".into())
    );
}

#[tokio::test]
async fn a_pod_of_an_older_template_gets_no_copy() {
    // `aaaaa` runs a template a rollout is replacing (another pod spec): its replacement
    // brings the new image; only `bbbbb`, of the current template, is delivered to.
    let mut pod_list = two_pods_at_v1();
    pod_list[0]["metadata"]["annotations"]["gantry.dev/pod-spec-hash"] = json!("0123456789abcdef");
    let (_, progressing) = reconcile_sending_one_copy(
        pod_list,
        vec![report("0.1.0", None), report("0.1.0", None)],
        1,
    )
    .await;
    assert_eq!(
        progressing,
        "EnginePlugin llama-cpp-cpu 0.2.0 delivered in place: 0 of 1 node pods run it"
    );
}

#[test]
fn a_copy_sent_moments_ago_is_in_flight_whatever_the_cache_still_shows() {
    use gantry_operator::model::deliver::pod_state;
    let pulling =
        json!({"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}});
    let pod: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(two_pods([Some(pulling), None]).remove(0)).expect("pod");
    let plugins = plugins_at("0.2.0");
    let t0 = crate::support::t0();
    // The cache shows the earlier, failed copy: the pod is halted on it...
    let failed = pod_state(&pod, SLOT, &plugins[0], None, false, t0).expect("state");
    assert!(matches!(failed, PodState::Failed(_)), "{failed:?}");
    // ...until a new copy is sent (the image fixed); the cache has not caught up yet.
    assert_eq!(
        pod_state(&pod, SLOT, &plugins[0], None, true, t0),
        Some(PodState::InFlight)
    );
}

#[test]
fn no_copy_joins_one_on_its_way_nor_a_starting_pod_and_a_copy_is_done_only_once_answered() {
    use gantry_operator::model::deliver::pod_state;
    let t0 = crate::support::t0();
    let pod_with = |copy: Value, phase: &str| {
        let mut v = two_pods([Some(copy), None]).remove(0);
        v["status"]["phase"] = json!(phase);
        serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(v).expect("pod")
    };
    let node_at = |version: &str, update| gantry_operator::node_report::NodeReport {
        pod: "default/gemma-3-270m-7c9d-aaaaa".into(),
        config_hash: None,
        plugins: vec!["llama-cpp-cpu".into()],
        status: Ok(report(version, update)),
    };
    let copying = json!({"running": {"startedAt": "2023-11-14T22:13:19Z"}});
    // The pod's copy of 0.2.0 is still running when 0.3.0 arrives: it waits for it.
    let v3 = plugins_at("0.3.0");
    let state = pod_state(
        &pod_with(copying.clone(), "Running"),
        SLOT,
        &v3[0],
        Some(&node_at("0.1.0", None)),
        false,
        t0,
    );
    assert_eq!(state, Some(PodState::InFlight));
    // A pod still starting gets nothing yet.
    let state = pod_state(
        &pod_with(copied(), "Pending"),
        SLOT,
        &v3[0],
        None,
        false,
        t0,
    );
    assert_eq!(
        state,
        Some(PodState::Stale {
            serving: false,
            ordinal: 1
        })
    );
    // A new build under the same version: the node's report of that version (the old build)
    // does not make the pod done while the copy runs, nor after it unless the node answered.
    let v2 = plugins_at("0.2.0");
    let pod = pod_with(copying, "Running");
    assert_eq!(
        pod_state(&pod, SLOT, &v2[0], Some(&node_at("0.2.0", None)), false, t0),
        Some(PodState::InFlight)
    );
    let earlier = update("applied", "an earlier build");
    let finished = json!({"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": "2023-11-14T22:13:10Z"}});
    let mut node = node_at("0.2.0", earlier);
    if let Ok(s) = node.status.as_mut() {
        s.plugins[0].update.as_mut().expect("update").seconds_ago = 600;
    }
    let pod = pod_with(finished, "Running");
    assert_eq!(
        pod_state(&pod, SLOT, &v2[0], Some(&node), false, t0),
        Some(PodState::InFlight)
    );
    if let Ok(s) = node.status.as_mut() {
        s.plugins[0].update.as_mut().expect("update").seconds_ago = 1;
    }
    assert_eq!(
        pod_state(&pod, SLOT, &v2[0], Some(&node), false, t0),
        Some(PodState::Done)
    );
}

// --- a pool's pods: the same delivery, said in the pool's status ---

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

/// The pool's pods `aaaaa` and `bbbbb` as of plugin 0.1.0's template, each with the copy of
/// 0.2.0 listed for it (`Some(state)`: one, `-u1`, in that state).
fn two_pool_pods(live: &OwnedObjects, copies: [Option<Value>; 2]) -> Vec<Value> {
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
            let mut pod = node_pod(live, suffix, ip, IMAGE_V1, &ephemeral);
            pod["metadata"]["name"] = json!(format!("small-pool-7c9d-{suffix}"));
            pod
        })
        .collect()
}

pub(crate) fn pool_status_patch(pool: &ModelPool) -> Step {
    Step::apply_status(
        "/apis/gantry.dev/v1alpha1/namespaces/default/modelpools/small/status",
        serde_json::to_value(pool).expect("json"),
    )
}

/// One reconcile of `pool`, whose live objects were built with plugin 0.1.0 and which now
/// allows 0.2.0, over the pool pods `copies` describe and their `reports`; the requests after
/// the cache reads are `steps`. Returns what was requested.
async fn reconcile_pool_live(
    pool: &ModelPool,
    members: &[Model],
    copies: [Option<Value>; 2],
    reports: Vec<NodeStatus>,
    steps: Vec<Step>,
) -> Vec<Recorded> {
    let live = pool_built(pool, members, &plugins_at("0.1.0"), &Settings::default());
    let nodes: BTreeMap<String, NodeStatus> = POD_IPS
        .iter()
        .map(|ip| ip.to_string())
        .zip(reports)
        .collect();
    let (ctx, mut server) = context_full(
        Settings::default(),
        plugins_at("0.2.0"),
        nodes,
        members.to_vec(),
        vec![pool.clone()],
    );
    server.seed(settled_pool_objects(&live));
    pods(&mut server, two_pool_pods(&live, copies));
    let server = server.run(steps);
    pool::reconcile(Arc::new(DeserializeGuard(Ok(pool.clone()))), ctx)
        .await
        .expect("pool reconcile");
    finish(server).await
}

/// A condition as the pool's status patch carries it (the tests' clock, generation 1).
fn pool_condition(type_: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({"type": type_, "status": status, "reason": reason, "message": message,
           "observedGeneration": 1, "lastTransitionTime": "2023-11-14T22:13:20Z"})
}

#[tokio::test]
async fn a_pools_status_says_a_delivery_to_its_pods_is_under_way_then_halted() {
    let (mut pool, members) = delivery_pool();
    let ready = pool_condition("Ready", "True", "Ready", "2/2 node pods ready");

    // Both pods run 0.1.0: the first gets the copy, and the pool says the delivery is on.
    let recorded = reconcile_pool_live(
        &pool,
        &members,
        [None, None],
        vec![report("0.1.0", None), report("0.1.0", None)],
        vec![
            ephemeral_patch("small-pool-7c9d-aaaaa", json!({})),
            pool_status_patch(&pool),
        ],
    )
    .await;
    assert_eq!(writes_to(&recorded, "/deployments/"), 0, "no rollout");
    let status = status_body(&recorded);
    assert_eq!(
        status["conditions"],
        json!([
            ready,
            pool_condition(
                "Progressing",
                "True",
                "PluginUpdating",
                "EnginePlugin llama-cpp-cpu 0.2.0 delivered in place: 0 of 2 node pods run it"
            ),
            pool_condition("Degraded", "False", "AsExpected", ""),
        ])
    );
    pool.status = Some(serde_json::from_value(status).expect("status"));

    // The first pod's node refuses it: nothing more is copied, and the pool says why.
    let refused = update(
        "refused",
        "the new version was refused: model `gemma-3-270m`: the warm-up failed",
    );
    let reports = || vec![report("0.1.0", refused), report("0.1.0", None)];
    let recorded = reconcile_pool_live(
        &pool,
        &members,
        [Some(copied()), None],
        reports(),
        vec![pool_status_patch(&pool)],
    )
    .await;
    assert_eq!(writes_to(&recorded, "/ephemeralcontainers"), 0);
    let halted = "EnginePlugin llama-cpp-cpu 0.2.0: node pod small-pool-7c9d-aaaaa: its node \
                  refused: the new version was refused: model `gemma-3-270m`: the warm-up \
                  failed; the delivery is halted and 0 of 2 node pods run it, the others keep \
                  the version they run";
    let status = status_body(&recorded);
    assert_eq!(
        status["conditions"],
        json!([
            ready,
            pool_condition("Progressing", "False", "PluginUpdateHalted", halted),
            pool_condition("Degraded", "True", "PluginUpdateHalted", halted),
        ])
    );
    pool.status = Some(serde_json::from_value(status).expect("status"));

    // Nothing changed since: not a request.
    let recorded =
        reconcile_pool_live(&pool, &members, [Some(copied()), None], reports(), vec![]).await;
    assert!(recorded.is_empty(), "{recorded:#?}");
}
