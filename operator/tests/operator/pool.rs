//! ModelPool reconcile and pool members' status against a mock API server: the exact requests
//! (method and path, in order) a pool reconcile makes as members join, leave or are refused,
//! and what the members' status says.

use std::collections::BTreeMap;
use std::sync::Arc;

use gantry_api::{LoadState, NodeStatus};
use gantry_crd::{Model, ModelPool, ModelPoolStatus, ModelStatus};
use gantry_operator::context::Settings;
use gantry_operator::model::{self, validate::validate};
use gantry_operator::pool::{self, admit};
use http::Method;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use crate::reconcile::{example_plugins, node_report, supported};
use crate::support::{
    ApiServer, Recorded, Step, condition, context_full, finish, path, repo_dir, yaml_docs,
};

const POOL_UID: &str = "6a1e0c55-0000-4000-8000-0000000000b1";
const POD_IP: &str = "10.0.0.5";

/// The docs example: the pool and its three members, as the apiserver hands them over (the
/// members created one second apart, in file order).
fn example() -> (ModelPool, Vec<Model>) {
    let path = repo_dir().join("docs/examples/modelpool-small.yaml");
    let docs = yaml_docs::<Value>(&path);
    let mut pool: ModelPool = serde_json::from_value(docs[0].clone()).expect("pool");
    pool.metadata.uid = Some(POOL_UID.into());
    pool.metadata.generation = Some(1);
    let members = docs[1..]
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut m: Model = serde_json::from_value(d.clone()).expect("model");
            m.metadata.uid = Some(format!("member-{i}"));
            m.metadata.generation = Some(1);
            m.metadata.creation_timestamp = Some(created(i));
            m
        })
        .collect();
    (pool, members)
}

fn created(i: usize) -> Time {
    Time(Timestamp::from_second(1_700_000_000 + i as i64).expect("time"))
}

/// One more member of the pool.
fn member(name: &str, served: &str, memory: &str, i: usize) -> Model {
    serde_json::from_value(json!({
        "apiVersion": "gantry.dev/v1alpha1", "kind": "Model",
        "metadata": {"name": name, "namespace": "default", "uid": format!("member-{i}"),
                     "generation": 1, "creationTimestamp": created(i)},
        "spec": {"pool": "small", "format": "gguf", "architecture": "llama",
                 "servedName": served,
                 "source": {"uri": format!("hf://example/{name}-GGUF"), "quantization": "Q4_K_M"},
                 "resources": {"memory": memory}},
    }))
    .expect("model")
}

/// A context whose stores hold `pool` and `members`, with the example plugins and `nodes`'
/// status documents.
fn pool_context(
    pool: ModelPool,
    members: Vec<Model>,
    nodes: BTreeMap<String, NodeStatus>,
) -> (Arc<gantry_operator::context::Context>, ApiServer) {
    context_full(
        Settings::default(),
        example_plugins(),
        nodes,
        members,
        vec![pool],
    )
}

async fn run_pool(
    pool: ModelPool,
    ctx: Arc<gantry_operator::context::Context>,
) -> Result<Action, model::Error> {
    pool::reconcile(Arc::new(DeserializeGuard(Ok(pool))), ctx).await
}

async fn run_model(
    m: Model,
    ctx: Arc<gantry_operator::context::Context>,
) -> Result<Action, model::Error> {
    model::reconcile(Arc::new(DeserializeGuard(Ok(m))), ctx).await
}

fn pool_path(kind: &str) -> String {
    match kind {
        "configmaps" | "services" => path("v1", "default", kind, "small-pool"),
        "deployments" => path("apps/v1", "default", kind, "small-pool"),
        _ => path("policy/v1", "default", kind, "small-pool"),
    }
}

fn pool_status_patch(pool: &ModelPool) -> Step {
    Step::apply_status(
        format!(
            "{}/status",
            path("gantry.dev/v1alpha1", "default", "modelpools", "small")
        ),
        serde_json::to_value(pool).expect("json"),
    )
}

fn model_status_patch(m: &Model) -> Step {
    Step::apply_status(
        format!(
            "{}/status",
            path(
                "gantry.dev/v1alpha1",
                "default",
                "models",
                m.metadata.name.as_deref().unwrap_or_default()
            )
        ),
        serde_json::to_value(m).expect("json"),
    )
}

