//! The controller's caches and triggers (the read step's source): what a watch event puts in a
//! store and which Model it wakes, and what a reconcile costs when it runs on the caches —
//! counted request by request against the mock API server.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use futures::channel::mpsc;
use gantry_api::NodeStatus;
use gantry_crd::ModelStatus;
use gantry_operator::node_pod::NodePod;
use gantry_operator::watch_cache::{self, Kind, ModelRef, RecentWrites};
use http::Method;
use k8s_openapi::api::apps::v1::Deployment;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher::{self, Event};
use serde_json::{Value, json};

use crate::reconcile::{
    applies, desired, example_model, example_plugins, node_report, pods, reads, ready_deployment,
    run, running_pod, status_body, status_patch, supported,
};
use crate::support::{Step, context, finish, fixture_model, fixture_plugins};

/// Run `events` through [`watch_cache::drive`] into a fresh store; the Models it woke, in order.
async fn triggers<K>(events: Vec<Event<K>>, kind: Kind<K>) -> Vec<ModelRef>
where
    K: kube::Resource<DynamicType = ()>
        + serde::Serialize
        + Clone
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (_store, writer) = kube::runtime::reflector::store::<K>();
    let (tx, rx) = mpsc::channel(64);
    let stream = futures::stream::iter(events.into_iter().map(Ok::<_, watcher::Error>));
    watch_cache::drive(stream, writer, kind, Arc::new(RecentWrites::default()), tx).await;
    rx.collect().await
}

fn deployment_kind() -> Kind<Deployment> {
    Kind {
        name: "Deployment",
        trim: watch_cache::trim_deployment,
        owner: watch_cache::owner_model::<Deployment>,
    }
}

fn pod_kind() -> Kind<NodePod> {
    Kind {
        name: "Pod",
        trim: watch_cache::trim_pod,
        owner: watch_cache::pod_model,
    }
}

fn model_ref() -> ModelRef {
    ObjectRef::new("gemma-3-270m").within("default")
}

/// The example Model's running Deployment, with a resource version and the managed fields
/// the apiserver adds.
fn live_deployment(rv: &str) -> Deployment {
    let m = example_model();
    let o = desired(&m, &example_plugins(), Some("gemma3"));
    let mut d = ready_deployment(&o);
    d["metadata"]["resourceVersion"] = json!(rv);
    d["metadata"]["managedFields"] = json!([
        {"manager": "gantry-operator", "operation": "Apply", "apiVersion": "apps/v1",
         "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:template": {}}}},
        {"manager": "gantry-autoscaler", "operation": "Apply", "apiVersion": "apps/v1",
         "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:replicas": {}}}},
        {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "apps/v1",
         "fieldsType": "FieldsV1", "subresource": "status",
         "fieldsV1": {"f:status": {"f:readyReplicas": {}}}}
    ]);
    d["status"]["conditions"] = json!([{"type": "Available", "status": "True",
        "reason": "MinimumReplicasAvailable", "lastUpdateTime": "2026-01-01T00:00:00Z",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]);
    serde_json::from_value(d).expect("deployment")
}

#[tokio::test]
async fn a_deployment_change_wakes_its_model_only_when_the_reconcile_reads_it() {
    let first = live_deployment("1");
    // The controller manager touches the condition's update time and its own managed fields.
    let mut touched = live_deployment("2");
    if let Some(c) = touched
        .status
        .as_mut()
        .and_then(|s| s.conditions.as_mut())
        .and_then(|c| c.first_mut())
    {
        c.last_update_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-01-01T00:05:00Z".parse().expect("time"),
        ));
    }
    // A pod stops being ready.
    let mut unready = live_deployment("3");
    if let Some(s) = unready.status.as_mut() {
        s.ready_replicas = Some(0);
    }
    let woke = triggers(
        vec![
            Event::Init,
            Event::InitApply(first),
            Event::InitDone,
            Event::Apply(touched),
            Event::Apply(unready.clone()),
            Event::Delete(unready),
        ],
        deployment_kind(),
    )
    .await;
    // The first list wakes nothing (the controller reconciles every Model when it starts); the
    // touched update wakes nothing; the readiness change and the delete wake the Model.
    assert_eq!(woke, [model_ref(), model_ref()]);
}

