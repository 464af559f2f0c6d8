//! ModelPool reconcile and pool members' status against a mock API server: the exact requests
//! (method and path, in order) a pool reconcile makes as members join or leave, in the steady
//! state and on deletion, and what the members' status says. Also the helpers the pool files use.

use std::collections::BTreeMap;
use std::sync::Arc;

use gantry_api::{LoadState, NodeStatus};
use gantry_crd::{Model, ModelPool, ModelPoolStatus, ModelStatus};
use gantry_operator::context::Settings;
use gantry_operator::model;
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
pub(crate) const POD_IP: &str = "10.0.0.5";

/// The docs example: the pool and its three members, as the apiserver hands them over (the
/// members created one second apart, in file order).
pub(crate) fn example() -> (ModelPool, Vec<Model>) {
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

pub(crate) fn created(i: usize) -> Time {
    Time(Timestamp::from_second(1_700_000_000 + i as i64).expect("time"))
}

/// One more member of the pool.
pub(crate) fn member(name: &str, served: &str, memory: &str, i: usize) -> Model {
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
pub(crate) fn pool_context(
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

pub(crate) async fn run_pool(
    pool: ModelPool,
    ctx: Arc<gantry_operator::context::Context>,
) -> Result<Action, model::Error> {
    pool::reconcile(Arc::new(DeserializeGuard(Ok(pool))), ctx).await
}

pub(crate) async fn run_model(
    m: Model,
    ctx: Arc<gantry_operator::context::Context>,
) -> Result<Action, model::Error> {
    model::reconcile(Arc::new(DeserializeGuard(Ok(m))), ctx).await
}

pub(crate) fn pool_path(kind: &str) -> String {
    match kind {
        "configmaps" | "services" => path("v1", "default", kind, "small-pool"),
        "deployments" => path("apps/v1", "default", kind, "small-pool"),
        _ => path("policy/v1", "default", kind, "small-pool"),
    }
}

pub(crate) fn pool_status_patch(pool: &ModelPool) -> Step {
    Step::apply_status(
        format!(
            "{}/status",
            path("gantry.dev/v1alpha1", "default", "modelpools", "small")
        ),
        serde_json::to_value(pool).expect("json"),
    )
}

pub(crate) fn model_status_patch(m: &Model) -> Step {
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

pub(crate) fn status_of(recorded: &[Recorded]) -> Value {
    recorded
        .iter()
        .find(|r| r.path.ends_with("/status"))
        .and_then(|r| r.body.clone())
        .expect("a status patch")["status"]
        .clone()
}

/// The objects a pool reconcile of `pool` with `members` builds: what a previous pass applied.
pub(crate) fn built(
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
pub(crate) fn seed_live(
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
pub(crate) fn pool_pod(o: &gantry_operator::model::build::OwnedObjects) -> Value {
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