fn body<'a>(recorded: &'a [Recorded], suffix: &str) -> &'a Value {
    recorded
        .iter()
        .find(|r| r.method == Method::PATCH && r.path.ends_with(suffix))
        .and_then(|r| r.body.as_ref())
        .unwrap_or_else(|| panic!("no PATCH of {suffix} in {recorded:#?}"))
}

fn status_of(recorded: &[Recorded]) -> Value {
    recorded
        .iter()
        .find(|r| r.path.ends_with("/status"))
        .and_then(|r| r.body.clone())
        .expect("a status patch")["status"]
        .clone()
}

/// The objects a pool reconcile of `pool` with `members` builds: what a previous pass applied.
fn built(
    pool: &ModelPool,
    members: &[Model],
) -> (gantry_operator::model::build::OwnedObjects, String) {
    let settings = Settings::default();
    let template = admit::template(pool, &settings).expect("valid pool");
    let plugins = admit::allowed_plugins(pool, example_plugins());
    let admission = admit::admit(pool, &template, members, &[], &plugins, &settings);
    let config = admit::render(pool, &admission).expect("render");
    let pod = gantry_operator::model::node_config::RenderedConfig {
        yaml: config.config.yaml.clone(),
        hash: config.pod_hash.clone(),
    };
    let objects =
        gantry_operator::model::build::assemble(&template, &pod, &admission.mounted(), &settings)
            .expect("build");
    (objects, config.config.hash)
}

/// Seed the cluster with the objects `built` returns, the Deployment ready with `replicas`.
fn seed_live(
    server: &mut ApiServer,
    o: &gantry_operator::model::build::OwnedObjects,
    replicas: i32,
) {
    let mut d = serde_json::to_value(&o.deployment).expect("json");
    d["metadata"]["generation"] = json!(1);
    d["spec"]["replicas"] = json!(replicas);
    d["status"] = json!({"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                         "readyReplicas": replicas, "availableReplicas": replicas});
    let mut objects = vec![
        serde_json::to_value(&o.config_map).expect("json"),
        d,
        serde_json::to_value(&o.service).expect("json"),
    ];
    if let Some(pdb) = &o.pdb {
        objects.push(serde_json::to_value(pdb).expect("json"));
    }
    server.seed(objects);
}

/// A running pool pod, labelled as the Deployment's template labels its pods.
fn pool_pod(o: &gantry_operator::model::build::OwnedObjects) -> Value {
    let meta = o
        .deployment
        .spec
        .template
        .metadata
        .clone()
        .expect("template metadata");
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "small-pool-7c9d-abcde", "namespace": "default",
                        "uid": "pool-pod-uid", "labels": meta.labels,
                        "annotations": meta.annotations},
           "status": {"phase": "Running", "podIP": POD_IP}})
}

