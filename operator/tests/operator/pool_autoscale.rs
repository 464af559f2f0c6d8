//! The built-in autoscaler on ModelPools, one interval against a mock API server: a pool scales
//! on the summed queue of all its members, and on its pods' memory pressure (evictions and
//! refused loads) when the queue is light.

use std::collections::BTreeMap;
use std::sync::Arc;

use gantry_api::NodeStatus;
use gantry_crd::{Model, ModelPool};
use gantry_operator::context::Settings;
use serde_json::json;

use crate::pool::{Changing, POD_IP, built, created, example, pool_context, pool_path, pool_pod};
use crate::reconcile::{node_report, supported};
use crate::support::{Step, finish, path};

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
) -> gantry_operator::node_pod::NodePod {
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
