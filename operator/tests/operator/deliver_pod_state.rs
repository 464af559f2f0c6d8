//! In-place plugin delivery, one pod's state (deliver step): which copy a node's refusal answers,
//! when a copy is on its way or done, and which pods get no copy at all.

use gantry_operator::model::deliver::PodState;
use serde_json::{Value, json};

use crate::deliver::{
    IMAGE_V1, IMAGE_V2, POD_IPS, SLOT, built, copied, node_pod, plugins_at,
    reconcile_sending_one_copy, report, two_pods, two_pods_at_v1, update,
};
use crate::reconcile::example_model;

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
        let pod: gantry_operator::node_pod::NodePod = serde_json::from_value(node_pod(
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
    let pod: gantry_operator::node_pod::NodePod =
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
        serde_json::from_value::<gantry_operator::node_pod::NodePod>(v).expect("pod")
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