#[tokio::test]
async fn a_pool_with_three_models_renders_one_deployment_whose_config_lists_them_all() {
    let (pool, members) = example();
    let (ctx, server) = pool_context(pool.clone(), members.clone(), BTreeMap::new());
    let server = server.run(vec![
        Step::apply(pool_path("configmaps")),
        Step::apply(pool_path("deployments")),
        Step::apply(pool_path("deployments")).by("gantry-autoscaler"),
        Step::apply(pool_path("services")),
        Step::apply(pool_path("poddisruptionbudgets")),
        pool_status_patch(&pool),
    ]);
    let action = run_pool(pool.clone(), ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(action, Action::requeue(pool::RESYNC));

    // One node config lists all three, lazily, sorted by served name.
    let cm = body(&recorded, "/configmaps/small-pool");
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(cm["data"]["models.yaml"].as_str().expect("yaml")).expect("config");
    let ids: Vec<&str> = config.models.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "gemma-3-270m-q8_0",
            "qwen2.5-0.5b-instruct",
            "smollm2-135m-instruct"
        ]
    );
    assert!(
        config
            .models
            .iter()
            .all(|m| m.load == gantry_api::LoadPolicy::Lazy)
    );
    // The pool's engine settings reach members that set none.
    assert!(config.models.iter().all(|m| m.context_length == Some(4096)));

    // The Deployment belongs to the pool, carries its label, mounts the allowed plugin only,
    // and its pod template does not carry the model list's hash.
    let deploy = body(&recorded, "/deployments/small-pool");
    assert_eq!(
        deploy["metadata"]["ownerReferences"],
        json!([{"apiVersion": "gantry.dev/v1alpha1", "kind": "ModelPool", "name": "small",
                "uid": POOL_UID, "controller": true, "blockOwnerDeletion": true}])
    );
    let template = &deploy["spec"]["template"]["metadata"];
    assert_eq!(template["labels"]["gantry.dev/pool"], "small");
    assert_eq!(
        template["annotations"]["gantry.dev/engine-plugins"],
        "llama-cpp-cpu"
    );
    let (_, config_hash) = built(&pool, &members);
    assert_ne!(
        template["annotations"]["gantry.dev/config-hash"],
        json!(config_hash)
    );
    assert_eq!(
        deploy["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"],
        "3Gi"
    );

    let status = status_of(&recorded);
    assert_eq!(status["modelCount"], 3);
    assert_eq!(status["refusedCount"], 0);
    assert_eq!(status["models"][0]["plugins"], json!(["llama-cpp-cpu"]));
    assert_eq!(condition(&status, "Ready")["reason"], "ReplicasNotReady");
    assert_eq!(status["endpoint"], "http://small-pool.default.svc:8080/v1");
}

#[tokio::test]
async fn adding_and_removing_a_member_patches_only_the_config_map() {
    let (pool, members) = example();
    let (live, _) = built(&pool, &members);

    // A fourth Model joins.
    let mut four = members.clone();
    four.push(member("tiny", "tiny-llama", "100Mi", 3));
    let (ctx, mut server) = pool_context(pool.clone(), four.clone(), BTreeMap::new());
    seed_live(&mut server, &live, 2);
    let server = server.run(vec![
        Step::apply(pool_path("configmaps")),
        pool_status_patch(&pool),
    ]);
    run_pool(pool.clone(), ctx).await.expect("join");
    let recorded = finish(server).await;
    let cm = body(&recorded, "/configmaps/small-pool");
    let yaml = cm["data"]["models.yaml"].as_str().expect("yaml");
    assert!(yaml.contains("id: tiny-llama"), "{yaml}");
    assert_eq!(status_of(&recorded)["modelCount"], 4);

    // One of the first three leaves.
    let two = members[1..].to_vec();
    let (ctx, mut server) = pool_context(pool.clone(), two.clone(), BTreeMap::new());
    seed_live(&mut server, &live, 2);
    let server = server.run(vec![
        Step::apply(pool_path("configmaps")),
        pool_status_patch(&pool),
    ]);
    run_pool(pool.clone(), ctx).await.expect("leave");
    let recorded = finish(server).await;
    let cm = body(&recorded, "/configmaps/small-pool");
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(cm["data"]["models.yaml"].as_str().expect("yaml")).expect("config");
    let ids: Vec<&str> = config.models.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["qwen2.5-0.5b-instruct", "smollm2-135m-instruct"]);
    // What the new config hashes to is what the pods report once they reloaded it.
    let (_, hash) = built(&pool, &two);
    assert_eq!(
        gantry_operator::model::node_config::short_hash(
            cm["data"]["models.yaml"].as_str().expect("yaml").as_bytes()
        ),
        hash
    );
}

