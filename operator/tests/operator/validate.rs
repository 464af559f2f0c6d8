//! Validate step, pure: every validation failure, the field it names, and the conditions the
//! status step derives from it.

use gantry_crd::{CacheType, Model};
use gantry_operator::context::Settings;
use gantry_operator::model::status::fold_invalid;
use gantry_operator::model::validate::validate;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::support::{fixture_model, t0};

type Mutation = fn(&mut Model);

/// (what is wrong, how to break the CPU fixture, the field the failure must name)
const CASES: [(&str, Mutation, &str); 29] = [
    (
        "name that is not a DNS-1035 label",
        |m| m.metadata.name = Some("3-gemma".into()),
        "metadata.name",
    ),
    (
        "name longer than 63",
        |m| m.metadata.name = Some("a".repeat(64)),
        "metadata.name",
    ),
    (
        "missing namespace",
        |m| m.metadata.namespace = None,
        "metadata.namespace",
    ),
    (
        "unknown scheme",
        |m| m.spec.source.uri = "ftp://host/x.gguf".into(),
        "spec.source.uri",
    ),
    (
        "hf without repo",
        |m| m.spec.source.uri = "hf://only-org".into(),
        "spec.source.uri",
    ),
    (
        "hf with empty revision",
        |m| m.spec.source.uri = "hf://org/repo@".into(),
        "spec.source.uri",
    ),
    (
        "pvc path traversal",
        |m| m.spec.source.uri = "pvc://claim/../etc/passwd".into(),
        "spec.source.uri",
    ),
    (
        "file without absolute path",
        |m| m.spec.source.uri = "file://relative".into(),
        "spec.source.uri",
    ),
    (
        "absolute file entry",
        |m| m.spec.source.files = vec!["/etc/passwd".into()],
        "spec.source.files",
    ),
    (
        "served name with spaces",
        |m| m.spec.served_name = Some("my model".into()),
        "spec.servedName",
    ),
    (
        "too many GPUs",
        |m| m.spec.resources.get_or_insert_default().gpus = Some(17),
        "spec.resources.gpus",
    ),
    (
        "bad GPU resource name",
        |m| m.spec.resources.get_or_insert_default().gpu_resource_name = Some("nvidia.com/".into()),
        "spec.resources.gpuResourceName",
    ),
    (
        "memory that is not a quantity",
        |m| m.spec.resources.get_or_insert_default().memory = Some(Quantity("lots".into())),
        "spec.resources.memory",
    ),
    (
        "zero CPU",
        |m| m.spec.resources.get_or_insert_default().cpu = Some(Quantity("0".into())),
        "spec.resources.cpu",
    ),
    (
        "min above max",
        |m| m.spec.replicas = Some(gantry_crd::Replicas { min: 3, max: 2 }),
        "spec.replicas",
    ),
    (
        "zero context length",
        |m| m.spec.engine_config.get_or_insert_default().context_length = Some(0),
        "spec.engineConfig.contextLength",
    ),
    (
        "a shortest n-gram longer than the default longest",
        |m| {
            m.spec.engine_config.get_or_insert_default().speculation =
                Some(gantry_crd::model::Speculation {
                    ngram_min: Some(6),
                    ..Default::default()
                })
        },
        "spec.engineConfig.speculation.ngramMax",
    ),
    (
        "a draft model method without a draft model",
        |m| {
            m.spec.engine_config.get_or_insert_default().speculation =
                Some(gantry_crd::model::Speculation {
                    method: gantry_crd::model::SpeculationMethod::DraftModel,
                    ..Default::default()
                })
        },
        "spec.engineConfig.speculation.draftModel",
    ),
    (
        "a draft model for a Model with node pods of its own",
        |m| {
            m.spec.engine_config.get_or_insert_default().speculation =
                Some(gantry_crd::model::Speculation {
                    method: gantry_crd::model::SpeculationMethod::DraftModel,
                    draft_model: Some("small".into()),
                    ..Default::default()
                })
        },
        "spec.engineConfig.speculation.draftModel",
    ),
    (
        "a temperature fallback for a Model without speech recognition",
        |m| {
            m.spec.modalities = vec![gantry_crd::engine_plugin::Modality::Completion];
            m.spec
                .engine_config
                .get_or_insert_default()
                .temperature_fallback = Some(false);
        },
        "spec.engineConfig.temperatureFallback",
    ),
    (
        "PVC cache without size",
        |m| {
            m.spec.cache = Some(gantry_crd::Cache {
                type_: CacheType::PersistentVolumeClaim,
                ..Default::default()
            })
        },
        "spec.cache.size",
    ),
    (
        "engine pin that is not an id",
        |m| m.spec.engine = Some("Llama CPP".into()),
        "spec.engine",
    ),
    (
        "quantization on safetensors",
        |m| m.spec.format = gantry_crd::ModelFormat::Safetensors,
        "spec.source.quantization",
    ),
    (
        "lazy loading on a single-model node",
        |m| m.spec.load = gantry_crd::LoadPolicy::Lazy,
        "spec.load",
    ),
    (
        "HPA mode with replicas.min 0",
        |m| {
            m.spec.replicas = Some(gantry_crd::Replicas { min: 0, max: 3 });
            m.spec.autoscaling = Some(gantry_crd::Autoscaling {
                mode: gantry_crd::AutoscalingMode::Hpa,
                ..Default::default()
            });
        },
        "spec.replicas.min",
    ),
    (
        "a scale-to-zero delay above a day",
        |m| {
            m.spec.autoscaling = Some(gantry_crd::Autoscaling {
                scale_to_zero_after_seconds: Some(90000),
                ..Default::default()
            })
        },
        "spec.autoscaling.scaleToZeroAfterSeconds",
    ),
    (
        "maxUnavailable with the Surge strategy",
        |m| {
            m.spec.rollout = Some(gantry_crd::Rollout {
                max_unavailable: Some(1),
                ..Default::default()
            })
        },
        "spec.rollout.maxUnavailable",
    ),
    (
        "maxSurge with the InPlace strategy",
        |m| {
            m.spec.rollout = Some(gantry_crd::Rollout {
                strategy: gantry_crd::RolloutStrategy::InPlace,
                max_surge: Some(1),
                ..Default::default()
            })
        },
        "spec.rollout.maxSurge",
    ),
    (
        "a surge of zero (the Deployment would never roll)",
        |m| {
            m.spec.rollout = Some(gantry_crd::Rollout {
                max_surge: Some(0),
                ..Default::default()
            })
        },
        "spec.rollout.maxSurge",
    ),
];

