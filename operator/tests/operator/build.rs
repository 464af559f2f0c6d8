//! Build step, pure: every owned object for a representative set of Models, compared with
//! golden YAML, plus the invariants each object must keep.

use gantry_operator::context::{NodeNetworkPolicy, Settings};
use gantry_operator::model::build::{self, OwnedObjects};
use gantry_operator::model::resolve::{Resolution, resolve};
use gantry_operator::model::validate::{ValidModel, validate};
use k8s_openapi::api::core::v1::{Container, PodSpec};

use crate::support::{crate_dir, fixture_model, fixture_plugins};

const CASES: [&str; 7] = [
    "cpu",
    "gpu",
    "pvc-cache",
    "image-volume",
    "pinned",
    "hpa",
    "s3",
];

fn valid(case: &str) -> ValidModel {
    validate(&fixture_model(case), &Settings::default()).unwrap_or_else(|e| panic!("{case}: {e:?}"))
}

pub(crate) fn resolved(case: &str) -> (ValidModel, Resolution) {
    let v = valid(case);
    let r = resolve(
        &v,
        v.declared_architecture.as_deref(),
        &fixture_plugins(),
        1,
    );
    (v, r)
}

pub(crate) fn built(case: &str) -> OwnedObjects {
    built_with(case, &Settings::default())
}

/// The objects of an edited fixture Model, with the fixture plugins and default settings.
fn built_model(m: &gantry_crd::Model) -> OwnedObjects {
    let v = validate(m, &Settings::default()).expect("valid");
    let r = resolve(
        &v,
        v.declared_architecture.as_deref(),
        &fixture_plugins(),
        1,
    );
    build::build(&v, &r.mounted(), &Settings::default()).expect("build")
}

fn built_with(case: &str, settings: &Settings) -> OwnedObjects {
    let (v, r) = resolved(case);
    build::build(&v, &r.mounted(), settings).expect("build")
}

/// As the chart runs the operator: an install token and per-Model NetworkPolicies.
fn secured() -> Settings {
    Settings {
        node_token: Some("0123456789abcdef0123456789abcdef".parse().expect("token")),
        network_policy: Some(NodeNetworkPolicy {
            peer_namespace: "gantry-system".into(),
            peer_labels: [("app.kubernetes.io/name".to_string(), "gantry".to_string())].into(),
            metrics_namespace: None,
            download_cidrs: vec!["10.20.0.0/16".into()],
        }),
        ..Settings::default()
    }
}

/// All owned objects as one multi-document YAML stream, in apply order.
fn render(o: &OwnedObjects) -> String {
    let mut docs = vec![serde_yaml::to_string(&o.config_map).expect("yaml")];
    if let Some(secret) = &o.node_token_secret {
        docs.push(serde_yaml::to_string(secret).expect("yaml"));
    }
    if let Some(policy) = &o.network_policy {
        docs.push(serde_yaml::to_string(policy).expect("yaml"));
    }
    if let Some(pvc) = &o.pvc {
        docs.push(serde_yaml::to_string(pvc).expect("yaml"));
    }
    docs.push(serde_yaml::to_string(&o.deployment).expect("yaml"));
    docs.push(serde_yaml::to_string(&o.service).expect("yaml"));
    if let Some(pdb) = &o.pdb {
        docs.push(serde_yaml::to_string(pdb).expect("yaml"));
    }
    if let Some(hpa) = &o.hpa {
        docs.push(serde_yaml::to_string(hpa).expect("yaml"));
    }
    docs.join("---\n")
}

pub(crate) fn pod(o: &OwnedObjects) -> &PodSpec {
    o.deployment.spec.template.spec.as_ref().expect("pod spec")
}

pub(crate) fn node(o: &OwnedObjects) -> &Container {
    &pod(o).containers[0]
}

#[test]
fn owned_objects_match_the_golden_files() {
    let bless = std::env::var_os("GANTRY_BLESS").is_some();
    let mut stale = Vec::new();
    // Each fixture as built by default, and the GPU one as the chart runs the operator.
    let goldens = CASES
        .iter()
        .map(|case| (case.to_string(), built(case)))
        .chain([("gpu-secured".to_string(), built_with("gpu", &secured()))]);
    for (case, objects) in goldens {
        let path = crate_dir().join(format!("tests/golden/{case}.yaml"));
        let got = render(&objects);
        if bless {
            std::fs::write(&path, &got).expect("write golden");
            continue;
        }
        let want = std::fs::read_to_string(&path).unwrap_or_default();
        if want != got {
            stale.push(format!("{} (got:\n{got})", path.display()));
        }
    }
    assert!(
        stale.is_empty(),
        "golden files differ; review the change and regenerate with\n  GANTRY_BLESS=1 cargo test -p gantry-operator --test operator owned_objects\n{}",
        stale.join("\n")
    );
}