#[tokio::test]
async fn a_member_that_cannot_fit_is_refused_with_its_reason_and_the_pool_is_untouched() {
    let (pool, members) = example();
    let (live, _) = built(&pool, &members);
    // modelMemory is 2Gi: 90 % of it is 1,932,735,283 bytes; 3Gi can never load.
    let big = member("big", "big-model", "3Gi", 3);
    let mut all = members.clone();
    all.push(big.clone());
    let (ctx, mut server) = pool_context(pool.clone(), all.clone(), BTreeMap::new());
    seed_live(&mut server, &live, 2);
    // No object write: the config is what it was. Only the pool's status says why.
    let server = server.run(vec![pool_status_patch(&pool)]);
    run_pool(pool.clone(), ctx.clone())
        .await
        .expect("reconcile");
    let recorded = finish(server).await;
    let status = status_of(&recorded);
    assert_eq!(status["modelCount"], 3);
    assert_eq!(status["refused"][0]["name"], "big");
    assert_eq!(status["refused"][0]["reason"], "DoesNotFit");
    let message = status["refused"][0]["message"].as_str().expect("message");
    assert!(
        message.contains("spec.resources.memory (3221225472 bytes)"),
        "{message}"
    );
    assert!(message.contains("1932735283 bytes"), "{message}");

    // The member itself: Ready=False with the same reason, no objects of its own.
    let (ctx, server) = pool_context(pool.clone(), all, BTreeMap::new());
    let server = server.run(vec![model_status_patch(&big), Step::event("default")]);
    run_model(big, ctx).await.expect("member reconcile");
    let recorded = finish(server).await;
    let status = status_of(&recorded);
    let ready = condition(&status, "Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("False"), Some("DoesNotFit"))
    );
    assert!(
        ready["message"]
            .as_str()
            .is_some_and(|m| m.contains("the ModelPool `small` refuses it"))
    );
    assert_eq!(status["pool"]["name"], "small");
}

