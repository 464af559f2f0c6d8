//! Generated objects against the Kubernetes types: every object the build step makes, every
//! golden file, the examples and the node config deserialize into their `k8s-openapi` (or
//! Gantry) type with no field dropped — an unknown or misspelt field would be.

use gantry_crd::{EnginePlugin, Model};
use gantry_operator::context::Settings;
use gantry_operator::model::build;
use gantry_operator::model::resolve::resolve;
use gantry_operator::model::validate::validate;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::support::{contains, crate_dir, fixture_model, fixture_plugins, repo_dir, yaml_docs};

/// Deserialize `value` as `K` (naming the failing path), serialize it back, and require that
/// everything in `value` survived: a field `K` does not know would be silently dropped.
pub fn assert_round_trips<K: DeserializeOwned + Serialize>(value: &Value, what: &str) {
    let typed: K = serde_path_to_error::deserialize(value.clone()).unwrap_or_else(|e| {
        panic!(
            "{what}: does not deserialize at {}: {}",
            e.path(),
            e.inner()
        )
    });
    let back = serde_json::to_value(&typed).expect("serialize");
    assert!(
        contains(&back, value),
        "{what}: fields were dropped or changed by {}:\noriginal: {value}\nread back: {back}",
        std::any::type_name::<K>()
    );
}

fn check_by_kind(doc: &Value, what: &str) {
    match doc["kind"].as_str() {
        Some("ConfigMap") => assert_round_trips::<ConfigMap>(doc, what),
        Some("Deployment") => assert_round_trips::<Deployment>(doc, what),
        Some("Service") => assert_round_trips::<Service>(doc, what),
        Some("PodDisruptionBudget") => assert_round_trips::<PodDisruptionBudget>(doc, what),
        Some("PersistentVolumeClaim") => assert_round_trips::<PersistentVolumeClaim>(doc, what),
        Some("HorizontalPodAutoscaler") => assert_round_trips::<HorizontalPodAutoscaler>(doc, what),
        Some("Secret") => assert_round_trips::<Secret>(doc, what),
        Some("NetworkPolicy") => assert_round_trips::<NetworkPolicy>(doc, what),
        other => panic!("{what}: unexpected kind {other:?}"),
    }
}

#[test]
fn every_built_object_reads_back_as_its_kubernetes_type() {
    for case in ["cpu", "gpu", "pvc-cache", "image-volume", "pinned", "hpa"] {
        let v = validate(&fixture_model(case), &Settings::default()).expect("valid");
        let r = resolve(
            &v,
            v.declared_architecture.as_deref(),
            &fixture_plugins(),
            1,
        );
        let secured = Settings {
            node_token: Some("0123456789abcdef0123456789abcdef".parse().expect("token")),
            network_policy: Some(gantry_operator::context::NodeNetworkPolicy {
                peer_namespace: "gantry-system".into(),
                metrics_namespace: Some("monitoring".into()),
                ..Default::default()
            }),
            ..Settings::default()
        };
        let o = build::build(&v, &r.mounted(), &secured).expect("build");
        let mut docs = vec![
            serde_json::to_value(&o.config_map).expect("json"),
            serde_json::to_value(&o.deployment).expect("json"),
            serde_json::to_value(&o.service).expect("json"),
        ];
        docs.extend(o.pvc.iter().map(|x| serde_json::to_value(x).expect("json")));
        docs.extend(o.pdb.iter().map(|x| serde_json::to_value(x).expect("json")));
        docs.extend(o.hpa.iter().map(|x| serde_json::to_value(x).expect("json")));
        docs.extend(
            o.node_token_secret
                .iter()
                .map(|x| serde_json::to_value(x).expect("json")),
        );
        docs.extend(
            o.network_policy
                .iter()
                .map(|x| serde_json::to_value(x).expect("json")),
        );
        assert_eq!(
            docs.len() - 3,
            [o.pvc.is_some(), o.pdb.is_some(), o.hpa.is_some()]
                .iter()
                .filter(|x| **x)
                .count()
                + 2
        );
        for doc in docs {
            assert!(
                doc["apiVersion"].is_string() && doc["kind"].is_string(),
                "{case}: {doc}"
            );
            check_by_kind(&doc, case);
        }
        // The node config inside the ConfigMap is exactly the node's config type.
        let text = &o.config_map.data.as_ref().expect("data")["models.yaml"];
        let yaml: Value = serde_yaml::from_str(text).expect("yaml");
        assert_round_trips::<gantry_api::NodeConfig>(&yaml, &format!("{case} models.yaml"));
    }
}

#[test]
fn golden_files_read_back_as_their_kubernetes_types() {
    for entry in std::fs::read_dir(crate_dir().join("tests/golden")).expect("golden dir") {
        let path = entry.expect("entry").path();
        for doc in yaml_docs::<Value>(&path) {
            check_by_kind(&doc, &path.display().to_string());
        }
    }
}

#[test]
fn examples_and_fixtures_read_back_as_gantry_resources() {
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(repo_dir().join("docs/examples"))
        .expect("examples")
        .map(|e| e.expect("entry").path())
        .collect();
    files.push(crate_dir().join("tests/fixtures/plugins.yaml"));
    files.extend(
        std::fs::read_dir(crate_dir().join("tests/fixtures/models"))
            .expect("fixtures")
            .map(|e| e.expect("entry").path()),
    );
    for path in files {
        for doc in yaml_docs::<Value>(&path) {
            let what = path.display().to_string();
            match doc["kind"].as_str() {
                Some("Model") => assert_round_trips::<Model>(&doc, &what),
                Some("EnginePlugin") => assert_round_trips::<EnginePlugin>(&doc, &what),
                Some("ModelPool") => assert_round_trips::<gantry_crd::ModelPool>(&doc, &what),
                other => panic!("{what}: unexpected kind {other:?}"),
            }
        }
    }
}

#[test]
fn the_example_engine_plugin_mirrors_the_llama_cpp_manifest() {
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_dir().join("engines/llama-cpp/manifest.json"))
            .expect("manifest"),
    )
    .expect("json");
    let plugin: EnginePlugin =
        yaml_docs(&repo_dir().join("docs/examples/engineplugin-llama-cpp-cpu.yaml")).remove(0);
    assert_eq!(manifest["id"], plugin.spec.engine_id.as_str());
    assert_eq!(manifest["version"], plugin.spec.version.as_str());
    assert_eq!(
        manifest["abi_version"],
        plugin.spec.abi_version.to_string().as_str()
    );
    assert_eq!(manifest["gpu_backend"], plugin.spec.gpu_backend.as_str());
    assert_eq!(
        manifest["formats"],
        serde_json::to_value(&plugin.spec.formats).expect("json")
    );
    assert_eq!(
        manifest["modalities"],
        serde_json::to_value(&plugin.spec.modalities).expect("json")
    );
    assert_eq!(
        manifest["architectures"],
        serde_json::to_value(&plugin.spec.architectures).expect("json")
    );
}
