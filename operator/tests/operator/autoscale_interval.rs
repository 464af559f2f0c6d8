//! Built-in autoscaler, one interval against a mock API server: the exact scale and status
//! writes (or none), HPA-mode Models left alone, a hanging node pod silent within the metrics
//! timeout, and the flags that set the interval.

use std::collections::BTreeMap;
use std::time::Duration;

use gantry_api::{NodeStatus, QueueStatus};
use gantry_crd::{Autoscaling, AutoscalingMode, AutoscalingStatus, Model, Replicas};
use gantry_operator::autoscale::Autoscaler;
use gantry_operator::autoscale::decide::reason;
use gantry_operator::context::Settings;
use gantry_operator::model::{build, resolve::resolve, validate::validate};
use gantry_operator::node_pod::NodePod;
use gantry_operator::node_report::FixedNodeStatus;
use http::Method;
use k8s_openapi::api::apps::v1::Deployment;
use serde_json::{Value, json};

use crate::autoscale::{INTERVAL, at};
use crate::support::{Step, context, finish, fixture_model, fixture_plugins, path, t0};

fn scaling_model() -> Model {
    let mut m = fixture_model("cpu");
    m.spec.architecture = Some("gemma3".into());
    m.spec.replicas = Some(Replicas { min: 1, max: 5 });
    m.spec.autoscaling = Some(Autoscaling {
        target_queue_depth: Some(4),
        ..Autoscaling::default()
    });
    m
}

/// The node Deployment as the reconciler created it, at `replicas`.
fn live_deployment(m: &Model, replicas: i32) -> Deployment {
    let v = validate(m, &Settings::default()).expect("valid");
    let plugins = fixture_plugins();
    let r = resolve(&v, v.declared_architecture.as_deref(), &plugins, 1);
    let mut d = build::build(&v, &r.mounted(), &Settings::default())
        .expect("build")
        .deployment;
    d.spec.replicas = Some(replicas);
    d
}

fn ready_pod(m: &Model, name: &str, ip: &str) -> NodePod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"app.kubernetes.io/name": "gantry-node",
                                "gantry.dev/model": m.metadata.name}},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True"}]}
    }))
    .expect("pod")
}

fn node_with_queue(served: &str, waiting: u64, running: u64) -> NodeStatus {
    NodeStatus {
        version: "0.1.0".into(),
        backend: "cpu".into(),
        ready: true,
        draining: false,
        plugins: Vec::new(),
        models: vec![gantry_api::ModelStatus {
            id: served.into(),
            format: "gguf".into(),
            architecture: Some("gemma3".into()),
            verdict: None,
            artifact: Default::default(),
            load: Default::default(),
            queue: QueueStatus {
                waiting,
                running,
                kv_capacity_tokens: 4096,
                kv_used_tokens: 512,
                recurrent_state_bytes: None,
            },
            devices: Vec::new(),
            replicas: Vec::new(),
            crashes: None,
            engine_choice: None,
            adapters: Vec::new(),
            draft: None,
        }],
        ..NodeStatus::default()
    }
}

fn deployment_path() -> String {
    path("apps/v1", "default", "deployments", "gemma-3-270m")
}

fn status_path() -> String {
    format!(
        "{}/status",
        path("gantry.dev/v1alpha1", "default", "models", "gemma-3-270m")
    )
}

/// An autoscaler reading `nodes`, against a mock API server that expects one scale write of
/// `m`'s Deployment and one status write, both by the autoscaler's field manager.
fn scaling_once(
    m: &Model,
    nodes: BTreeMap<String, NodeStatus>,
) -> (
    Autoscaler,
    tokio::task::JoinHandle<Vec<crate::support::Recorded>>,
) {
    let (ctx, server) = context(Vec::new(), BTreeMap::new());
    let autoscaler = Autoscaler::new(
        ctx.client.clone(),
        std::sync::Arc::new(FixedNodeStatus(nodes)),
        ctx.metrics.clone(),
        Settings::default(),
    );
    let model_json = serde_json::to_value(m).expect("json");
    let server = server.run(vec![
        Step::apply(deployment_path()).by("gantry-autoscaler"),
        Step::apply_status(status_path(), model_json).by("gantry-autoscaler"),
    ]);
    (autoscaler, server)
}