#[tokio::test]
async fn a_member_whose_format_no_allowed_engine_serves_is_refused() {
    let (pool, mut members) = example();
    members[2].spec.format = gantry_crd::ModelFormat::Safetensors;
    members[2].spec.source.quantization = None;
    let (ctx, server) = pool_context(pool.clone(), members.clone(), BTreeMap::new());
    let server = server.run(vec![
        Step::apply(pool_path("configmaps")),
        Step::apply(pool_path("deployments")),
        Step::apply(pool_path("deployments")).by("gantry-autoscaler"),
        Step::apply(pool_path("services")),
        Step::apply(pool_path("poddisruptionbudgets")),
        pool_status_patch(&pool),
    ]);
    run_pool(pool, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let status = status_of(&recorded);
    assert_eq!(status["modelCount"], 2);
    assert_eq!(status["refused"][0]["name"], "smollm2-135m");
    assert_eq!(status["refused"][0]["reason"], "EngineUnresolved");
    assert!(
        status["refused"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("llama-cpp-cpu")),
        "{status}"
    );
}

#[tokio::test]
async fn a_steady_pool_makes_no_request_and_its_members_report_the_pods_that_hold_them() {
    let (mut pool, members) = example();
    let (live, hash) = built(&pool, &members);
    // The pool pod runs the current config and has loaded one member.
    let nodes = node_report_with(&hash);

    let (ctx, mut server) = pool_context(pool.clone(), members.clone(), nodes.clone());
    seed_live(&mut server, &live, 2);
    server.seed([pool_pod(&live)]);
    let server = server.run(vec![pool_status_patch(&pool)]);
    run_pool(pool.clone(), ctx).await.expect("pass 1");
    let recorded = finish(server).await;
    let status = status_of(&recorded);
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(
        status["pods"],
        json!([{"name": "small-pool-7c9d-abcde", "ready": true, "configCurrent": true,
                "loaded": ["gemma-3-270m-q8_0"], "memoryUsedBytes": 600_000_000,
                "memoryLimitBytes": 2_147_483_648_i64, "evictions": 3, "refusals": 1}])
    );

    // Second pass with that status stored: not a read, not a write.
    pool.status = Some(serde_json::from_value::<ModelPoolStatus>(status).expect("status"));
    let (ctx, mut server) = pool_context(pool.clone(), members.clone(), nodes.clone());
    seed_live(&mut server, &live, 2);
    server.seed([pool_pod(&live)]);
    let server = server.run(vec![]);
    run_pool(pool.clone(), ctx.clone()).await.expect("pass 2");
    let recorded = finish(server).await;
    assert!(recorded.is_empty(), "{recorded:#?}");
    assert_eq!(ctx.metrics.total_writes(), 0);

    // The loaded member: Ready, the pool's endpoint, the pod that holds it.
    let gemma = members[0].clone();
    let (ctx, mut server) = pool_context(pool.clone(), members.clone(), nodes);
    seed_live(&mut server, &live, 2);
    server.seed([pool_pod(&live)]);
    let server = server.run(vec![
        model_status_patch(&gemma),
        Step::event("default"),
        Step::event("default"),
        Step::event("default"),
    ]);
    let action = run_model(gemma.clone(), ctx).await.expect("member");
    let recorded = finish(server).await;
    assert_eq!(action, Action::requeue(pool::RESYNC));
    let status = status_of(&recorded);
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(status["endpoint"], "http://small-pool.default.svc:8080/v1");
    assert_eq!(
        status["pool"],
        json!({"name": "small", "listedBy": ["small-pool-7c9d-abcde"],
               "loadedOn": ["small-pool-7c9d-abcde"]})
    );
    // A member's stored status folds to itself: its second reconcile writes nothing.
    let mut again = gemma;
    again.status = Some(serde_json::from_value::<ModelStatus>(status).expect("status"));
    let (ctx, mut server) = pool_context(pool, members, node_report_with(&hash));
    seed_live(&mut server, &live, 2);
    server.seed([pool_pod(&live)]);
    let server = server.run(vec![]);
    run_model(again, ctx.clone()).await.expect("member pass 2");
    assert!(finish(server).await.is_empty());
    assert_eq!(ctx.metrics.total_writes(), 0);
}

/// The report of the steady test: gemma loaded, qwen listed, the current config.
fn node_report_with(hash: &str) -> BTreeMap<String, NodeStatus> {
    let mut report = node_report("gemma-3-270m-q8_0", "gemma3", supported());
    let node = report.get_mut(POD_IP).expect("report");
    let mut idle = node.models[0].clone();
    idle.id = "qwen2.5-0.5b-instruct".into();
    idle.load.state = LoadState::Unloaded;
    node.models.push(idle);
    node.config_hash = Some(hash.to_string());
    node.memory = Some(gantry_api::MemoryStatus {
        pool: "ram".into(),
        limit_bytes: 2_147_483_648,
        watermark_bytes: Some(1_932_735_283),
        used_bytes: 600_000_000,
        evictions_total: 3,
        refusals_total: 1,
    });
    report
}

#[tokio::test]
async fn deleting_a_pool_makes_no_request_because_owner_references_cascade() {
    let (mut pool, members) = example();
    pool.metadata.deletion_timestamp = Some(created(9));
    let (ctx, server) = pool_context(pool.clone(), members.clone(), BTreeMap::new());
    let server = server.run(vec![]);
    let action = run_pool(pool.clone(), ctx).await.expect("reconcile");
    assert!(finish(server).await.is_empty());
    assert_eq!(action, Action::await_change());
    // Every object the pool owns names it as controller: the garbage collector removes them.
    let (o, _) = built(&pool, &members);
    let refs = [
        o.config_map.metadata.owner_references.clone(),
        o.deployment.metadata.owner_references.clone(),
        o.service.metadata.owner_references.clone(),
        o.pdb
            .as_ref()
            .and_then(|p| p.metadata.owner_references.clone()),
    ];
    for r in refs {
        let r = r.expect("owner references");
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].kind.as_str(), r[0].uid.as_str()),
            ("ModelPool", POOL_UID)
        );
        assert_eq!(r[0].controller, Some(true));
    }
}