#[test]
fn building_twice_gives_identical_objects() {
    for case in CASES {
        assert_eq!(built(case), built(case), "{case}");
    }
}

#[test]
fn s3_model_gets_the_secret_as_aws_environment_and_no_token_in_the_config() {
    let o = built("s3");
    let c = node(&o);
    let from = c
        .env_from
        .as_ref()
        .expect("envFrom for an s3:// source with a Secret");
    assert_eq!(from.len(), 1);
    let secret = from[0].secret_ref.as_ref().expect("secretRef");
    assert_eq!(secret.name, "minio-credentials");
    assert_eq!(secret.optional, Some(false));
    let env = c.env.as_ref().expect("env");
    assert!(
        !env.iter().any(|e| e.name == "HF_TOKEN"),
        "no HF_TOKEN for s3://"
    );
    let config = &o.config_map.data.as_ref().expect("data")["models.yaml"];
    assert!(config.contains("s3://models/llama-3.2-1b"));
    assert!(
        !config.contains("minio-credentials"),
        "the Secret name stays out of the ConfigMap"
    );
    // An hf:// Model with a Secret gets the token only, never the whole Secret.
    assert!(node(&built("gpu")).env_from.is_none());
}

#[test]
fn gpu_model_requests_and_limits_the_gpu_and_copies_scheduling() {
    let o = built("gpu");
    let res = node(&o).resources.clone().expect("resources");
    let requests = res.requests.expect("requests");
    let limits = res.limits.expect("limits");
    assert_eq!(requests["nvidia.com/gpu"].0, "1");
    assert_eq!(limits["nvidia.com/gpu"].0, "1");
    assert_eq!(limits["memory"].0, "24Gi");
    assert!(
        !limits.contains_key("cpu"),
        "CPU is requested, never limited"
    );
    let p = pod(&o);
    assert_eq!(p.runtime_class_name.as_deref(), Some("nvidia"));
    assert_eq!(
        p.node_selector.as_ref().expect("selector")["nvidia.com/gpu.product"],
        "NVIDIA-L4"
    );
    assert_eq!(p.tolerations.as_ref().expect("tolerations").len(), 1);
    let init = p.init_containers.as_ref().expect("init containers");
    assert_eq!(init.len(), 1, "architecture known: exactly one plugin");
    assert!(init[0].image.as_deref().is_some_and(|i| i.contains("cuda")));
    let env = node(&o).env.clone().expect("env");
    assert!(
        env.iter().any(|e| e.name == "HF_TOKEN"),
        "hf:// token is passed as HF_TOKEN"
    );
    // The default rollout surges, GPU or not: a new pod is ready before the old one goes.
    assert_eq!(rolling(&o), (1, 0));
}

#[test]
fn a_model_on_several_gpus_asks_the_node_to_spread_over_all_of_them() {
    let config = |o: &OwnedObjects| -> gantry_api::NodeConfig {
        serde_yaml::from_str(&o.config_map.data.as_ref().expect("data")["models.yaml"])
            .expect("node config parses")
    };
    // One GPU: the node's default placement, nothing rendered (configs stay as they were).
    assert_eq!(config(&built("gpu")).models[0].gpus, None);
    let mut m = fixture_model("gpu");
    m.spec.resources.get_or_insert_default().gpus = Some(2);
    let o = built_model(&m);
    let limits = node(&o)
        .resources
        .clone()
        .and_then(|r| r.limits)
        .expect("limits");
    assert_eq!(limits["nvidia.com/gpu"].0, "2");
    let c = config(&o);
    assert_eq!(
        c.models[0].gpus,
        Some(2),
        "the pod's two GPUs hold the model"
    );
    assert!(c.models[0].devices.is_empty(), "the node picks them");
    c.validate().expect("the node accepts it");
}

/// The Deployment's (maxSurge, maxUnavailable).
fn rolling(o: &OwnedObjects) -> (i32, i32) {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let r = o
        .deployment
        .spec
        .strategy
        .clone()
        .and_then(|s| s.rolling_update)
        .expect("rolling");
    match (r.max_surge, r.max_unavailable) {
        (Some(IntOrString::Int(s)), Some(IntOrString::Int(u))) => (s, u),
        other => panic!("not integers: {other:?}"),
    }
}

#[test]
fn an_in_place_rollout_removes_a_pod_before_starting_its_replacement() {
    let mut m = fixture_model("gpu");
    m.spec.rollout = Some(gantry_crd::Rollout {
        strategy: gantry_crd::RolloutStrategy::InPlace,
        ..Default::default()
    });
    let o = built_model(&m);
    assert_eq!(rolling(&o), (0, 1));
}

