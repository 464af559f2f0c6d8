//! Model and ModelPool reconcile with an install token and NetworkPolicies (build and apply
//! steps), against a mock API server: the node-token Secret and NetworkPolicy written before the
//! pods, the Secret read by name every reconcile (never cached) and written again only when gone.

use std::collections::BTreeMap;
use std::sync::Arc;

use gantry_crd::{Model, ModelPool};
use gantry_operator::context::{NodeNetworkPolicy, Settings};
use gantry_operator::model::{build, resolve::resolve, validate::validate};
use gantry_operator::pool;
use http::Method;
use k8s_openapi::api::core::v1::Secret;
use kube::core::DeserializeGuard;
use serde_json::{Value, json};

use crate::reconcile::{
    applies, example_model, example_plugins, node_report, ns_name, pods, reads, ready_deployment,
    run, running_pod, status_body, status_patch, supported,
};
use crate::support::{
    ApiServer, Recorded, Step, context_full, context_with, finish, fixture_model, fixture_plugins,
    path,
};

const INSTALL_TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// The operator as the chart runs it: an install token and per-Model NetworkPolicies.
fn secured_settings() -> Settings {
    Settings {
        node_token: Some(INSTALL_TOKEN.parse().expect("token")),
        network_policy: Some(NodeNetworkPolicy {
            peer_namespace: "gantry-system".into(),
            peer_labels: BTreeMap::from([
                ("app.kubernetes.io/name".into(), "gantry".into()),
                ("app.kubernetes.io/instance".into(), "gantry".into()),
            ]),
            metrics_namespace: Some("monitoring".into()),
            download_cidrs: Vec::new(),
        }),
        ..Settings::default()
    }
}

/// The node-token Secret's metadata GET: Secrets are never cached, so the apply step reads
/// the Model's one by name in every reconcile that builds it.
fn secret_get(m: &Model, secret: Option<Value>) -> Step {
    let (ns, name) = ns_name(m);
    Step::get(
        path("v1", &ns, "secrets", &format!("{name}-node-token")),
        secret,
    )
}

fn body_of<'a>(recorded: &'a [Recorded], method: Method, suffix: &str) -> &'a Value {
    recorded
        .iter()
        .find(|r| r.method == method && r.path.ends_with(suffix))
        .and_then(|r| r.body.as_ref())
        .unwrap_or_else(|| panic!("no {method} …{suffix}"))
}

#[tokio::test]
async fn with_an_install_token_and_policies_the_model_gets_its_token_secret_and_network_policy_before_its_pods()
 {
    let m = fixture_model("cpu");
    let (ns, name) = ns_name(&m);
    let (ctx, mut server) = context_with(secured_settings(), fixture_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.push(Step::apply(path("v1", &ns, "configmaps", &name)));
    steps.push(secret_get(&m, None));
    steps.push(Step::apply(path(
        "v1",
        &ns,
        "secrets",
        &format!("{name}-node-token"),
    )));
    steps.push(Step::apply(path(
        "networking.k8s.io/v1",
        &ns,
        "networkpolicies",
        &name,
    )));
    steps.extend(applies(&m).into_iter().skip(1));
    steps.push(status_patch(&m));
    let server = server.run(steps);
    run(m.clone(), ctx).await.expect("reconcile");
    let recorded = finish(server).await;

    // The Secret holds the Model's derived token, owned by the Model.
    let token = INSTALL_TOKEN
        .parse::<gantry_api::node_token::InstallToken>()
        .expect("token")
        .for_model(&ns, &name);
    let secret: Secret = serde_json::from_value(
        body_of(&recorded, Method::PATCH, "/secrets/gemma-3-270m-node-token").clone(),
    )
    .expect("a Secret");
    let data = secret.data.expect("data");
    assert_eq!(data["token"].0, token.as_str().as_bytes());
    assert_eq!(data.len(), 1);
    let owner = &secret.metadata.owner_references.expect("owned")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("Model", Some(true))
    );

    // The node container reads it by reference; the token is nowhere in the Deployment.
    let deploy = body_of(&recorded, Method::PATCH, "/deployments/gemma-3-270m");
    let env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env");
    let token_env: Vec<&Value> = env
        .iter()
        .filter(|e| e["name"] == "GANTRY_NODE_TOKEN")
        .collect();
    assert_eq!(
        token_env,
        [
            &json!({"name": "GANTRY_NODE_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "gemma-3-270m-node-token", "key": "token", "optional": false}}})
        ]
    );
    assert!(!deploy.to_string().contains(token.as_str()));
    let hash = &deploy["spec"]["template"]["metadata"]["annotations"]["gantry.dev/node-token-hash"];
    assert!(hash.as_str().is_some_and(|h| !h.is_empty()), "{hash}");

    // Ingress to the node port only from the operator's pods and Prometheus; egress DNS + 443.
    let policy = body_of(&recorded, Method::PATCH, "/networkpolicies/gemma-3-270m");
    assert_eq!(
        policy["spec"],
        json!({
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gantry-node",
                                            "gantry.dev/model": "gemma-3-270m"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gantry-system"}},
                           "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "gantry",
                                                           "app.kubernetes.io/name": "gantry"}}}],
                 "ports": [{"port": 8080, "protocol": "TCP"}]},
                {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                 "ports": [{"port": 8080, "protocol": "TCP"}]},
            ],
            "egress": [
                {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
                {"ports": [{"port": 443, "protocol": "TCP"}]},
            ],
        })
    );
    assert_eq!(
        policy["metadata"]["ownerReferences"][0]["uid"],
        "3f1c2b4a-0000-4000-8000-000000000001"
    );
}