#[tokio::test]
async fn a_member_of_a_pool_that_does_not_exist_is_refused() {
    let (_, members) = example();
    let m = members[0].clone();
    let (ctx, server) = context_full(
        Settings::default(),
        example_plugins(),
        BTreeMap::new(),
        members,
        vec![],
    );
    let server = server.run(vec![model_status_patch(&m), Step::event("default")]);
    let action = run_model(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(action, Action::await_change());
    let status = status_of(&recorded);
    assert_eq!(condition(&status, "Ready")["reason"], "PoolNotFound");
    assert_eq!(condition(&status, "Degraded")["status"], "True");
}

#[test]
fn a_member_may_not_shape_pods_or_bring_its_own_volume_or_secret() {
    let (_, members) = example();
    let mut m = members[0].clone();
    m.spec.replicas = Some(gantry_crd::Replicas { min: 1, max: 3 });
    m.spec.source.secret_ref = Some(gantry_crd::SecretKeyRef {
        name: "hf".into(),
        key: None,
    });
    let problems = validate(&m, &Settings::default()).expect_err("invalid");
    let message = gantry_operator::model::validate::message(&problems);
    assert!(
        message.contains("spec.replicas: belongs to the ModelPool `small`"),
        "{message}"
    );
    assert!(message.contains("spec.source.secretRef"), "{message}");
    // Lazy loading is fine for a member (a dedicated Model refuses it).
    let mut lazy = members[0].clone();
    lazy.spec.load = gantry_crd::LoadPolicy::Lazy;
    assert!(validate(&lazy, &Settings::default()).is_ok());
}

#[test]
fn two_members_with_one_served_name_keep_the_older() {
    let (pool, members) = example();
    let settings = Settings::default();
    let template = admit::template(&pool, &settings).expect("template");
    let mut twin = member("twin", "gemma-3-270m-q8_0", "100Mi", 7);
    twin.spec.architecture = Some("gemma3".into());
    let mut all = members.clone();
    all.push(twin);
    let a = admit::admit(&pool, &template, &all, &[], &example_plugins(), &settings);
    assert_eq!(a.members.len(), 3);
    assert_eq!(a.refused[0].name, "twin");
    assert_eq!(a.refused[0].reason, "ServedNameTaken");
}

// --- The built-in autoscaler on pools -----------------------------------------------------

/// Node statuses that the test changes between intervals (a pool's pressure is a rate).
pub(crate) struct Changing(pub(crate) std::sync::Mutex<BTreeMap<String, NodeStatus>>);

impl gantry_operator::node_report::NodeStatusSource for Changing {
    fn fetch<'a>(
        &'a self,
        pod_ip: &'a str,
        _model: gantry_operator::node_report::ModelRef<'a>,
    ) -> futures::future::BoxFuture<'a, Result<NodeStatus, gantry_operator::node_report::ReportError>>
    {
        let found = self.0.lock().expect("statuses").get(pod_ip).cloned();
        Box::pin(async move {
            found.ok_or_else(|| gantry_operator::node_report::ReportError::Unreachable {
                url: pod_ip.to_string(),
                message: "no status for this pod".to_string(),
            })
        })
    }
}

/// A pool pod's status: each `(served name, waiting, running)` and its pressure counters.
fn pool_node(queues: &[(&str, u64, u64)], evictions: u64, refusals: u64) -> NodeStatus {
    let mut base = node_report("x", "gemma3", supported())
        .remove(POD_IP)
        .expect("report");
    let template = base.models[0].clone();
    base.models = queues
        .iter()
        .map(|(id, waiting, running)| {
            let mut m = template.clone();
            m.id = (*id).to_string();
            m.queue.waiting = *waiting;
            m.queue.running = *running;
            m
        })
        .collect();
    base.memory = Some(gantry_api::MemoryStatus {
        pool: "ram".into(),
        limit_bytes: 2_147_483_648,
        watermark_bytes: Some(1_932_735_283),
        used_bytes: 1_500_000_000,
        evictions_total: evictions,
        refusals_total: refusals,
    });
    base
}

/// The example pool, autoscaled between 1 and 4 pods at 4 requests per pod.
fn scaling_pool() -> (ModelPool, Vec<Model>) {
    let (mut pool, members) = example();
    pool.spec.replicas = Some(gantry_crd::Replicas { min: 1, max: 4 });
    pool.spec.autoscaling = Some(gantry_crd::Autoscaling {
        target_queue_depth: Some(4),
        ..gantry_crd::Autoscaling::default()
    });
    (pool, members)
}

fn ready_pool_pod(
    o: &gantry_operator::model::build::OwnedObjects,
    name: &str,
    ip: &str,
) -> k8s_openapi::api::core::v1::Pod {
    let mut pod = pool_pod(o);
    pod["metadata"]["name"] = json!(name);
    pod["status"] = json!({"phase": "Running", "podIP": ip,
                           "conditions": [{"type": "Ready", "status": "True"}]});
    serde_json::from_value(pod).expect("pod")
}