#[test]
fn every_validation_failure_names_its_field() {
    assert!(validate(&fixture_model("cpu"), &Settings::default()).is_ok());
    for (what, mutate, field) in CASES {
        let mut model = fixture_model("cpu");
        mutate(&mut model);
        let problems = validate(&model, &Settings::default()).expect_err(what);
        assert!(
            problems.iter().any(|p| p.field == field),
            "{what}: expected a problem on {field}, got {problems:?}"
        );
    }
}

#[test]
fn all_fixtures_are_valid() {
    for case in ["cpu", "gpu", "pvc-cache", "image-volume", "pinned", "hpa"] {
        validate(&fixture_model(case), &Settings::default())
            .unwrap_or_else(|e| panic!("{case}: {e:?}"));
    }
}

#[test]
fn several_failures_are_reported_together() {
    let mut model = fixture_model("cpu");
    model.spec.source.uri = "ftp://x".into();
    model.spec.replicas = Some(gantry_crd::Replicas { min: 5, max: 1 });
    let problems = validate(&model, &Settings::default()).expect_err("invalid");
    assert_eq!(problems.len(), 2, "{problems:?}");
}

#[test]
fn an_invalid_spec_sets_ready_false_and_degraded_true_with_reason_invalid_spec() {
    for (what, mutate, field) in CASES {
        let mut model = fixture_model("cpu");
        mutate(&mut model);
        let problems = validate(&model, &Settings::default()).expect_err(what);
        let status = fold_invalid(&model, &problems, t0());
        let json = serde_json::to_value(&status).expect("json");
        let ready = crate::support::condition(&json, "Ready");
        assert_eq!(
            (ready["status"].as_str(), ready["reason"].as_str()),
            (Some("False"), Some("InvalidSpec")),
            "{what}"
        );
        assert!(
            ready["message"].as_str().is_some_and(|m| m.contains(field)),
            "{what}: {ready}"
        );
        let degraded = crate::support::condition(&json, "Degraded");
        assert_eq!(
            (degraded["status"].as_str(), degraded["reason"].as_str()),
            (Some("True"), Some("InvalidSpec")),
            "{what}"
        );
        assert_eq!(status.observed_generation, model.metadata.generation);
        // The other conditions exist (Unknown when nothing better is known).
        for t in ["EngineResolved", "ArtifactReady", "Progressing"] {
            assert_eq!(
                crate::support::condition(&json, t)["status"],
                "Unknown",
                "{what}/{t}"
            );
        }
    }
}

#[test]
fn rollout_defaults_to_surge_by_one_and_in_place_removes_first() {
    use gantry_crd::{Rollout, RolloutStrategy};
    // Default, GPU or not: a new pod before an old one goes, so one replica never goes down.
    for case in ["cpu", "gpu"] {
        let v = validate(&fixture_model(case), &Settings::default()).expect("valid");
        assert_eq!(
            (
                v.rollout.strategy,
                v.rollout.max_surge,
                v.rollout.max_unavailable
            ),
            (RolloutStrategy::Surge, 1, 0),
            "{case}"
        );
    }
    let mut m = fixture_model("gpu");
    m.spec.rollout = Some(Rollout {
        strategy: RolloutStrategy::InPlace,
        max_unavailable: Some(2),
        ..Default::default()
    });
    let v = validate(&m, &Settings::default()).expect("valid");
    assert_eq!((v.rollout.max_surge, v.rollout.max_unavailable), (0, 2));
    m.spec.rollout = Some(Rollout {
        max_surge: Some(3),
        ..Default::default()
    });
    let v = validate(&m, &Settings::default()).expect("valid");
    assert_eq!((v.rollout.max_surge, v.rollout.max_unavailable), (3, 0));
}