/// The example Model built with `secured_settings`, and a context and mock server whose caches
/// hold its objects as a previous reconcile left them: the Deployment current with all its
/// pods ready, the NetworkPolicy current, a node pod running. Only the Secret is not there:
/// Secrets are never cached.
fn settled_secured_model() -> (
    Model,
    build::OwnedObjects,
    Arc<gantry_operator::context::Context>,
    ApiServer,
) {
    let m = example_model();
    let plugins = example_plugins();
    let settings = secured_settings();
    let v = validate(&m, &settings).expect("valid");
    let o = build::build(
        &v,
        &resolve(&v, Some("gemma3"), &plugins, 1).mounted(),
        &settings,
    )
    .expect("build");
    let (ctx, mut server) = context_with(
        settings,
        plugins,
        node_report("gemma-3-270m", "gemma3", supported()),
    );
    reads(
        &mut server,
        Some(serde_json::to_value(&o.config_map).expect("json")),
        Some(ready_deployment(&o)),
        Some(serde_json::to_value(&o.service).expect("json")),
        None,
    );
    server.seed([serde_json::to_value(&o.network_policy).expect("json")]);
    pods(&mut server, vec![running_pod(&m, &o)]);
    (m, o, ctx, server)
}

/// The path of the example Model's node-token Secret.
const EXAMPLE_SECRET: &str = "/api/v1/namespaces/default/secrets/gemma-3-270m-node-token";

#[tokio::test]
async fn an_unchanged_token_secret_and_network_policy_are_not_rewritten() {
    let (m, o, ctx, server) = settled_secured_model();
    // The Deployment is current with all its pods ready and the cached NetworkPolicy is
    // current; the Secret is read by name (Secrets are never cached) and found current.
    let secret = o.node_token_secret.as_ref().expect("a token Secret");
    let live = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                      "metadata": secret.metadata});
    let mut steps = vec![secret_get(&m, Some(live))];
    steps.push(status_patch(&m));
    steps.extend([
        Step::event("default"),
        Step::event("default"),
        Step::event("default"),
    ]);
    let server = server.run(steps);
    run(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let writes: Vec<&str> = recorded
        .iter()
        .filter(|r| r.method == Method::PATCH)
        .map(|r| r.path.as_str())
        .collect();
    assert_eq!(
        writes,
        ["/apis/gantry.dev/v1alpha1/namespaces/default/models/gemma-3-270m/status"]
    );
    let reads: Vec<(&Method, &str, &str)> = recorded
        .iter()
        .filter(|r| r.method == Method::GET)
        .map(|r| (&r.method, r.path.as_str(), r.query.as_str()))
        .collect();
    assert_eq!(
        reads,
        [(&Method::GET, EXAMPLE_SECRET, "")],
        "one GET, by name"
    );
}

