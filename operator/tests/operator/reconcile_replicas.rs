//! Model reconcile, the node Deployment's replica count (apply step), against a mock API server:
//! created at `replicas.min` and handed to the autoscaler's field manager, the HPA deleted when
//! the mode goes back to built-in, and Ready kept while a scale-up's new pods start.

use std::collections::BTreeMap;

use http::Method;
use serde_json::json;

use crate::reconcile::{
    applies, desired, example_model, example_plugins, node_report, ns_name, pods, reads,
    ready_deployment, run, running_pod, status_body, status_patch, supported,
};
use crate::support::{
    Recorded, Step, condition, context, finish, fixture_model, fixture_plugins, path,
};

#[tokio::test]
async fn creating_the_deployment_sets_min_replicas_and_hands_the_field_to_the_autoscaler() {
    let mut m = fixture_model("cpu");
    m.spec.replicas = Some(gantry_crd::Replicas { min: 2, max: 6 });
    let (ctx, mut server) = context(fixture_plugins(), BTreeMap::new());
    let (ns, name) = ns_name(&m);
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(Step::apply(path(
        "policy/v1",
        &ns,
        "poddisruptionbudgets",
        &name,
    )));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let deployment_writes: Vec<&Recorded> = recorded
        .iter()
        .filter(|r| r.path.ends_with(&format!("/deployments/{name}")) && r.method == Method::PATCH)
        .collect();
    assert_eq!(deployment_writes.len(), 2);
    assert!(
        deployment_writes[0]
            .query
            .contains("fieldManager=gantry-operator")
    );
    assert_eq!(
        deployment_writes[0].body.as_ref().expect("body")["spec"]["replicas"],
        2,
        "created at replicas.min"
    );
    assert!(
        deployment_writes[1]
            .query
            .contains("fieldManager=gantry-autoscaler")
    );
    assert_eq!(
        deployment_writes[1].body,
        Some(json!({"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": name}, "spec": {"replicas": 2}}))
    );
}

#[tokio::test]
async fn a_deployment_whose_replicas_only_the_operator_owns_is_handed_over_before_a_reapply() {
    // A Deployment an older operator created: gantry-operator alone owns spec.replicas, which
    // something else has since set to 4. The re-apply (new plugins) leaves replicas out, which
    // would drop the field; the autoscaler must own it first, at the live count.
    let m = fixture_model("cpu");
    let plugins = fixture_plugins();
    let o = desired(&m, &plugins, None);
    let mut live = ready_deployment(&o);
    live["spec"]["replicas"] = json!(4);
    live["metadata"]["managedFields"] = json!([{
        "manager": "gantry-operator", "operation": "Apply", "apiVersion": "apps/v1",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}}
    }]);
    let (ctx, mut server) = context(plugins, node_report("gemma-3-270m", "gemma3", supported()));
    let (ns, name) = ns_name(&m);
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(live),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    pods(&mut server, vec![running_pod(&m, &o)]);
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)).by("gantry-autoscaler"));
    steps.push(Step::apply(path("apps/v1", &ns, "deployments", &name)));
    steps.push(status_patch(&m));
    steps.extend([Step::event(&ns), Step::event(&ns)]);
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let writes: Vec<&Recorded> = recorded
        .iter()
        .filter(|r| r.path.ends_with(&format!("/deployments/{name}")) && r.method == Method::PATCH)
        .collect();
    assert_eq!(
        writes[0].body.as_ref().expect("body")["spec"],
        json!({"replicas": 4}),
        "handed over at the live count"
    );
    assert!(
        writes[1].body.as_ref().expect("body")["spec"]
            .get("replicas")
            .is_none()
    );
}

#[tokio::test]
async fn switching_from_hpa_back_to_builtin_deletes_the_hpa() {
    let m = fixture_model("cpu");
    let plugins = fixture_plugins();
    let o = desired(&m, &plugins, None);
    let (ns, name) = ns_name(&m);
    let mut hpa_model = m.clone();
    hpa_model.spec.autoscaling = Some(gantry_crd::Autoscaling {
        mode: gantry_crd::AutoscalingMode::Hpa,
        ..Default::default()
    });
    let old_hpa = desired(&hpa_model, &plugins, None).hpa.expect("hpa");
    let (ctx, mut server) = context(plugins, BTreeMap::new());
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(ready_deployment(&o)),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    server.seed([serde_json::to_value(&old_hpa).expect("json")]);
    pods(&mut server, Vec::new());
    steps.push(Step::delete(path(
        "autoscaling/v2",
        &ns,
        "horizontalpodautoscalers",
        &name,
    )));
    steps.push(status_patch(&m));
    steps.push(Step::event(&ns));
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert!(
        recorded
            .iter()
            .any(|r| r.method == Method::DELETE && r.path.contains("horizontalpodautoscalers"))
    );
}

#[tokio::test]
async fn a_model_scaling_up_stays_ready_while_the_new_pods_start() {
    let m = example_model();
    let plugins = example_plugins();
    let o = desired(&m, &plugins, Some("gemma3"));
    // The autoscaler asked for 3; one pod serves, two are starting.
    let mut deploy = ready_deployment(&o);
    deploy["spec"]["replicas"] = json!(3);
    deploy["status"] = json!({"observedGeneration": 1, "replicas": 3, "updatedReplicas": 3,
                              "readyReplicas": 1, "availableReplicas": 1});
    let (ctx, mut server) = context(plugins, node_report("gemma-3-270m", "gemma3", supported()));
    let mut steps = reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(deploy),
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
    run(m, ctx).await.expect("reconcile");
    let status = status_body(&finish(server).await);
    let ready = condition(&status, "Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["message"].as_str()),
        (Some("True"), Some("1/3 node pods ready"))
    );
    assert_eq!(condition(&status, "Progressing")["reason"], "RollingOut");
    assert_eq!(
        status["replicas"],
        json!({"desired": 3, "current": 3, "ready": 1})
    );
}