#[tokio::test]
async fn a_busy_model_gets_exactly_one_scale_write_and_its_reason_in_status() {
    let m = scaling_model();
    let nodes = BTreeMap::from([
        (
            "10.0.0.5".to_string(),
            node_with_queue("gemma-3-270m", 9, 4),
        ),
        (
            "10.0.0.6".to_string(),
            node_with_queue("gemma-3-270m", 2, 4),
        ),
    ]);
    let (mut autoscaler, server) = scaling_once(&m, nodes);
    let pods = [
        ready_pod(&m, "gemma-3-270m-a", "10.0.0.5"),
        ready_pod(&m, "gemma-3-270m-b", "10.0.0.6"),
    ];
    let outcomes = autoscaler
        .tick(
            std::slice::from_ref(&m),
            &[live_deployment(&m, 2)],
            &pods,
            t0(),
        )
        .await;
    let recorded = finish(server).await;

    // 19 requests / 4 per pod = 5 pods.
    assert_eq!(outcomes.len(), 1);
    assert_eq!(outcomes[0].decision.desired, 5);
    assert!(outcomes[0].scaled && outcomes[0].status_written);
    assert_eq!(recorded[0].method, Method::PATCH);
    assert!(recorded[0].query.contains("force=true"));
    // Only the replica count, nothing else of the Deployment.
    assert_eq!(
        recorded[0].body,
        Some(json!({"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": "gemma-3-270m"}, "spec": {"replicas": 5}}))
    );
    let body = recorded[1].body.clone().expect("status body");
    assert_eq!(
        body["status"]
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>()),
        Some(vec!["autoscaling".to_string()]),
        "the autoscaler writes status.autoscaling and nothing else"
    );
    let a = &body["status"]["autoscaling"];
    assert_eq!(a["mode"], "Builtin");
    assert_eq!(a["desiredReplicas"], 5);
    assert_eq!(a["reason"], "ScaledUpQueueDepth");
    assert!(
        a["message"]
            .as_str()
            .is_some_and(|s| s.contains("19 requests")),
        "{a}"
    );
    assert_eq!(a["lastScaleTime"], "2023-11-14T22:13:20Z");
    assert_eq!(a["lastDecisionTime"], "2023-11-14T22:13:20Z");
}

#[tokio::test]
async fn a_node_reporting_a_full_gpu_gets_one_more_replica() {
    let m = scaling_model();
    // One request (the queue wants 1 pod), but the pod's H100 has 4 GiB of 80 free.
    let mut node = node_with_queue("gemma-3-270m", 0, 1);
    node.backend = "cuda".into();
    node.devices = vec![gantry_api::DeviceStatus {
        index: 0,
        uuid: Some("GPU-aee5320a-7ba3-62d6-92e5-283964ad4c54".into()),
        name: "NVIDIA H100 80GB HBM3".into(),
        compute_capability: "9.0".into(),
        total_bytes: 85_520_809_984,
        free_bytes: 4_294_967_296,
        utilization_percent: Some(3),
        process_used_bytes: Some(2_006_974_464),
        models: vec!["gemma-3-270m".into()],
    }];
    let nodes = BTreeMap::from([("10.0.0.5".to_string(), node)]);
    let (mut autoscaler, server) = scaling_once(&m, nodes);
    let pods = [ready_pod(&m, "gemma-3-270m-a", "10.0.0.5")];
    let outcomes = autoscaler
        .tick(
            std::slice::from_ref(&m),
            &[live_deployment(&m, 1)],
            &pods,
            t0(),
        )
        .await;
    let recorded = finish(server).await;
    assert_eq!(outcomes[0].decision.desired, 2);
    assert_eq!(
        recorded[0].body,
        Some(json!({"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": "gemma-3-270m"}, "spec": {"replicas": 2}}))
    );
    let a = &recorded[1].body.clone().expect("status body")["status"]["autoscaling"];
    assert_eq!(a["reason"], "ScaledUpVramPressure");
    assert!(
        a["message"]
            .as_str()
            .is_some_and(|s| s.contains("(highest 95%), counted as full -> 2")),
        "{a}"
    );
}

