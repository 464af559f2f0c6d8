//! Build step, pure: which engine plugins a node pod mounts (every fitting CPU plugin, an
//! image-volume plugin, only a pinned engine, several candidates whose measurement the node
//! makes).

use gantry_operator::context::Settings;
use gantry_operator::model::build;
use gantry_operator::model::resolve::{Resolution, resolve};
use gantry_operator::model::validate::validate;

use crate::build::{built, node, pod, resolved};
use crate::support::{fixture_model, fixture_plugins};

#[test]
fn cpu_model_without_architecture_mounts_every_fitting_cpu_plugin() {
    let (_, r) = resolved("cpu");
    let names: Vec<String> = r
        .mounted()
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    // Both CPU GGUF plugins fit until the architecture is known; the CUDA one never does.
    assert_eq!(names, ["llama-cpp-cpu", "tinyllm-cpu"]);
    let o = built("cpu");
    let resources = node(&o).resources.clone().expect("resources");
    assert!(
        resources
            .limits
            .as_ref()
            .is_some_and(|l| !l.contains_key("nvidia.com/gpu"))
    );
    assert_eq!(
        node(&o).env.as_ref().expect("env")[0].value.as_deref(),
        Some("cpu")
    );
    let config = &o.config_map.data.as_ref().expect("data")["models.yaml"];
    let parsed: gantry_api::NodeConfig = serde_yaml::from_str(config).expect("node config parses");
    assert_eq!(parsed.models[0].id, "gemma-3-270m");
    assert_eq!(parsed.models[0].quantization.as_deref(), Some("Q4_K_M"));
    assert_eq!(parsed.models[0].context_length, Some(4096));
    assert_eq!(
        parsed.cache_dir.as_deref(),
        Some(std::path::Path::new("/var/cache/gantry"))
    );
}

#[test]
fn image_volume_plugin_is_mounted_as_a_read_only_image_volume() {
    let o = built("image-volume");
    let p = pod(&o);
    assert!(p.init_containers.is_none(), "no copier for an image volume");
    let vol = p
        .volumes
        .as_ref()
        .expect("volumes")
        .iter()
        .find(|v| v.image.is_some())
        .expect("image volume");
    assert_eq!(
        vol.image.as_ref().and_then(|i| i.reference.as_deref()),
        Some("registry.example.com/engines/tinyllm:1.2.0")
    );
    let m = node(&o)
        .volume_mounts
        .as_ref()
        .expect("mounts")
        .iter()
        .find(|m| m.name == vol.name)
        .expect("mount");
    assert_eq!(m.mount_path, "/opt/gantry/engines/tinyllm/cpu");
    assert_eq!(m.sub_path.as_deref(), Some("opt/tinyllm/cpu"));
    assert_eq!(m.read_only, Some(true));
    let cache = p
        .volumes
        .as_ref()
        .expect("volumes")
        .iter()
        .find(|v| v.name == "cache")
        .expect("cache");
    assert_eq!(
        cache
            .empty_dir
            .as_ref()
            .and_then(|e| e.size_limit.clone())
            .map(|q| q.0),
        Some("5Gi".to_string())
    );
}

