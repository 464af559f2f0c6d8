//! Leader election: the decision from the Lease as read, and the exact Lease requests.

use gantry_operator::leader::{LeaderElector, LeaseConfig, Step as LeaseStep, decide};
use http::{Method, Request, Response};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::client::Body;
use serde_json::json;

use crate::support::{ApiServer, Step, finish, t0};

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/gantry-system/leases/gantry-operator";

fn config(identity: &str) -> LeaseConfig {
    LeaseConfig::new(
        "gantry-system".into(),
        "gantry-operator".into(),
        identity.into(),
    )
}

fn held_by(holder: &str) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some("gantry-operator".into()),
            namespace: Some("gantry-system".into()),
            resource_version: Some("42".into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(t0())),
            lease_transitions: Some(3),
            ..LeaseSpec::default()
        }),
    }
}

#[test]
fn a_missing_lease_is_created_naming_us() {
    match decide(&config("me"), None, false, t0()) {
        LeaseStep::Create(l) => assert_eq!(
            l.spec.and_then(|s| s.holder_identity).as_deref(),
            Some("me")
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn our_lease_is_renewed_under_its_resource_version() {
    match decide(&config("me"), Some(&held_by("me")), false, t0()) {
        LeaseStep::Renew(l) => {
            assert_eq!(l.metadata.resource_version.as_deref(), Some("42"));
            assert_eq!(l.spec.and_then(|s| s.lease_transitions), Some(3));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_live_lease_held_by_another_is_followed_and_an_expired_one_taken_over() {
    assert_eq!(
        decide(&config("me"), Some(&held_by("other")), false, t0()),
        LeaseStep::Follow {
            holder: "other".into()
        }
    );
    match decide(&config("me"), Some(&held_by("other")), true, t0()) {
        LeaseStep::TakeOver(l) => {
            let spec = l.spec.expect("spec");
            assert_eq!(spec.holder_identity.as_deref(), Some("me"));
            assert_eq!(spec.lease_transitions, Some(4));
            assert_eq!(l.metadata.resource_version.as_deref(), Some("42"));
        }
        other => panic!("{other:?}"),
    }
}

fn elector(identity: &str) -> (LeaderElector, ApiServer) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    (
        LeaderElector::new(client, config(identity)),
        ApiServer::new(handle),
    )
}

#[tokio::test]
async fn acquiring_a_missing_lease_creates_it() {
    let (mut e, server) = elector("me");
    let server = server.run(vec![
        Step::not_found(Method::GET, LEASE),
        Step::create("/apis/coordination.k8s.io/v1/namespaces/gantry-system/leases"),
    ]);
    assert!(e.try_acquire_or_renew().await.expect("acquire"));
    let recorded = finish(server).await;
    assert_eq!(
        recorded[1].body.as_ref().expect("lease")["spec"]["holderIdentity"],
        "me"
    );
}

#[tokio::test]
async fn a_lease_held_by_another_is_not_written() {
    let (mut e, server) = elector("me");
    let server = server.run(vec![Step::get(
        LEASE,
        Some(serde_json::to_value(held_by("other")).expect("json")),
    )]);
    assert!(!e.try_acquire_or_renew().await.expect("follow"));
    finish(server).await;
}

#[tokio::test]
async fn losing_a_renewal_race_is_a_conflict_not_an_error() {
    let (mut e, server) = elector("me");
    let server = server.run(vec![
        Step::get(
            LEASE,
            Some(serde_json::to_value(held_by("me")).expect("json")),
        ),
        Step::fail(Method::PUT, LEASE, 409),
    ]);
    assert!(
        !e.try_acquire_or_renew()
            .await
            .expect("conflict is not an error")
    );
    finish(server).await;
}

#[tokio::test]
async fn renewing_replaces_the_lease_with_its_resource_version() {
    let (mut e, server) = elector("me");
    let server = server.run(vec![
        Step::get(
            LEASE,
            Some(serde_json::to_value(held_by("me")).expect("json")),
        ),
        Step::replace(LEASE),
    ]);
    assert!(e.try_acquire_or_renew().await.expect("renew"));
    let recorded = finish(server).await;
    let body = recorded[1].body.clone().expect("body");
    assert_eq!(body["metadata"]["resourceVersion"], "42");
    assert_eq!(body["spec"]["holderIdentity"], json!("me"));
}
