//! A Model's LoRA adapters through the reconcile, against a mock API server: rendered into the
//! node config (and their claims into the pod), folded from the node pods' reports into
//! `status.adapters`, and refused by validation as `InvalidSpec` conditions naming the field.

use std::collections::BTreeMap;

use gantry_api::config::AdapterConfig;
use gantry_api::{AdapterState, NodeStatus};
use gantry_crd::{Model, ModelStatus};
use gantry_operator::context::Settings;
use gantry_operator::model::validate::validate;
use http::Method;
use serde_json::{Value, json};

use crate::reconcile::{
    POD_IP, applies, desired, example_model, example_plugins, node_report, ns_name, pods, reads,
    ready_deployment, run, running_pod, status_body, status_patch, supported,
};
use crate::support::{ApiServer, Step, condition, context, finish, t0};

/// The docs example with two adapters: one from Hugging Face at half strength, one on a claim
/// under its own id.
fn with_two_adapters() -> Model {
    let mut m = example_model();
    m.spec.adapters = serde_json::from_value(json!([
        {"name": "pirate", "source": {"uri": "hf://org/gemma-pirate-lora"}, "scale": 0.5},
        {"name": "legal", "source": {"uri": "pvc://loras/legal/adapter.gguf"},
         "servedName": "legal-bot"},
    ]))
    .expect("adapters");
    m
}

#[tokio::test]
async fn a_model_with_two_adapters_renders_them_into_the_config_maps_node_config() {
    let m = with_two_adapters();
    let (ctx, mut server) = context(example_plugins(), BTreeMap::new());
    let mut steps = reads(&mut server, None, None, None, None);
    steps.extend(applies(&m));
    steps.push(status_patch(&m));
    // The example states its architecture: EngineResolved turns True at once.
    steps.push(Step::event(&ns_name(&m).0));
    let server = server.run(steps);
    run(m.clone(), ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let applied = |suffix: &str| {
        recorded
            .iter()
            .find(|r| r.method == Method::PATCH && r.path.ends_with(suffix))
            .and_then(|r| r.body.clone())
            .unwrap_or_else(|| panic!("no apply of {suffix}"))
    };
    let config = applied("/configmaps/gemma-3-270m")["data"]["models.yaml"]
        .as_str()
        .expect("node config")
        .to_string();
    // The entries exactly as the node reads them: the claim as its mount, no credential.
    let expected = "\
  adapters:
  - name: pirate
    source: hf://org/gemma-pirate-lora
    scale: 0.5
  - name: legal
    source: file:///models/loras/legal/adapter.gguf
    servedName: legal-bot
";
    assert!(
        config.contains(expected),
        "node config lacks the adapters as expected:\n{config}"
    );
    let node: gantry_api::NodeConfig = serde_yaml::from_str(&config).expect("node config");
    node.validate().expect("the node accepts the config");
    assert_eq!(
        node.models[0].adapters,
        [
            AdapterConfig {
                name: "pirate".into(),
                source: Some("hf://org/gemma-pirate-lora".into()),
                scale: Some(0.5),
                ..AdapterConfig::default()
            },
            AdapterConfig {
                name: "legal".into(),
                source: Some("file:///models/loras/legal/adapter.gguf".into()),
                served_name: Some("legal-bot".into()),
                ..AdapterConfig::default()
            },
        ]
    );
    assert_eq!(
        node.models[0]
            .adapters
            .iter()
            .map(|a| a.model_id(&node.models[0].id))
            .collect::<Vec<_>>(),
        ["gemma-3-270m:pirate", "legal-bot"]
    );
    // The adapter's claim is mounted read-only where its node URI points.
    let pod = &applied("/deployments/gemma-3-270m")["spec"]["template"]["spec"];
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["persistentVolumeClaim"]["claimName"] == "loras")
        .expect("the adapter's claim");
    assert_eq!(volume["persistentVolumeClaim"]["readOnly"], true);
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|v| v["name"] == volume["name"])
        .expect("mounted");
    assert_eq!(
        (mount["mountPath"].as_str(), mount["readOnly"].as_bool()),
        (Some("/models/loras"), Some(true))
    );
}

/// One adapter in a node's report: name, id, state, reason, message.
type Reported<'a> = (
    &'a str,
    &'a str,
    AdapterState,
    Option<&'a str>,
    Option<&'a str>,
);

