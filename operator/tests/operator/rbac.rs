//! The RBAC hook of the mock API server (outside the reconcile path): how requests map to
//! RBAC attributes, and that a request the table does not grant fails the scenario.

use std::time::Duration;

use gantry_operator::rbac::{RULES, Scope};
use http::{Method, Request, Response};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::client::Body;

use crate::support::{ApiServer, Step, access};

#[test]
fn requests_map_to_group_resource_and_verb() {
    let a = access(
        &Method::GET,
        "/api/v1/namespaces/ns/configmaps/m",
        "",
        false,
    );
    assert_eq!(
        (a.group.as_str(), a.resource.as_str(), a.verbs.clone()),
        ("", "configmaps", vec!["get"])
    );
    assert_eq!(a.namespace.as_deref(), Some("ns"));
    let a = access(
        &Method::GET,
        "/api/v1/namespaces/ns/pods",
        "labelSelector=x",
        false,
    );
    assert_eq!(a.verbs, vec!["list"]);
    let a = access(
        &Method::GET,
        "/apis/gantry.dev/v1alpha1/models",
        "watch=true&timeoutSeconds=290",
        false,
    );
    assert_eq!(
        (a.group.as_str(), a.verbs.clone(), a.namespace),
        ("gantry.dev", vec!["watch"], None)
    );
    let a = access(
        &Method::PATCH,
        "/apis/gantry.dev/v1alpha1/namespaces/ns/models/m/status",
        "fieldManager=gantry-operator&force=true",
        true,
    );
    assert_eq!(a.resource, "models/status");
    assert_eq!(a.verbs, vec!["patch"]);
    let a = access(
        &Method::PATCH,
        "/apis/apps/v1/namespaces/ns/deployments/m",
        "fieldManager=gantry-operator&force=true",
        true,
    );
    assert_eq!(a.verbs, vec!["patch", "create"]);
    let a = access(
        &Method::PUT,
        "/apis/coordination.k8s.io/v1/namespaces/gantry-system/leases/l",
        "",
        false,
    );
    assert_eq!(a.verbs, vec!["update"]);
    let a = access(
        &Method::DELETE,
        "/apis/apps/v1/namespaces/ns/deployments",
        "",
        false,
    );
    assert_eq!(a.verbs, vec!["deletecollection"]);
}

#[test]
fn the_table_has_no_duplicate_rows() {
    for (i, a) in RULES.iter().enumerate() {
        for b in &RULES[i + 1..] {
            assert!(
                !(a.component == b.component
                    && a.scope == b.scope
                    && a.group == b.group
                    && a.resource == b.resource
                    && a.names == b.names),
                "{a:?} and {b:?} should be one row"
            );
        }
    }
    assert!(RULES.iter().any(|r| r.scope == Scope::OperatorNamespace));
}

#[tokio::test]
async fn a_request_the_table_does_not_grant_fails_the_scenario() {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let server = ApiServer::new(handle).run(vec![Step::list(
        "/api/v1/namespaces/team-a/secrets",
        Vec::new(),
    )]);
    // The controller never lists Secrets (it reads only its own node-token Secrets, by name):
    // a list must be caught by the hook.
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        Api::<Secret>::namespaced(client, "team-a").list(&Default::default()),
    )
    .await;
    let err = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("mock server finished")
        .expect_err("the ungranted request must fail the scenario");
    let panic = err.into_panic();
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("does not grant"), "{message}");
    assert!(message.contains("secrets"), "{message}");
}
