//! Model reconcile, engine resolution (resolve step), against a mock API server: which
//! EnginePlugin serves the Model, every candidate refused and why, what the node pods' reports
//! narrow or reject, and what is deleted or kept when no engine serves it any more.

use std::collections::BTreeMap;

use gantry_api::{EngineVerdict, Rejection, RejectionKind};
use gantry_crd::EnginePlugin;
use gantry_operator::model;
use http::Method;
use kube::runtime::controller::Action;
use serde_json::json;

use crate::reconcile::{
    UID_EXAMPLE, applies, desired, example_model, example_plugins, node_report, ns_name, pods,
    reads, ready_deployment, run, running_pod, status_body, status_patch, supported,
};
use crate::support::{Step, condition, context, finish, fixture_model, fixture_plugins, path};

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