/// A node report of the model loaded, with these adapters.
fn report_with(adapters: &[Reported<'_>]) -> NodeStatus {
    let mut status = node_report("gemma-3-270m", "gemma3", supported())
        .remove(POD_IP)
        .expect("report");
    status.models[0].adapters = adapters
        .iter()
        .map(
            |(name, id, state, reason, message)| gantry_api::AdapterStatus {
                name: name.to_string(),
                id: id.to_string(),
                state: *state,
                reason: reason.map(str::to_string),
                message: message.map(str::to_string),
                bytes: None,
            },
        )
        .collect();
    status
}

const SECOND_POD_IP: &str = "10.0.0.6";

/// Pass 1 writes `status.adapters` from two pods' reports; pass 2 (that status stored) writes
/// nothing.
#[tokio::test]
async fn adapter_status_is_folded_from_the_pods_reports_and_written_once() {
    let mut m = with_two_adapters();
    let plugins = example_plugins();
    let o = desired(&m, &plugins, Some("gemma3"));
    let mismatch = "adapter rank 16 was trained for gemma-2b, not gemma3";
    // Pod one: pirate loaded, legal refused by the engine. Pod two: pirate's files only,
    // legal loaded.
    let reports = BTreeMap::from([
        (
            POD_IP.to_string(),
            report_with(&[
                (
                    "pirate",
                    "gemma-3-270m:pirate",
                    AdapterState::Loaded,
                    None,
                    None,
                ),
                (
                    "legal",
                    "legal-bot",
                    AdapterState::Refused,
                    Some("mismatch"),
                    Some(mismatch),
                ),
            ]),
        ),
        (
            SECOND_POD_IP.to_string(),
            report_with(&[
                (
                    "pirate",
                    "gemma-3-270m:pirate",
                    AdapterState::Downloaded,
                    None,
                    None,
                ),
                ("legal", "legal-bot", AdapterState::Loaded, None, None),
            ]),
        ),
    ]);
    let live = |server: &mut ApiServer, m: &Model| {
        let mut second = running_pod(m, &o);
        second["metadata"]["name"] = json!("gemma-3-270m-7c9d-fghij");
        second["metadata"]["uid"] = json!("gemma-3-270m-pod-uid-2");
        second["status"]["podIP"] = json!(SECOND_POD_IP);
        pods(server, vec![running_pod(m, &o), second]);
        reads(
            server,
            Some(serde_json::to_value(&o.config_map).expect("json")),
            Some(ready_deployment(&o)),
            Some(serde_json::to_value(&o.service).expect("json")),
            None,
        )
    };

    let (ctx, mut server) = context(plugins.clone(), reports.clone());
    let mut steps = live(&mut server, &m);
    steps.push(status_patch(&m));
    // Ready, EngineResolved and ArtifactReady turn True: one Normal event each.
    let (ns, _) = ns_name(&m);
    steps.extend([Step::event(&ns), Step::event(&ns), Step::event(&ns)]);
    let server = server.run(steps);
    run(m.clone(), ctx).await.expect("pass 1");
    let recorded = finish(server).await;
    let status = status_body(&recorded);
    assert_eq!(
        status["adapters"],
        json!([
            {"name": "pirate", "id": "gemma-3-270m:pirate", "state": "Loaded",
             "loadedReplicas": 1, "readyReplicas": 2},
            {"name": "legal", "id": "legal-bot", "state": "Refused", "reason": "mismatch",
             "message": format!("node pod default/gemma-3-270m-7c9d-abcde: {mismatch}"),
             "loadedReplicas": 1, "readyReplicas": 2},
        ])
    );
    // The base model serves: an adapter's refusal leaves the Model's conditions alone.
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(condition(&status, "Degraded")["status"], "False");

    m.status = Some(serde_json::from_value::<ModelStatus>(status).expect("status"));
    let (ctx, mut server) = context(plugins, reports);
    let steps = live(&mut server, &m);
    let server = server.run(steps);
    run(m, ctx.clone()).await.expect("pass 2");
    let recorded = finish(server).await;
    assert!(recorded.is_empty(), "{recorded:#?}");
    assert_eq!(ctx.metrics.total_writes(), 0);
}

#[tokio::test]
async fn duplicate_adapter_names_and_a_scale_out_of_range_are_invalid_spec_conditions() {
    let mut m = with_two_adapters();
    m.spec.adapters[1].name = "pirate".into();
    m.spec.adapters[1].scale = Some(20.0);
    let (ctx, server) = context(example_plugins(), BTreeMap::new());
    let (ns, _) = ns_name(&m);
    // Only the status (and the Degraded event): nothing is applied for an invalid spec.
    let server = server.run(vec![status_patch(&m), Step::event(&ns)]);
    run(m.clone(), ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let status = status_body(&recorded);
    let message = "the spec cannot be served as written: spec.adapters[pirate].name: appears twice; spec.adapters[pirate].scale: must be within (0, 16], got 20";
    for type_ in ["Ready", "Degraded"] {
        let c = condition(&status, type_);
        assert_eq!(
            (
                c["status"].as_str(),
                c["reason"].as_str(),
                c["message"].as_str()
            ),
            (
                Some(if type_ == "Ready" { "False" } else { "True" }),
                Some("InvalidSpec"),
                Some(message)
            ),
            "{type_}"
        );
    }
}

/// (what is wrong, the adapters, the field refused, words of the reason)
const REFUSALS: [(&str, &str, &str, &str); 9] = [
    (
        "a scale of zero",
        r#"[{"name": "a", "source": {"uri": "hf://org/a"}, "scale": 0}]"#,
        "spec.adapters[a].scale",
        "must be within (0, 16], got 0",
    ),
    (
        "a name that is not a DNS label",
        r#"[{"name": "Pirate", "source": {"uri": "hf://org/a"}}]"#,
        "spec.adapters[Pirate].name",
        "is not a DNS label",
    ),
    (
        "an unknown scheme",
        r#"[{"name": "a", "source": {"uri": "ftp://host/a.gguf"}}]"#,
        "spec.adapters[a].source.uri",
        "the scheme must be",
    ),
    (
        "plain http in a cluster",
        r#"[{"name": "a", "source": {"uri": "http://host/a.gguf"}}]"#,
        "spec.adapters[a].source.uri",
        "must use https://",
    ),
    (
        "a quantization suffix",
        r#"[{"name": "a", "source": {"uri": "hf://org/a:Q4_K_M"}}]"#,
        "spec.adapters[a].source.uri",
        "drop the quantization suffix `:Q4_K_M`",
    ),
    (
        "a file entry climbing out",
        r#"[{"name": "a", "source": {"uri": "hf://org/a", "files": ["../x"]}}]"#,
        "spec.adapters[a].source.files",
        "without `..`",
    ),
    (
        "the Model's own served name",
        r#"[{"name": "a", "source": {"uri": "hf://org/a"}, "servedName": "gemma-3-270m"}]"#,
        "spec.adapters[a].servedName",
        "the Model's own served name",
    ),
    (
        "another adapter's id",
        r#"[{"name": "a", "source": {"uri": "hf://org/a"}},
            {"name": "b", "source": {"uri": "hf://org/b"}, "servedName": "gemma-3-270m:a"}]"#,
        "spec.adapters[b].servedName",
        "already the id of another adapter",
    ),
    (
        "a Secret of its own",
        r#"[{"name": "a", "source": {"uri": "s3://bucket/a", "secretRef": {"name": "s3-keys"}}}]"#,
        "spec.adapters[a].source.secretRef",
        "node pods hold one source credential",
    ),
];

#[test]
fn every_adapter_refusal_names_the_entry_and_its_field() {
    validate(&with_two_adapters(), &Settings::default()).expect("two adapters are valid");
    for (what, adapters, field, words) in REFUSALS {
        let mut m = example_model();
        m.spec.adapters = serde_json::from_str(adapters).expect(what);
        let problems = validate(&m, &Settings::default()).expect_err(what);
        assert!(
            problems
                .iter()
                .any(|p| p.field == field && p.message.contains(words)),
            "{what}: expected {field}: ...{words}..., got {problems:?}"
        );
        let status = gantry_operator::model::status::fold_invalid(&m, &problems, t0());
        let json: Value = serde_json::to_value(&status).expect("json");
        assert!(
            condition(&json, "Ready")["message"]
                .as_str()
                .is_some_and(|msg| msg.contains(field)),
            "{what}"
        );
    }
}

#[test]
fn an_adapter_may_name_the_base_models_secret_and_gets_its_credential_in_the_pod() {
    let mut m = example_model();
    m.spec.source.secret_ref = Some(gantry_crd::SecretKeyRef {
        name: "hub".into(),
        key: None,
    });
    m.spec.source.uri = "s3://weights/gemma".into();
    m.spec.source.quantization = None;
    m.spec.adapters = serde_json::from_value(json!([
        {"name": "a", "source": {"uri": "hf://org/a", "secretRef": {"name": "hub", "key": "token"}}},
    ]))
    .expect("adapters");
    let v = validate(&m, &Settings::default()).expect("the base's Secret is allowed");
    assert_eq!(v.adapters[0].id, "gemma-3-270m:a");
    let o = desired(&m, &example_plugins(), Some("gemma3"));
    let pod = serde_json::to_value(&o.deployment.spec.template.spec).expect("json");
    let env = pod["containers"][0]["env"].as_array().expect("env");
    // The base is on S3, the adapter on the Hub: the Hub's token variable comes too.
    for name in ["GANTRY_SOURCE_TOKEN", "HF_TOKEN"] {
        let var = env
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(
            var["valueFrom"]["secretKeyRef"],
            json!({"name": "hub", "key": "token", "optional": false})
        );
    }
    // A pool member cannot take one at all.
    m.spec.source.secret_ref = None;
    m.spec.pool = Some("small".into());
    m.spec.resources = None;
    m.spec.replicas = None;
    m.spec.cache = None;
    let problems = validate(&m, &Settings::default()).expect_err("pool member");
    assert!(
        problems
            .iter()
            .any(|p| p.field == "spec.adapters[a].source.secretRef"
                && p.message.contains("cannot join a pool")),
        "{problems:?}"
    );
}