#[tokio::test]
async fn a_relist_after_a_broken_watch_wakes_the_models_of_what_changed_or_vanished() {
    let m = example_model();
    let o = desired(&m, &example_plugins(), Some("gemma3"));
    let pod = |name: &str, phase: &str| -> NodePod {
        let mut p = running_pod(&m, &o);
        p["metadata"]["name"] = json!(name);
        p["metadata"]["uid"] = json!(format!("uid-{name}"));
        p["status"]["phase"] = json!(phase);
        serde_json::from_value(p).expect("pod")
    };
    let woke = triggers(
        vec![
            Event::Init,
            Event::InitApply(pod("a", "Running")),
            Event::InitApply(pod("b", "Running")),
            Event::InitDone,
            // The watch broke; the re-list finds `a` unchanged and `b` gone.
            Event::Init,
            Event::InitApply(pod("a", "Running")),
            Event::InitDone,
            // `a` fails.
            Event::Apply(pod("a", "Failed")),
        ],
        pod_kind(),
    )
    .await;
    assert_eq!(woke, [model_ref(), model_ref()]);
}

#[test]
fn trimmed_objects_keep_what_the_reconcile_reads_and_nothing_else() {
    let mut d = live_deployment("7");
    watch_cache::trim_deployment(&mut d);
    let v = serde_json::to_value(&d).expect("json");
    // Replica ownership survives (the hand-over check); the template and other managers go.
    assert_eq!(
        v["metadata"]["managedFields"],
        json!([{"manager": "gantry-autoscaler", "operation": "gantry.dev/owns-spec.replicas"}])
    );
    // The trimmed entry still reads as the owner of the replicas.
    assert!(!gantry_operator::model::apply::operator_alone_owns_replicas(&d));
    let mut alone = live_deployment("8");
    alone
        .metadata
        .managed_fields
        .iter_mut()
        .flatten()
        .for_each(|e| {
            if e.manager.as_deref() == Some("gantry-autoscaler") {
                e.manager = Some("gantry-operator".into());
            }
        });
    assert!(gantry_operator::model::apply::operator_alone_owns_replicas(
        &alone
    ));
    watch_cache::trim_deployment(&mut alone);
    assert!(gantry_operator::model::apply::operator_alone_owns_replicas(
        &alone
    ));
    assert!(v["spec"]["template"]["spec"]["containers"].is_null(), "{v}");
    assert_eq!(v["spec"]["replicas"], 1);
    assert_eq!(v["status"]["readyReplicas"], 1);
    assert!(
        v["metadata"]["annotations"]["gantry.dev/applied-hash"].is_string(),
        "{v}"
    );
    assert!(v["metadata"]["labels"]["app.kubernetes.io/managed-by"].is_null());

    let m = example_model();
    let o = desired(&m, &example_plugins(), Some("gemma3"));
    let mut p: NodePod = serde_json::from_value(running_pod(&m, &o)).expect("pod");
    p.metadata.annotations.get_or_insert_default().insert(
        "kubectl.kubernetes.io/restartedAt".into(),
        "2026-01-01T00:00:00Z".into(),
    );
    watch_cache::trim_pod(&mut p);
    let annotations: Vec<&String> = p
        .metadata
        .annotations
        .iter()
        .flatten()
        .map(|(k, _)| k)
        .collect();
    assert!(
        annotations.iter().all(|k| k.starts_with("gantry.dev/")),
        "{annotations:?}"
    );
    assert!(p.spec.is_none());
    assert_eq!(
        p.metadata.labels.map(|l| l.into_keys().collect::<Vec<_>>()),
        Some(vec![
            "app.kubernetes.io/name".to_string(),
            "gantry.dev/model".to_string()
        ])
    );
}

#[tokio::test]
async fn the_first_reconcile_of_a_new_model_makes_its_writes_and_not_one_read() {
    let m = fixture_model("cpu");
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    run(m, ctx.clone()).await.expect("reconcile");
    let recorded = finish(server).await;
    // ConfigMap, Deployment, replica hand-over, Service, status: five requests, all writes.
    assert_eq!(recorded.len(), 5);
    assert!(
        recorded.iter().all(|r| r.method == Method::PATCH),
        "{recorded:#?}"
    );
}

#[tokio::test]
async fn a_reconcile_that_races_its_own_watch_events_does_not_write_twice() {
    let m = fixture_model("cpu");
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    run(m.clone(), ctx.clone()).await.expect("first");
    finish(server).await;
    // Again at once: none of the writes has come back through a watch yet, and the Model in
    // the store still has its old status. Nothing is written again (the mock server is gone:
    // any request would fail the reconcile).
    assert_eq!(
        ctx.caches.recent.len(),
        4,
        "ConfigMap, Deployment, Service, status"
    );
    let writes_before = ctx.metrics.total_writes();
    run(m, ctx.clone()).await.expect("second");
    assert_eq!(ctx.metrics.total_writes(), writes_before);
}

