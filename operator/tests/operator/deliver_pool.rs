//! In-place plugin delivery to a ModelPool's pods (pool reconcile, deliver step), against a mock
//! API server: the same delivery, one pod first, and its progress or halt said in the pool's
//! status conditions.

use std::collections::BTreeMap;
use std::sync::Arc;

use gantry_api::NodeStatus;
use gantry_crd::{Model, ModelPool};
use gantry_operator::context::Settings;
use gantry_operator::model::build::OwnedObjects;
use gantry_operator::pool;
use kube::core::DeserializeGuard;
use serde_json::{Value, json};

use crate::deliver::{
    IMAGE_V1, IMAGE_V2, POD_IPS, SLOT, copied, delivery_pool, ephemeral_patch, node_pod,
    plugins_at, pool_built, pool_status_patch, report, settled_pool_objects, update, writes_to,
};
use crate::reconcile::{pods, status_body};
use crate::support::{Recorded, Step, context_full, finish};

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