fn live_deployment(
    o: &gantry_operator::model::build::OwnedObjects,
    replicas: i32,
) -> k8s_openapi::api::apps::v1::Deployment {
    let mut d = o.deployment.clone();
    d.spec.replicas = Some(replicas);
    d
}

#[tokio::test]
async fn a_pool_scales_on_the_summed_queue_of_all_its_members() {
    let (pool, members) = scaling_pool();
    let (o, _) = built(&pool, &members);
    // Two pods; 11 requests spread over three members: 3 pods at 4 per pod.
    let nodes = BTreeMap::from([
        (
            "10.0.0.5".to_string(),
            pool_node(
                &[("gemma-3-270m-q8_0", 3, 2), ("qwen2.5-0.5b-instruct", 1, 1)],
                0,
                0,
            ),
        ),
        (
            "10.0.0.6".to_string(),
            pool_node(&[("smollm2-135m-instruct", 2, 2)], 0, 0),
        ),
    ]);
    let (ctx, server) = pool_context(pool.clone(), members, BTreeMap::new());
    let mut autoscaler = gantry_operator::autoscale::Autoscaler::new(
        ctx.client.clone(),
        Arc::new(Changing(std::sync::Mutex::new(nodes))),
        ctx.metrics.clone(),
        Settings::default(),
    );
    let server = server.run(vec![
        Step::apply(pool_path("deployments")).by("gantry-autoscaler"),
        Step::apply_status(
            format!(
                "{}/status",
                path("gantry.dev/v1alpha1", "default", "modelpools", "small")
            ),
            serde_json::to_value(&pool).expect("json"),
        )
        .by("gantry-autoscaler"),
    ]);
    let pods = [
        ready_pool_pod(&o, "small-pool-a", "10.0.0.5"),
        ready_pool_pod(&o, "small-pool-b", "10.0.0.6"),
    ];
    let outcomes = autoscaler
        .tick_pools(
            std::slice::from_ref(&pool),
            &[live_deployment(&o, 2)],
            &pods,
            created(0).0,
        )
        .await;
    let recorded = finish(server).await;
    assert_eq!(outcomes.len(), 1);
    assert_eq!(outcomes[0].model, "ModelPool/default/small");
    assert_eq!(outcomes[0].decision.desired, 3);
    assert_eq!(outcomes[0].decision.reason, "ScaledUpQueueDepth");
    assert_eq!(
        recorded[0].body,
        Some(json!({"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": "small-pool"}, "spec": {"replicas": 3}}))
    );
    let a = &recorded[1].body.as_ref().expect("status")["status"]["autoscaling"];
    assert_eq!(a["reason"], "ScaledUpQueueDepth");
    assert!(
        a["message"]
            .as_str()
            .is_some_and(|m| m.contains("11 requests")),
        "{a}"
    );
}

#[tokio::test]
async fn evictions_and_refused_loads_add_a_pod_to_a_pool_with_a_light_queue() {
    let (pool, members) = scaling_pool();
    let (o, _) = built(&pool, &members);
    let statuses = Arc::new(Changing(std::sync::Mutex::new(BTreeMap::from([(
        "10.0.0.5".to_string(),
        pool_node(&[("gemma-3-270m-q8_0", 0, 1)], 10, 2),
    )]))));
    let (ctx, server) = pool_context(pool.clone(), members, BTreeMap::new());
    let mut autoscaler = gantry_operator::autoscale::Autoscaler::new(
        ctx.client.clone(),
        statuses.clone(),
        ctx.metrics.clone(),
        Settings::default(),
    );
    let status_path = format!(
        "{}/status",
        path("gantry.dev/v1alpha1", "default", "modelpools", "small")
    );
    let server = server.run(vec![
        // First interval: one request on one pod, the counters read for the first time: steady.
        Step::apply_status(
            status_path.clone(),
            serde_json::to_value(&pool).expect("json"),
        )
        .by("gantry-autoscaler"),
        // 30 s later: 2 more evictions and 1 more refusal, 6 a minute: one pod more.
        Step::apply(pool_path("deployments")).by("gantry-autoscaler"),
        Step::apply_status(status_path, serde_json::to_value(&pool).expect("json"))
            .by("gantry-autoscaler"),
    ]);
    let pods = [ready_pool_pod(&o, "small-pool-a", "10.0.0.5")];
    let deployment = live_deployment(&o, 1);
    let first = autoscaler
        .tick_pools(
            std::slice::from_ref(&pool),
            std::slice::from_ref(&deployment),
            &pods,
            created(0).0,
        )
        .await;
    assert_eq!(first[0].decision.desired, 1);
    statuses.0.lock().expect("statuses").insert(
        "10.0.0.5".to_string(),
        pool_node(&[("gemma-3-270m-q8_0", 0, 1)], 12, 3),
    );
    let second = autoscaler
        .tick_pools(
            std::slice::from_ref(&pool),
            std::slice::from_ref(&deployment),
            &pods,
            created(30).0,
        )
        .await;
    let recorded = finish(server).await;
    assert_eq!(second[0].decision.desired, 2);
    assert_eq!(second[0].decision.reason, "ScaledUpMemoryPressure");
    assert!(
        second[0].decision.message.contains("memory pressure 6.0"),
        "{}",
        second[0].decision.message
    );
    assert_eq!(
        recorded[1].body,
        Some(json!({"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": "small-pool"}, "spec": {"replicas": 2}}))
    );
}

