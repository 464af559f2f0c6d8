//! Tests of the node config: parsing, the rules the YAML shape cannot express, the `serve`
//! flags' single-model shorthand.

use super::*;

#[test]
fn yaml_with_defaults_parses_and_unknown_keys_are_refused() {
    let cfg: NodeConfig =
        serde_yaml::from_str("models:\n  - id: a\n    path: /m/a.gguf\n    format: gguf\n")
            .expect("yaml");
    assert_eq!(cfg.models[0].load, LoadPolicy::Eager);
    assert_eq!(cfg.scheduler.request_timeout_seconds, 30);
    assert_eq!(cfg.scheduler.stall_timeout_seconds, 5);
    let err = serde_yaml::from_str::<NodeConfig>(
        "models:\n  - id: a\n    path: x\n    format: gguf\n    bogus: 1\n",
    )
    .expect_err("unknown key");
    assert!(err.to_string().contains("unknown field `bogus`"), "{err}");
}

#[test]
fn the_config_the_operator_renders_parses_here() {
    let rendered = NodeConfig {
        models: vec![ModelConfig {
            id: "gemma".into(),
            source: Some("file:///models/cache/gemma.gguf".into()),
            format: "gguf".into(),
            quantization: Some("Q4_K_M".into()),
            engine: Some("llama_cpp".into()),
            context_length: Some(4096),
            max_batch_size: Some(8),
            threads: Some(2),
            load: LoadPolicy::Eager,
            ..Default::default()
        }],
        cache_dir: Some("/var/cache/gantry".into()),
        ..Default::default()
    };
    let yaml = serde_yaml::to_string(&rendered).expect("yaml");
    assert!(
        !yaml.contains("scheduler"),
        "defaults are not rendered: {yaml}"
    );
    let cfg: NodeConfig =
        serde_yaml::from_str(&yaml).expect("the node reads the operator's config");
    cfg.validate().expect("valid");
    let m = &cfg.models[0];
    assert_eq!(
        m.local_path().expect("file source"),
        PathBuf::from("/models/cache/gemma.gguf")
    );
    assert_eq!(
        (m.engine.as_deref(), m.context_length, m.load),
        (Some("llama_cpp"), Some(4096), LoadPolicy::Eager)
    );
    let mut hf = m.clone();
    hf.source = Some("hf://google/gemma".into());
    assert!(
        hf.local_path()
            .expect_err("needs the store")
            .to_string()
            .contains("model store")
    );
}

#[test]
fn the_config_hash_is_the_first_eight_bytes_of_the_sha256_in_hex() {
    // sha256("") = e3b0c44298fc1c149afbf4c8996fb924...
    assert_eq!(config_hash(b""), "e3b0c44298fc1c14");
    assert_eq!(config_hash(b"models: []\n").len(), 16);
    assert_ne!(config_hash(b"a"), config_hash(b"b"));
}

#[test]
fn a_lazy_model_may_be_alone_the_watermark_is_bounded_and_formats_are_checked() {
    let mut cfg = NodeConfig::single(Path::new("/m/x.gguf"), None).expect("single");
    assert_eq!(cfg.models[0].id, "x");
    // A pool of one member: it loads on its first request.
    cfg.models[0].load = LoadPolicy::Lazy;
    cfg.validate().expect("lazy alone");
    for bad in [49, 100] {
        cfg.scheduler.memory_watermark_percent = bad;
        assert!(
            cfg.validate()
                .expect_err("watermark")
                .to_string()
                .contains("scheduler.memoryWatermarkPercent")
        );
    }
    cfg.scheduler.memory_watermark_percent = 90;
    cfg.models[0].load = LoadPolicy::Eager;
    cfg.models[0].format = "tflite".into();
    assert!(
        cfg.validate()
            .expect_err("format")
            .to_string()
            .contains("`gguf`, `safetensors` or `onnx`")
    );
    assert!(NodeConfig::single(Path::new("/m/x.bin"), None).is_err());
}

#[test]
fn replicas_are_bounded_and_pinned_devices_split_evenly() {
    let mut cfg = NodeConfig::single(Path::new("/m/x.gguf"), None).expect("single");
    let m = &mut cfg.models[0];
    m.replicas = Some(2);
    m.devices = vec![0, 1, 2, 3];
    m.gpus = Some(2);
    cfg.validate().expect("two replicas of two pinned GPUs");
    let err = |cfg: &NodeConfig| cfg.validate().expect_err("invalid").to_string();
    cfg.models[0].replicas = Some(0);
    assert!(err(&cfg).contains("`models[x].replicas`: must be within [1, 16], got 0"));
    cfg.models[0].replicas = Some(MAX_REPLICAS + 1);
    assert!(err(&cfg).contains("got 17"));
    cfg.models[0].replicas = Some(3);
    assert!(err(&cfg).contains("cannot be split evenly among 3 replicas"));
    cfg.models[0].replicas = Some(4);
    assert!(
        err(&cfg).contains("pins 4 device(s) but 4 replica(s) of 2 GPU(s) need 8"),
        "{}",
        err(&cfg)
    );
}