#[tokio::test]
async fn a_steady_model_whose_status_already_says_so_writes_nothing() {
    let mut m = scaling_model();
    m.status = Some(gantry_crd::ModelStatus {
        autoscaling: Some(AutoscalingStatus {
            mode: "Builtin".into(),
            desired_replicas: 2,
            reason: reason::STEADY.into(),
            message: "an older message".into(),
            last_decision_time: None,
            last_scale_time: None,
        }),
        ..Default::default()
    });
    // 7 requests on 2 pods: 2 pods at 4 per pod.
    let nodes = BTreeMap::from([
        (
            "10.0.0.5".to_string(),
            node_with_queue("gemma-3-270m", 0, 4),
        ),
        (
            "10.0.0.6".to_string(),
            node_with_queue("gemma-3-270m", 0, 3),
        ),
    ]);
    let (ctx, server) = context(Vec::new(), BTreeMap::new());
    let mut autoscaler = Autoscaler::new(
        ctx.client.clone(),
        std::sync::Arc::new(FixedNodeStatus(nodes)),
        ctx.metrics.clone(),
        Settings::default(),
    );
    let server = server.run(Vec::new());
    let pods = [
        ready_pod(&m, "gemma-3-270m-a", "10.0.0.5"),
        ready_pod(&m, "gemma-3-270m-b", "10.0.0.6"),
    ];
    let deployment = live_deployment(&m, 2);
    for i in 0..3 {
        let outcomes = autoscaler
            .tick(
                std::slice::from_ref(&m),
                std::slice::from_ref(&deployment),
                &pods,
                at(i * INTERVAL),
            )
            .await;
        assert_eq!(outcomes[0].decision.reason, reason::STEADY);
        assert!(!outcomes[0].scaled && !outcomes[0].status_written);
    }
    assert!(finish(server).await.is_empty());
}

#[tokio::test]
async fn an_hpa_mode_model_is_left_to_its_hpa() {
    let mut m = scaling_model();
    m.spec.autoscaling = Some(Autoscaling {
        mode: AutoscalingMode::Hpa,
        ..Autoscaling::default()
    });
    // A flood of requests: the built-in autoscaler must still not touch the Deployment.
    let nodes = BTreeMap::from([(
        "10.0.0.5".to_string(),
        node_with_queue("gemma-3-270m", 90, 8),
    )]);
    let (ctx, server) = context(Vec::new(), BTreeMap::new());
    let mut autoscaler = Autoscaler::new(
        ctx.client.clone(),
        std::sync::Arc::new(FixedNodeStatus(nodes)),
        ctx.metrics.clone(),
        Settings::default(),
    );
    let server = server.run(vec![
        Step::apply_status(status_path(), serde_json::to_value(&m).expect("json"))
            .by("gantry-autoscaler"),
    ]);
    let outcomes = autoscaler
        .tick(
            std::slice::from_ref(&m),
            &[live_deployment(&m, 3)],
            &[ready_pod(&m, "gemma-3-270m-a", "10.0.0.5")],
            t0(),
        )
        .await;
    let recorded = finish(server).await;
    assert_eq!(outcomes[0].decision.reason, reason::DELEGATED_TO_HPA);
    assert!(!outcomes[0].scaled);
    assert_eq!(recorded.len(), 1, "only the status, never the Deployment");
    let a: Value = recorded[0].body.clone().expect("body")["status"]["autoscaling"].clone();
    assert_eq!(
        (a["mode"].as_str(), a["reason"].as_str()),
        (Some("HPA"), Some("DelegatedToHPA"))
    );
    assert_eq!(a["desiredReplicas"], 3);
}