#[test]
fn pinned_model_mounts_only_the_pinned_engine_and_the_source_claim() {
    let (v, r) = resolved("pinned");
    assert_eq!(r.mounted().len(), 1);
    assert_eq!(r.mounted()[0].spec.engine_id, "llama_cpp");
    assert_eq!(
        v.source.node_uri,
        "file:///models/model-store/qwen2.5/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    );
    let o = built("pinned");
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(&o.config_map.data.as_ref().expect("data")["models.yaml"])
            .expect("config");
    assert_eq!(config.models[0].engine.as_deref(), Some("llama_cpp"));
    assert_eq!(config.models[0].id, "qwen2.5-0.5b");
    let m = node(&o)
        .volume_mounts
        .as_ref()
        .expect("mounts")
        .iter()
        .find(|m| m.name == "model-source")
        .expect("source mount");
    assert_eq!(
        (m.mount_path.as_str(), m.read_only),
        ("/models/model-store", Some(true))
    );
}

#[test]
fn several_engines_for_a_known_architecture_are_all_mounted_and_the_nodes_measurement_decides() {
    use gantry_api::{EngineBench, EngineChoice, EngineVerdict, NodeStatus};
    use gantry_crd::conditions::reason;
    use gantry_operator::model::status::{Facts, fold};
    use gantry_operator::node_report::NodeReport;

    // A second engine (another id) that also reads llama GGUFs on CPU.
    let mut plugins = fixture_plugins();
    let mut other = plugins[0].clone();
    other.metadata.name = Some("native-gguf".into());
    other.spec.engine_id = "native_gguf".into();
    other.spec.image = "registry.example.com/engines/native-gguf:0.2.0".into();
    other.spec.version = "0.2.0".into();
    plugins.push(other);
    let model = fixture_model("s3");
    let v = validate(&model, &Settings::default()).expect("valid");
    let r = resolve(&v, Some("llama"), &plugins, 1);
    let names: Vec<String> = r
        .mounted()
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    assert!(matches!(r, Resolution::Measured(_)), "{r:?}");
    assert_eq!(names, ["llama-cpp-cpu", "native-gguf"]);
    // Both images are in the pod.
    let objects = build::build(&v, &r.mounted(), &Settings::default()).expect("build");
    let spec = serde_json::to_string(&objects.deployment).expect("json");
    assert!(spec.contains("engine-llama-cpp-cpu:0.1.0") && spec.contains("native-gguf:0.2.0"));

    // A pin is never measured.
    let mut pinned = model.clone();
    pinned.spec.engine = Some("native_gguf".into());
    let pv = validate(&pinned, &Settings::default()).expect("valid");
    match resolve(&pv, Some("llama"), &plugins, 1) {
        Resolution::Resolved(p) => assert_eq!(p.spec.engine_id, "native_gguf"),
        other => panic!("a pin resolves to one plugin: {other:?}"),
    }

    // Until a node pod reports, EngineResolved says the choice is pending and why.
    let fold_with = |reports: &[&NodeReport]| {
        fold(&Facts {
            model: &model,
            valid: &v,
            architecture: Some("llama"),
            resolution: &r,
            deployment: None,
            reports,
            apply_error: None,
            deliveries: &[],
            deliver_error: None,
            now: crate::support::t0(),
        })
    };
    let s = fold_with(&[]);
    let engine = s
        .conditions
        .iter()
        .find(|c| c.type_ == "EngineResolved")
        .expect("EngineResolved");
    assert_eq!(
        (engine.status.as_str(), engine.reason.as_str()),
        ("Unknown", reason::ENGINE_CHOICE_PENDING)
    );
    assert!(
        engine.message.contains("llama-cpp-cpu, native-gguf"),
        "{}",
        engine.message
    );
    assert!(s.engine.is_none() && s.engine_choice.is_none());

    // The node pod measured both and chose: its verdict and figures are the Model's.
    let bench = |plugin: &str, outcome: &str, tps: f64| EngineBench {
        plugin: plugin.into(),
        version: "0.1.0".into(),
        outcome: outcome.into(),
        tokens_per_second: Some(tps),
        ttft_ms: Some(40.0),
        peak_bytes: Some(900 << 20),
        message: None,
        cached: false,
    };
    let choice = EngineChoice {
        chosen: "native_gguf".into(),
        rule: "highest decode tokens/s".into(),
        candidates: vec![
            bench("llama_cpp", "slower", 21.0),
            bench("native_gguf", "chosen", 30.0),
        ],
    };
    let served = v.served_name.clone();
    let report = NodeReport {
        pod: "ml/llama-s3-abc".into(),
        config_hash: None,
        plugins: names.clone(),
        status: Ok(NodeStatus {
            models: vec![gantry_api::ModelStatus {
                id: served,
                format: "gguf".into(),
                architecture: Some("llama".into()),
                verdict: Some(EngineVerdict::Supported {
                    plugin: "native_gguf".into(),
                    version: "0.2.0".into(),
                }),
                artifact: Default::default(),
                load: Default::default(),
                queue: Default::default(),
                devices: Vec::new(),
                replicas: Vec::new(),
                crashes: None,
                engine_choice: Some(choice.clone()),
                adapters: Vec::new(),
                draft: None,
            }],
            ..NodeStatus::default()
        }),
    };
    let s = fold_with(&[&report]);
    let engine = s.engine.expect("engine");
    assert_eq!(
        (engine.id.as_str(), engine.plugin.as_deref()),
        ("native_gguf", Some("native-gguf"))
    );
    assert_eq!(s.engine_choice, Some(choice));
}