#[tokio::test]
async fn a_status_only_change_of_the_deployment_costs_one_status_patch() {
    let mut m = example_model();
    let plugins = example_plugins();
    let o = desired(&m, &plugins, Some("gemma3"));
    let reports = node_report("gemma-3-270m", "gemma3", supported());
    let base = m.clone();
    let world = |server: &mut crate::support::ApiServer, deploy: Value| {
        pods(server, vec![running_pod(&base, &o)]);
        reads(
            server,
            Some(serde_json::to_value(&o.config_map).expect("json")),
            Some(deploy),
            Some(serde_json::to_value(&o.service).expect("json")),
            None,
        )
    };
    // Settle: the status the steady world folds to.
    let (ctx, mut server) = context(plugins.clone(), reports.clone());
    let mut steps = world(&mut server, ready_deployment(&o));
    steps.push(status_patch(&m));
    steps.extend((0..3).map(|_| Step::event("default")));
    let server = server.run(steps);
    run(m.clone(), ctx).await.expect("settle");
    let settled = status_body(&finish(server).await);
    m.status = Some(serde_json::from_value::<ModelStatus>(settled).expect("status"));

    // The Deployment's status changes (its one pod stopped being ready): one status patch,
    // and the Event for Ready turning False; no other request.
    let mut unready = ready_deployment(&o);
    unready["status"]["readyReplicas"] = json!(0);
    unready["status"]["availableReplicas"] = json!(0);
    let (ctx, mut server) = context(plugins, reports);
    let mut steps = world(&mut server, unready);
    steps.push(status_patch(&m));
    steps.push(Step::event("default"));
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let patches: Vec<&str> = recorded
        .iter()
        .filter(|r| r.method == Method::PATCH)
        .map(|r| r.path.as_str())
        .collect();
    assert_eq!(
        patches,
        ["/apis/gantry.dev/v1alpha1/namespaces/default/models/gemma-3-270m/status"]
    );
    assert!(recorded.iter().all(|r| r.method != Method::GET));
}

/// The autoscaler and the Model controller both wait for the Model store's first list: each
/// must go on once it lists, whichever waited first (kube's own wait wakes only the last).
#[tokio::test]
async fn every_task_waiting_for_a_store_goes_on_once_it_lists() {
    let (store, mut writer) = kube::runtime::reflector::store::<NodePod>();
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { watch_cache::until_listed(&store).await })
        })
        .collect();
    // Let every waiter register before the list ends.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    writer.apply_watcher_event(&Event::Init);
    let pod: NodePod =
        serde_json::from_value(json!({"metadata": {"name": "a", "namespace": "default"}}))
            .expect("pod");
    writer.apply_watcher_event(&Event::InitApply(pod));
    writer.apply_watcher_event(&Event::InitDone);
    for w in waiters {
        let done = tokio::time::timeout(std::time::Duration::from_secs(5), w)
            .await
            .expect("a waiter still asleep 5 s after the store listed")
            .expect("join");
        assert!(done.is_ok());
    }
    assert_eq!(store.state().len(), 1);
}

/// A node pod that answered and then misses a status request or two (a timeout under load)
/// keeps its last answer, for the reconciles and the autoscaler alike; the third failure in a
/// row is what they see.
#[tokio::test]
async fn a_pod_that_misses_two_status_requests_keeps_its_last_answer() {
    use gantry_operator::report_cache::Reports;
    let answer = node_report("x", "gemma3", supported())
        .remove("10.0.0.5")
        .expect("report");
    let source = Arc::new(crate::pool::Changing(std::sync::Mutex::new(
        BTreeMap::from([("10.0.0.5".to_string(), answer.clone())]),
    )));
    let reports = Reports::new(source.clone());
    let pod: NodePod = serde_json::from_value(json!({
        "metadata": {"name": "x-1", "namespace": "default", "uid": "u-1",
                     "labels": {"gantry.dev/model": "x"}},
        "status": {"phase": "Running", "podIP": "10.0.0.5"}}))
    .expect("pod");
    let facts = gantry_operator::node_report::facts(&pod).expect("reachable");
    let long = std::time::Duration::from_secs(60);
    let (first, status) = reports
        .recent(source.as_ref(), &facts, long, 0, NodeStatus::clone)
        .await
        .expect("an answer");
    assert_eq!(status, answer);
    source.0.lock().expect("statuses").clear();
    for miss in 1..=2 {
        let (seq, kept) = reports
            .recent(source.as_ref(), &facts, long, first, NodeStatus::clone)
            .await
            .unwrap_or_else(|| panic!("miss {miss}: the last answer is kept"));
        assert_eq!((seq, &kept), (first, &answer), "miss {miss}");
        let seen = reports.of(&[Arc::new(pod.clone())]).await;
        assert_eq!(seen[0].status.as_ref().ok(), Some(&answer), "miss {miss}");
    }
    assert!(
        reports
            .recent(source.as_ref(), &facts, long, first, NodeStatus::clone)
            .await
            .is_none(),
        "the third miss in a row is shown"
    );
    let seen = reports.of(&[Arc::new(pod)]).await;
    assert!(seen[0].status.is_err());
}