#[tokio::test]
async fn a_token_secret_deleted_by_hand_comes_back_at_the_next_reconcile_of_a_settled_model() {
    let (m, o, ctx, server) = settled_secured_model();
    // Everything else is current and ready; the Secret GET answers 404. Then it is deleted
    // again right after: the GET is the apiserver's answer, not a cache that lags the write
    // of moments ago, so it comes back again (the status, written moments ago, is not).
    let steps = vec![
        secret_get(&m, None),
        Step::apply(EXAMPLE_SECRET),
        status_patch(&m),
        Step::event("default"),
        Step::event("default"),
        Step::event("default"),
        secret_get(&m, None),
        Step::apply(EXAMPLE_SECRET),
    ];
    let server = server.run(steps);
    run(m.clone(), ctx.clone()).await.expect("reconcile");
    run(m, ctx).await.expect("reconcile again");
    let recorded = finish(server).await;
    // The apply is exactly the built Secret, under the operator's field manager, forced.
    let apply = &recorded[1];
    assert_eq!(apply.content_type, "application/apply-patch+yaml");
    assert!(
        apply.query.contains("fieldManager=gantry-operator") && apply.query.contains("force=true"),
        "{}",
        apply.query
    );
    assert_eq!(
        apply.body.as_ref(),
        Some(
            &serde_json::to_value(o.node_token_secret.as_ref().expect("a token Secret"))
                .expect("json")
        )
    );
    // Nothing else is written: the Deployment keeps running with the same token.
    let writes: Vec<&str> = recorded
        .iter()
        .filter(|r| r.method == Method::PATCH)
        .map(|r| r.path.as_str())
        .collect();
    assert_eq!(
        writes,
        [
            EXAMPLE_SECRET,
            "/apis/gantry.dev/v1alpha1/namespaces/default/models/gemma-3-270m/status",
            EXAMPLE_SECRET,
        ]
    );
}

#[tokio::test]
async fn a_pools_token_secret_is_read_every_reconcile_and_comes_back_when_deleted_by_hand() {
    use crate::deliver::{delivery_pool, pool_built, pool_status_patch, settled_pool_objects};
    let (mut pool, members) = delivery_pool();
    let settings = secured_settings();
    let plugins = example_plugins();
    let live = pool_built(&pool, &members, &plugins, &settings);
    let secret = live.node_token_secret.clone().expect("a pool token Secret");
    let secret_path = "/api/v1/namespaces/default/secrets/small-pool-node-token";
    // The pool's objects current, its Deployment's pods ready; the Secret is never cached.
    let start = |pool: &ModelPool| {
        let (ctx, mut server) = context_full(
            settings.clone(),
            plugins.clone(),
            BTreeMap::new(),
            members.clone(),
            vec![pool.clone()],
        );
        server.seed(settled_pool_objects(&live));
        server.seed([serde_json::to_value(&live.network_policy).expect("json")]);
        (ctx, server)
    };
    let run_pool =
        |pool: &ModelPool, ctx| pool::reconcile(Arc::new(DeserializeGuard(Ok(pool.clone()))), ctx);

    // Deleted by hand: the GET answers 404 and the Secret is applied again, nothing else.
    let (ctx, server) = start(&pool);
    let server = server.run(vec![
        Step::get(secret_path, None),
        Step::apply(secret_path),
        pool_status_patch(&pool),
    ]);
    run_pool(&pool, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(
        recorded[1].body,
        Some(serde_json::to_value(&secret).expect("json"))
    );
    pool.status = Some(serde_json::from_value(status_body(&recorded)).expect("status"));

    // There and current: the one GET, no write.
    let (ctx, server) = start(&pool);
    let found = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                       "metadata": secret.metadata});
    let server = server.run(vec![Step::get(secret_path, Some(found))]);
    run_pool(&pool, ctx.clone()).await.expect("reconcile");
    finish(server).await;
    assert_eq!(ctx.metrics.total_writes(), 0);
}
