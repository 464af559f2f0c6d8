//! Model reconcile failures (validate, apply and status steps), against a mock API server: what
//! a failing, conflicting or refused request, an object owned by someone else, an invalid spec or
//! a malformed object leaves written, and when the reconcile runs again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gantry_operator::model;
use http::Method;
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::Action;
use serde_json::json;

use crate::reconcile::{applies, ns_name, reads, run, status_body, status_patch};
use crate::support::{Step, condition, context, finish, fixture_model, fixture_plugins, path};

#[tokio::test]
async fn a_server_error_on_apply_requeues_with_backoff_and_the_retry_finishes_the_job() {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(Step::apply(path("v1", &ns, "configmaps", &name)));
    steps.push(Step::fail(
        Method::PATCH,
        path("apps/v1", &ns, "deployments", &name),
        500,
    ));
    let server = server.run(steps);
    let obj = Arc::new(DeserializeGuard(Ok(m.clone())));
    let err = model::reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("500 fails the reconcile");
    let recorded = finish(server).await;
    assert_eq!(err.metric_label(), "apply_transient");
    assert!(
        recorded.iter().all(|r| !r.path.ends_with("/status")),
        "a transient failure does not touch status"
    );
    assert_eq!(
        model::error_policy(obj.clone(), &err, ctx.clone()),
        Action::requeue(Duration::from_secs(5))
    );
    assert_eq!(
        model::error_policy(obj, &err, ctx.clone()),
        Action::requeue(Duration::from_secs(10))
    );
    assert!(ctx.metrics.encode().expect("metrics").contains(
        "gantry_operator_reconcile_errors_total{controller=\"model\",error=\"apply_transient\"} 1"
    ));

    // The retry sees the ConfigMap already applied and picks up where it failed.
    let applied_cm = recorded[0].body.clone().expect("configmap");
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, Some(applied_cm), None, None, None);
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)));
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)).by("gantry-autoscaler"));
    steps.push(Step::apply(path("v1", &ns, "services", &name)));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    run(m, ctx).await.expect("retry");
    finish(server).await;
}

#[tokio::test]
async fn a_conflict_on_the_status_patch_requeues_without_losing_the_applied_objects() {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(Step::fail(
        Method::PATCH,
        format!(
            "{}/status",
            path("gantry.dev/v1alpha1", &ns, "models", &name)
        ),
        409,
    ));
    let server = server.run(steps);
    let obj = Arc::new(DeserializeGuard(Ok(m)));
    let err = model::reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("409 fails the reconcile");
    finish(server).await;
    assert_eq!(err.metric_label(), "status_patch");
    assert_eq!(
        model::error_policy(obj, &err, ctx),
        Action::requeue(Duration::from_secs(5))
    );
}

#[tokio::test]
async fn an_apply_the_apiserver_refuses_is_reported_as_degraded_and_retried_late() {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(Step::apply(path("v1", &ns, "configmaps", &name)));
    steps.push(Step::fail(
        Method::PATCH,
        path("apps/v1", &ns, "deployments", &name),
        422,
    ));
    steps.push(status_patch(&m));
    steps.push(Step::event(&ns));
    let server = server.run(steps);
    let obj = Arc::new(DeserializeGuard(Ok(m)));
    let err = model::reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("422 fails the reconcile");
    let recorded = finish(server).await;
    assert_eq!(err.metric_label(), "apply_refused");
    let degraded = condition(&status_body(&recorded), "Degraded").clone();
    assert_eq!(
        (degraded["status"].as_str(), degraded["reason"].as_str()),
        (Some("True"), Some("ApplyFailed"))
    );
    assert_eq!(
        model::error_policy(obj, &err, ctx),
        Action::requeue(Duration::from_secs(300))
    );
}

#[tokio::test]
async fn an_object_of_the_same_name_owned_by_someone_else_is_never_overwritten() {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let users_cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns}, "data": {"mine": "yes"}});
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, Some(users_cm), None, None, None);
    steps.push(status_patch(&m));
    steps.push(Step::event(&ns));
    let server = server.run(steps);
    let err = run(m, ctx).await.expect_err("not owned");
    let recorded = finish(server).await;
    assert_eq!(err.metric_label(), "apply_not_owned");
    assert!(
        recorded
            .iter()
            .all(|r| !r.path.ends_with("/configmaps/gemma-3-270m") || r.method == Method::GET)
    );
    let degraded = condition(&status_body(&recorded), "Degraded").clone();
    assert!(degraded["message"].as_str().is_some_and(|s| {
        s.contains("ConfigMap gemma-3-270m exists and is not controlled by this Model")
    }));
}

#[tokio::test]
async fn an_invalid_model_patches_invalid_spec_and_waits_for_a_change() {
    let mut m = fixture_model("cpu");
    m.spec.source.uri = "ftp://example.com/x.gguf".into();
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(status_patch(&m));
    steps.push(Step::event("default"));
    let server = server.run(steps);
    let action = run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(action, Action::await_change());
    let ready = condition(&status_body(&recorded), "Ready").clone();
    assert_eq!(ready["reason"], "InvalidSpec");
    assert!(
        ready["message"]
            .as_str()
            .is_some_and(|s| s.contains("spec.source.uri"))
    );
}

#[tokio::test]
async fn a_malformed_object_gets_a_warning_event_and_does_not_block_the_controller() {
    let (ctx, server) = context(fixture_plugins(), BTreeMap::new());
    let server = server.run(vec![Step::event("default")]);
    let invalid = InvalidObject {
        error: "spec.format: unknown variant `onnx`".into(),
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("broken".into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
    };
    let action = model::reconcile(Arc::new(DeserializeGuard(Err(invalid))), ctx)
        .await
        .expect("reconcile");
    assert_eq!(action, Action::await_change());
    let recorded = finish(server).await;
    let event = recorded[0].body.clone().expect("event");
    assert_eq!(
        (event["type"].as_str(), event["reason"].as_str()),
        (Some("Warning"), Some("Malformed"))
    );
    assert_eq!(event["regarding"]["name"], "broken");
}