#[test]
fn pvc_cache_model_gets_a_claim_and_a_disruption_budget() {
    let o = built("pvc-cache");
    let pvc = o.pvc.as_ref().expect("claim");
    assert_eq!(pvc.metadata.name.as_deref(), Some("llama-32-3b-cache"));
    let spec = pvc.spec.as_ref().expect("pvc spec");
    assert_eq!(spec.storage_class_name.as_deref(), Some("fast-rwx"));
    assert_eq!(
        spec.access_modes.as_deref(),
        Some(&["ReadWriteMany".to_string()][..])
    );
    let cache = pod(&o)
        .volumes
        .as_ref()
        .expect("volumes")
        .iter()
        .find(|v| v.name == "cache")
        .expect("cache volume");
    assert_eq!(
        cache
            .persistent_volume_claim
            .as_ref()
            .map(|c| c.claim_name.as_str()),
        Some("llama-32-3b-cache")
    );
    assert!(
        o.pdb.is_some(),
        "replicas.min = 2 needs a PodDisruptionBudget"
    );
    assert_eq!(o.initial_replicas, 2, "created at replicas.min");
    for (name, o) in [("cpu", built("cpu")), ("gpu", built("gpu"))] {
        assert!(
            o.pdb.is_none(),
            "{name}: replicas.min <= 1 has no PodDisruptionBudget"
        );
        assert!(o.pvc.is_none(), "{name}: emptyDir cache has no claim");
    }
}

#[test]
fn node_pods_run_restricted_with_probes_on_the_node_endpoints() {
    for case in CASES {
        let o = built(case);
        let p = pod(&o);
        let psc = p.security_context.as_ref().expect("pod security context");
        assert_eq!(psc.run_as_non_root, Some(true), "{case}");
        assert_eq!(
            psc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
            Some("RuntimeDefault"),
            "{case}"
        );
        assert_eq!(p.automount_service_account_token, Some(false), "{case}");
        for c in p
            .containers
            .iter()
            .chain(p.init_containers.iter().flatten())
        {
            let sc = c
                .security_context
                .as_ref()
                .expect("container security context");
            assert_eq!(sc.run_as_non_root, Some(true), "{case}/{}", c.name);
            assert_eq!(
                sc.read_only_root_filesystem,
                Some(true),
                "{case}/{}",
                c.name
            );
            assert_eq!(
                sc.allow_privilege_escalation,
                Some(false),
                "{case}/{}",
                c.name
            );
            assert_eq!(
                sc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
                Some("RuntimeDefault")
            );
            assert_eq!(
                sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
                Some(vec!["ALL".to_string()]),
                "{case}/{}",
                c.name
            );
        }
        let n = node(&o);
        let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
            p.as_ref()
                .and_then(|p| p.http_get.as_ref())
                .and_then(|h| h.path.clone())
        };
        assert_eq!(
            probe_path(&n.startup_probe).as_deref(),
            Some("/readyz"),
            "{case}"
        );
        assert_eq!(
            probe_path(&n.readiness_probe).as_deref(),
            Some("/readyz"),
            "{case}"
        );
        assert_eq!(
            probe_path(&n.liveness_probe).as_deref(),
            Some("/healthz"),
            "{case}"
        );
        let port = &n.ports.as_ref().expect("ports")[0];
        assert_eq!(
            (port.name.as_deref(), port.container_port),
            (Some("http"), 8080),
            "{case}"
        );
        assert_eq!(
            n.args.as_ref().expect("args")[..],
            [
                "serve",
                "--config",
                "/etc/gantry/models.yaml",
                "--plugins-dir",
                "/opt/gantry/engines",
                "--listen",
                "0.0.0.0:8080"
            ],
        );
        // Every owned object names its Model as controlling owner, so deletion cascades.
        for meta in [
            &o.config_map.metadata,
            &o.deployment.metadata,
            &o.service.metadata,
        ] {
            let owner = &meta.owner_references.as_ref().expect("owner")[0];
            assert_eq!(
                (owner.kind.as_str(), owner.controller),
                ("Model", Some(true)),
                "{case}"
            );
            assert!(
                meta.annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key("gantry.dev/applied-hash"))
            );
        }
    }
}

#[test]
fn a_config_change_changes_the_pod_template_so_pods_roll() {
    let mut model = fixture_model("cpu");
    let before = built("cpu");
    model
        .spec
        .engine_config
        .as_mut()
        .expect("engine config")
        .context_length = Some(8192);
    let v = validate(&model, &Settings::default()).expect("valid");
    let r = resolve(&v, None, &fixture_plugins(), 1);
    let after = build::build(&v, &r.mounted(), &Settings::default()).expect("build");
    let hash = |o: &OwnedObjects| {
        o.deployment
            .spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.clone())
            .expect("annotations")["gantry.dev/config-hash"]
            .clone()
    };
    assert_ne!(hash(&before), hash(&after));
    assert_eq!(hash(&after), after.config_hash);
}