/// The pod store reads pods as the API server sends them into `NodePod`: what the reconcile,
/// the autoscaler and deliveries read arrives under the API's field names, the rest is never
/// held, and the trimmed pod keeps only the `Ready` condition.
#[test]
fn a_node_pod_is_read_from_a_full_pod_document() {
    let full = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gemma-node-0", "namespace": "default", "uid": "u-9",
                     "labels": {"gantry.dev/model": "gemma", "app.kubernetes.io/name": "gantry-node",
                                "pod-template-hash": "abc"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
                                          "uid": "u-rs", "controller": true}]},
        "spec": {
            "containers": [{"name": "node", "image": "gantry/node:1", "args": ["serve"],
                            "resources": {"limits": {"memory": "4Gi"}},
                            "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8080}}}],
            "initContainers": [{"name": "plugin-llama-cpp", "image": "gantry/engine-llama-cpp:0.2",
                                "command": ["/copy"], "volumeMounts": [{"name": "engines", "mountPath": "/e"}]}],
            "ephemeralContainers": [{"name": "plugin-llama-cpp-u1", "image": "gantry/engine-llama-cpp:0.3",
                                     "targetContainerName": "node"}],
            "volumes": [{"name": "engines", "emptyDir": {}}],
            "nodeName": "n1", "serviceAccountName": "gantry-node"
        },
        "status": {
            "phase": "Running", "podIP": "10.0.0.9", "hostIP": "192.168.0.2",
            "podIPs": [{"ip": "10.0.0.9"}],
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Initialized", "status": "True"},
                           {"type": "Ready", "status": "True", "lastProbeTime": null,
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            "containerStatuses": [{"name": "node", "image": "gantry/node:1", "imageID": "x", "ready": true,
                                   "restartCount": 0, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}],
            "ephemeralContainerStatuses": [{"name": "plugin-llama-cpp-u1", "image": "gantry/engine-llama-cpp:0.3",
                                            "imageID": "y", "ready": false, "restartCount": 0,
                                            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]
        }
    });
    let mut pod: NodePod = serde_json::from_value(full).expect("a pod reads as a NodePod");
    let facts = gantry_operator::node_report::facts(&pod).expect("running with an IP");
    assert_eq!(facts.ip, "10.0.0.9");
    assert_eq!(facts.model, "gemma");
    let spec = pod.spec.as_ref().expect("spec");
    let init = spec.init_containers.as_ref().expect("init containers");
    assert_eq!(init[0].name, "plugin-llama-cpp");
    assert_eq!(
        init[0].image.as_deref(),
        Some("gantry/engine-llama-cpp:0.2")
    );
    let eph = spec
        .ephemeral_containers
        .as_ref()
        .expect("ephemeral containers");
    assert_eq!(eph[0].image.as_deref(), Some("gantry/engine-llama-cpp:0.3"));
    let status = pod.status.as_ref().expect("status");
    let run = &status
        .ephemeral_container_statuses
        .as_ref()
        .expect("states")[0];
    assert_eq!(
        run.state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .map(|t| t.exit_code),
        Some(0)
    );
    watch_cache::trim_pod(&mut pod);
    let v = serde_json::to_value(&pod).expect("json");
    assert_eq!(
        v["status"],
        json!({"phase": "Running", "podIP": "10.0.0.9",
               "conditions": [{"type": "Ready", "status": "True"}],
               "ephemeralContainerStatuses": [{"name": "plugin-llama-cpp-u1",
                                               "image": "gantry/engine-llama-cpp:0.3",
                                               "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]})
    );
    assert_eq!(
        v["spec"],
        json!({"initContainers": [{"name": "plugin-llama-cpp", "image": "gantry/engine-llama-cpp:0.2"}],
               "ephemeralContainers": [{"name": "plugin-llama-cpp-u1", "image": "gantry/engine-llama-cpp:0.3"}]})
    );
    assert!(v["metadata"]["ownerReferences"].is_null());
    assert!(v["metadata"]["labels"]["pod-template-hash"].is_null());
}