#[test]
fn a_pool_names_the_isolation_of_the_plugins_its_pods_mount_on_its_pod_hash() {
    let (pool, members) = example();
    let settings = Settings::default();
    let render = |plugins: &[gantry_crd::EnginePlugin]| {
        let template = admit::template(&pool, &settings).expect("template");
        let a = admit::admit(&pool, &template, &members, &[], plugins, &settings);
        admit::render(&pool, &a).expect("render")
    };
    let plain = render(&example_plugins());
    let mut isolated = example_plugins();
    isolated[0].spec.isolation = Some(gantry_api::config::Isolation::Process);
    let rendered = render(&isolated);
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(&rendered.config.yaml).expect("config");
    assert_eq!(
        config.isolation.plugins,
        BTreeMap::from([(
            "llama_cpp".to_string(),
            gantry_api::config::Isolation::Process
        )])
    );
    assert!(!plain.config.yaml.contains("isolation"));
    // Node-wide, opened once per plugin: on the pod template's hash, so the pods roll.
    assert_ne!(rendered.pod_hash, plain.pod_hash);
}

#[test]
fn the_pools_watermark_reaches_its_pods_and_decides_what_fits() {
    let (mut pool, mut members) = example();
    members.push(member("mid", "mid-model", "1500Mi", 3));
    let settings = Settings::default();
    let admit_all = |pool: &ModelPool| {
        let template = admit::template(pool, &settings).expect("template");
        admit::admit(
            pool,
            &template,
            &members,
            &[],
            &example_plugins(),
            &settings,
        )
    };
    // 1500 MiB fits under 90 % of 2 GiB (1843 MiB) ...
    let a = admit_all(&pool);
    assert!(a.member("mid").is_some());
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(&admit::render(&pool, &a).expect("render").config.yaml)
            .expect("config");
    assert_eq!(config.scheduler.memory_watermark_percent, 90);
    // ... not under 70 % (1434 MiB), and the pods are told 70.
    pool.spec.memory_watermark_percent = Some(70);
    let a = admit_all(&pool);
    let refused = a.refusal("mid").expect("refused");
    assert_eq!(refused.reason, "DoesNotFit");
    assert!(refused.message.contains("70 %"), "{}", refused.message);
    let rendered = admit::render(&pool, &a).expect("render");
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(&rendered.config.yaml).expect("config");
    assert_eq!(config.scheduler.memory_watermark_percent, 70);
    // A node-wide setting: on the pod template's hash, so the pods roll to read it.
    let before = admit::render(&example().0, &admit_all(&example().0)).expect("render");
    assert_ne!(rendered.pod_hash, before.pod_hash);
    // Out of range: the pool is invalid.
    pool.spec.memory_watermark_percent = Some(99 + 1);
    let problems = admit::template(&pool, &settings).expect_err("invalid");
    assert!(
        gantry_operator::model::validate::message(&problems)
            .contains("spec.memoryWatermarkPercent")
    );
}