#[test]
fn the_deployment_leaves_replicas_to_the_autoscaler_and_starts_at_min() {
    for case in CASES {
        let o = built(case);
        assert_eq!(
            o.deployment.spec.replicas, None,
            "{case}: a re-apply must not own spec.replicas"
        );
        let v = valid(case);
        assert_eq!(o.initial_replicas, v.replicas.min.max(1), "{case}");
    }
    let mut zero = valid("cpu");
    zero.replicas.min = 0;
    assert_eq!(
        build::initial_replicas(&zero),
        0,
        "Builtin may start at zero"
    );
}

#[test]
fn hpa_mode_emits_an_hpa_on_the_node_metrics_and_builtin_mode_none() {
    for case in ["cpu", "gpu", "pvc-cache", "image-volume", "pinned"] {
        assert!(built(case).hpa.is_none(), "{case} is Builtin: no HPA");
    }
    let hpa = built("hpa").hpa.expect("an HPA in HPA mode");
    let spec = hpa.spec;
    assert_eq!(spec.scale_target_ref.kind, "Deployment");
    assert_eq!(spec.scale_target_ref.name, "llama31-8b");
    assert_eq!((spec.min_replicas, spec.max_replicas), (Some(1), 4));
    let metrics = spec.metrics.expect("metrics");
    let targets: Vec<(String, String)> = metrics
        .iter()
        .map(|m| {
            let pods = m.pods.as_ref().expect("Pods metric");
            (
                pods.metric.name.clone(),
                pods.target.average_value.clone().expect("average value").0,
            )
        })
        .collect();
    assert_eq!(
        targets,
        [
            ("gantry_num_requests_waiting".to_string(), "6".to_string()),
            // The node exports KV use as a fraction: 75 % is 0.75.
            ("gantry_kv_cache_usage_perc".to_string(), "750m".to_string()),
        ]
    );
    for m in &metrics {
        let selector = m.pods.as_ref().and_then(|p| p.metric.selector.clone());
        assert_eq!(
            selector.and_then(|s| s.match_labels).expect("labels")["model"],
            "llama-3.1-8b",
            "the node labels its gauges with the served name"
        );
    }
    let behavior = spec.behavior.expect("behavior");
    assert_eq!(
        behavior
            .scale_down
            .and_then(|d| d.stabilization_window_seconds),
        Some(120)
    );
    assert_eq!(
        hpa.metadata.owner_references.expect("owner")[0].uid,
        "3f1c2b4a-0000-4000-8000-000000000006"
    );
}

#[test]
fn a_models_speculation_settings_reach_its_node_config_over_the_defaults() {
    let mut m = fixture_model("cpu");
    m.spec.engine_config.get_or_insert_default().speculation =
        Some(gantry_crd::model::Speculation {
            method: gantry_crd::model::SpeculationMethod::Off,
            draft_tokens: Some(5),
            adaptive: Some(false),
            ..Default::default()
        });
    let o = built_model(&m);
    let config = &o.config_map.data.as_ref().expect("data")["models.yaml"];
    let parsed: gantry_api::NodeConfig = serde_yaml::from_str(config).expect("node config parses");
    let s = &parsed.models[0].speculation;
    assert_eq!(s.method, gantry_api::config::SpeculationMethod::Off);
    assert_eq!((s.draft_tokens, s.ngram_min, s.ngram_max), (Some(5), 2, 4));
    assert!(!s.adaptive, "adaptive: false reaches the node");
    // Without the block the node's defaults apply and nothing is rendered.
    let plain = &built("cpu").config_map.data.expect("data")["models.yaml"];
    assert!(!plain.contains("speculation"), "{plain}");
}

#[test]
fn a_models_temperature_fallback_reaches_its_node_config_only_when_set() {
    let mut m = fixture_model("cpu");
    m.spec.modalities = vec![gantry_crd::engine_plugin::Modality::Transcription];
    m.spec
        .engine_config
        .get_or_insert_default()
        .temperature_fallback = Some(false);
    let o = built_model(&m);
    let config = &o.config_map.data.as_ref().expect("data")["models.yaml"];
    let parsed: gantry_api::NodeConfig = serde_yaml::from_str(config).expect("node config parses");
    assert_eq!(parsed.models[0].temperature_fallback, Some(false));
    assert!(config.contains("temperatureFallback: false"), "{config}");
    // Unset, the node's default (on) applies and nothing is rendered.
    let plain = &built("cpu").config_map.data.expect("data")["models.yaml"];
    assert!(!plain.contains("temperatureFallback"), "{plain}");
}