/// A loopback node status server on `ip:port` (port 0: any); `delay` before each answer.
async fn node_server(ip: &str, port: u16, doc: NodeStatus, delay: Duration) -> u16 {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind((ip, port))
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let body = serde_json::to_string(&doc).expect("json");
    let app = axum::Router::new().route(
        gantry_api::NODE_STATUS_PATH,
        get(move || {
            let body = body.clone();
            async move {
                tokio::time::sleep(delay).await;
                ([("content-type", "application/json")], body)
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    port
}

#[tokio::test]
async fn a_node_that_hangs_over_http_is_silent_within_the_timeout_and_holds_the_count() {
    // Two ready pods on loopback, same port: one answers at once with no load, the other
    // hangs. With a zero stabilization window the quiet pod alone would scale 2 -> 1; the
    // silent one must hold the count, and the interval must not wait for it.
    let mut m = scaling_model();
    m.spec.autoscaling = Some(Autoscaling {
        scale_down_stabilization_seconds: Some(0),
        ..Autoscaling::default()
    });
    let port = node_server(
        "127.0.0.1",
        0,
        node_with_queue("gemma-3-270m", 0, 0),
        Duration::ZERO,
    )
    .await;
    node_server(
        "127.0.0.2",
        port,
        node_with_queue("gemma-3-270m", 0, 0),
        Duration::from_secs(30),
    )
    .await;
    let source = gantry_operator::node_report::HttpNodeStatus::with_timeout(
        port,
        Duration::from_millis(300),
    )
    .expect("client");
    let (ctx, server) = context(Vec::new(), BTreeMap::new());
    let mut autoscaler = Autoscaler::new(
        ctx.client.clone(),
        std::sync::Arc::new(source),
        ctx.metrics.clone(),
        Settings::default(),
    );
    let server = server.run(vec![
        Step::apply_status(status_path(), serde_json::to_value(&m).expect("json"))
            .by("gantry-autoscaler"),
    ]);
    let pods = [
        ready_pod(&m, "gemma-3-270m-a", "127.0.0.1"),
        ready_pod(&m, "gemma-3-270m-b", "127.0.0.2"),
    ];
    let started = std::time::Instant::now();
    let outcomes = autoscaler
        .tick(
            std::slice::from_ref(&m),
            &[live_deployment(&m, 2)],
            &pods,
            t0(),
        )
        .await;
    let took = started.elapsed();
    let recorded = finish(server).await;
    assert!(took < Duration::from_secs(3), "the interval took {took:?}");
    let d = &outcomes[0].decision;
    assert_eq!(
        (d.desired, d.reason),
        (2, reason::SCALE_DOWN_STABILIZING),
        "{d:?}"
    );
    assert!(d.message.contains("1 ready pods silent"), "{}", d.message);
    assert!(!outcomes[0].scaled);
    assert_eq!(recorded.len(), 1, "a status write, no scale write");
}

#[test]
fn the_autoscaler_flags_parse_and_can_switch_it_off() {
    use clap::Parser;
    use gantry_operator::autoscale::AutoscalerConfig;
    use gantry_operator::cli::{Cli, Command};
    let parse = |args: &[&str]| match Cli::try_parse_from(
        ["gantry-operator", "run"].iter().chain(args.iter()),
    )
    .expect("parses")
    .command
    {
        Command::Run(run) => run.autoscaler.config(),
        other => panic!("not run: {other:?}"),
    };
    assert_eq!(parse(&[]), Some(AutoscalerConfig::default()));
    assert_eq!(
        parse(&[
            "--autoscaler-interval-seconds",
            "10",
            "--autoscaler-metrics-timeout-ms",
            "250"
        ]),
        Some(AutoscalerConfig {
            interval: Duration::from_secs(10),
            metrics_timeout: Duration::from_millis(250),
        })
    );
    assert_eq!(parse(&["--autoscaler=false"]), None);
    assert!(
        Cli::try_parse_from([
            "gantry-operator",
            "run",
            "--autoscaler-interval-seconds",
            "0"
        ])
        .is_err(),
        "an interval of 0 is refused"
    );
}
