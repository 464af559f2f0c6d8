//! CRDs: the committed YAML is what the Rust types generate, the schemas are structural and
//! self-documenting, the printer columns are the promised ones, and the CEL admission rules
//! accept the examples and refuse what they should. The OpenAPI half of admission (types,
//! enums, patterns, ranges) is tests/python/test_crd_admission.py, with the reference
//! `jsonschema` implementation.

use gantry_crd::{EnginePlugin, Model};
use gantry_operator::crdgen::generate::{self, schema_of};
use gantry_operator::crdgen::structural;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::{Value, json};

use crate::support::{repo_dir, yaml_docs};

#[test]
fn committed_crds_match_the_rust_types() {
    let files = generate::files().expect("CRDs generate");
    let mut stale = Vec::new();
    for dir in ["crds", "charts/gantry/crds"] {
        for (name, want) in &files {
            let path = repo_dir().join(dir).join(name);
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            if &have != want {
                stale.push(format!("{dir}/{name}"));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "stale CRD YAML: {stale:?}\nregenerate with:\n  cargo run -p gantry-operator -- crdgen --out crds/ --out charts/gantry/crds/"
    );
}

#[test]
fn crd_schemas_are_structural() {
    for crd in generate::crds() {
        let violations = structural::check(&schema_of(&crd));
        assert!(
            violations.is_empty(),
            "{}: {violations:#?}",
            crd.metadata.name.unwrap_or_default()
        );
    }
}

/// Walk every property, item and map value; report those without a description.
fn undescribed(node: &Value, path: &str, out: &mut Vec<String>) {
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (name, child) in props {
            let p = format!("{path}.{name}");
            if child
                .get("description")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                out.push(p.clone());
            }
            undescribed(child, &p, out);
        }
    }
    if let Some(items) = node.get("items") {
        undescribed(items, &format!("{path}[]"), out);
    }
    if let Some(ap) = node.get("additionalProperties").filter(|v| v.is_object()) {
        undescribed(ap, &format!("{path}{{}}"), out);
    }
}

#[test]
fn every_field_has_a_description_for_kubectl_explain() {
    for crd in generate::crds() {
        let schema = schema_of(&crd);
        let mut missing = Vec::new();
        // `metadata`, `apiVersion` and `kind` are documented by Kubernetes itself.
        for (name, child) in schema["properties"].as_object().expect("properties") {
            if ["spec", "status"].contains(&name.as_str()) {
                undescribed(child, name, &mut missing);
            }
        }
        assert!(
            missing.is_empty(),
            "{}: {missing:?}",
            crd.metadata.name.unwrap_or_default()
        );
    }
}

fn columns(crd: &CustomResourceDefinition) -> Vec<(String, String)> {
    crd.spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .filter(|c| c.priority.unwrap_or(0) == 0)
        .map(|c| (c.name.to_uppercase(), c.json_path.clone()))
        .collect()
}

#[test]
fn printer_columns_are_the_documented_ones() {
    let model: Vec<String> = columns(&Model::crd()).into_iter().map(|c| c.0).collect();
    assert_eq!(model, ["READY", "FORMAT", "ENGINE", "REPLICAS", "AGE"]);
    let plugin: Vec<String> = columns(&EnginePlugin::crd())
        .into_iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(
        plugin,
        ["ENGINE", "VERSION", "BACKEND", "ACCEPTED", "LOADED"]
    );
    assert_eq!(Model::crd().spec.scope, "Namespaced");
    assert_eq!(EnginePlugin::crd().spec.scope, "Cluster");
}

#[test]
fn crds_deserialize_into_the_k8s_openapi_type_without_unknown_fields() {
    for dir in ["crds", "charts/gantry/crds"] {
        for entry in std::fs::read_dir(repo_dir().join(dir)).expect("dir") {
            let path = entry.expect("entry").path();
            for doc in yaml_docs::<Value>(&path) {
                crate::objects::assert_round_trips::<CustomResourceDefinition>(
                    &doc,
                    &path.display().to_string(),
                );
            }
        }
    }
}

/// CEL rules (`x-kubernetes-validations`) as the apiserver runs them.
fn cel_errors(crd: &CustomResourceDefinition, object: &Value, old: Option<&Value>) -> Vec<String> {
    match kube::core::cel::Validator::new().validate(&schema_of(crd), object, old) {
        Ok(()) => Vec::new(),
        Err(errors) => errors
            .into_vec()
            .into_iter()
            .map(|e| format!("{}: {}", e.field_path, e.message))
            .collect(),
    }
}

fn example(name: &str) -> Value {
    yaml_docs::<Value>(&repo_dir().join("docs/examples").join(name)).remove(0)
}

#[test]
fn the_examples_pass_the_cel_rules() {
    let model = example("model-gemma-3-270m.yaml");
    assert_eq!(
        cel_errors(&Model::crd(), &model, None),
        Vec::<String>::new()
    );
    // The pool example: the pool and each of its three members.
    for doc in yaml_docs::<Value>(&repo_dir().join("docs/examples/modelpool-small.yaml")) {
        let crd = match doc["kind"].as_str() {
            Some("ModelPool") => gantry_crd::ModelPool::crd(),
            _ => Model::crd(),
        };
        let what = doc["metadata"]["name"].clone();
        assert_eq!(cel_errors(&crd, &doc, None), Vec::<String>::new(), "{what}");
    }
    for case in ["cpu", "gpu", "pvc-cache", "image-volume", "pinned"] {
        let fixture = yaml_docs::<Value>(
            &crate::support::crate_dir().join(format!("tests/fixtures/models/{case}.yaml")),
        )
        .remove(0);
        assert_eq!(
            cel_errors(&Model::crd(), &fixture, None),
            Vec::<String>::new(),
            "{case}"
        );
    }
}

fn with(mut base: Value, pointer: &str, value: Value) -> Value {
    // A missing last segment is added (e.g. `/spec/autoscaling` on a Model without one).
    let (parent, key) = pointer.rsplit_once('/').expect("a JSON pointer");
    let parent = base
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("no object at {parent}"));
    parent.insert(key.to_string(), value);
    base
}

#[test]
fn cel_keeps_format_immutable_and_replicas_ordered() {
    let crd = Model::crd();
    let model = example("model-gemma-3-270m.yaml");
    let changed = with(model.clone(), "/spec/format", json!("safetensors"));
    let errors = cel_errors(&crd, &changed, Some(&model));
    assert!(
        errors.iter().any(|e| e.contains("format is immutable")),
        "{errors:?}"
    );
    assert_eq!(
        cel_errors(&crd, &model, Some(&model)),
        Vec::<String>::new(),
        "an unchanged format passes"
    );

    let inverted = with(model.clone(), "/spec/replicas", json!({"min": 3, "max": 2}));
    let errors = cel_errors(&crd, &inverted, None);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("replicas.min must be <= replicas.max")),
        "{errors:?}"
    );
    let zero = with(model.clone(), "/spec/replicas", json!({"min": 0, "max": 2}));
    assert_eq!(
        cel_errors(&crd, &zero, None),
        Vec::<String>::new(),
        "min may be 0"
    );

    let claim = with(
        model.clone(),
        "/spec/cache",
        json!({"type": "PersistentVolumeClaim"}),
    );
    let errors = cel_errors(&crd, &claim, None);
    assert!(
        errors.iter().any(|e| e.contains("cache.size is required")),
        "{errors:?}"
    );

    let hpa_zero = with(
        with(model.clone(), "/spec/replicas", json!({"min": 0, "max": 2})),
        "/spec/autoscaling",
        json!({"mode": "HPA"}),
    );
    let errors = cel_errors(&crd, &hpa_zero, None);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("replicas.min must be >= 1 with autoscaling.mode HPA")),
        "{errors:?}"
    );
    let hpa_one = with(
        with(model.clone(), "/spec/replicas", json!({"min": 1, "max": 2})),
        "/spec/autoscaling",
        json!({"mode": "HPA"}),
    );
    assert_eq!(
        cel_errors(&crd, &hpa_one, None),
        Vec::<String>::new(),
        "HPA with min 1 passes"
    );
    let builtin_zero = with(
        with(model.clone(), "/spec/replicas", json!({"min": 0, "max": 2})),
        "/spec/autoscaling",
        json!({"mode": "Builtin", "scaleToZeroAfterSeconds": 900}),
    );
    assert_eq!(
        cel_errors(&crd, &builtin_zero, None),
        Vec::<String>::new(),
        "Builtin may scale to zero"
    );

    let bad_name = with(model, "/metadata/name", json!("3-gemma"));
    let errors = cel_errors(&crd, &bad_name, None);
    assert!(errors.iter().any(|e| e.contains("DNS-1035")), "{errors:?}");
}

#[test]
fn admission_ties_each_rollout_knob_to_its_strategy() {
    let crd = Model::crd();
    let model = example("model-gemma-3-270m.yaml");
    let rollout = |r: Value| with(model.clone(), "/spec/rollout", r);
    for ok in [
        json!({}),
        json!({"strategy": "Surge"}),
        json!({"maxSurge": 2}),
        json!({"strategy": "Surge", "maxSurge": 1}),
        json!({"strategy": "InPlace"}),
        json!({"strategy": "InPlace", "maxUnavailable": 2}),
    ] {
        let m = rollout(ok.clone());
        assert_eq!(cel_errors(&crd, &m, None), Vec::<String>::new(), "{ok}");
    }
    let errors = cel_errors(&crd, &rollout(json!({"maxUnavailable": 1})), None);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("maxUnavailable applies only to strategy InPlace")),
        "{errors:?}"
    );
    let errors = cel_errors(
        &crd,
        &rollout(json!({"strategy": "InPlace", "maxSurge": 1})),
        None,
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("maxSurge applies only to strategy Surge")),
        "{errors:?}"
    );
}

#[test]
fn admission_keeps_adapter_ids_apart_from_each_other_and_from_the_model() {
    let crd = Model::crd();
    let model = example("model-gemma-3-270m.yaml");
    let adapters = |a: Value| with(model.clone(), "/spec/adapters", a);
    let ok = adapters(json!([
        {"name": "pirate", "source": {"uri": "hf://org/pirate"}, "scale": 0.5},
        {"name": "legal", "source": {"uri": "pvc://loras/legal"}, "servedName": "legal-bot"},
    ]));
    assert_eq!(cel_errors(&crd, &ok, None), Vec::<String>::new());
    let twice = adapters(json!([
        {"name": "a", "source": {"uri": "hf://org/a"}, "servedName": "bot"},
        {"name": "b", "source": {"uri": "hf://org/b"}, "servedName": "bot"},
    ]));
    let errors = cel_errors(&crd, &twice, None);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("servedName must be unique among the adapters")),
        "{errors:?}"
    );
    let base = adapters(json!([
        {"name": "a", "source": {"uri": "hf://org/a"}, "servedName": "gemma-3-270m"},
    ]));
    let errors = cel_errors(&crd, &base, None);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("must not be the Model's spec.servedName")),
        "{errors:?}"
    );
    for (scale, ok) in [
        (json!(1), true),
        (json!(0.5), true),
        (json!(16), true),
        (json!(0), false),
    ] {
        let m = adapters(json!([{"name": "a", "source": {"uri": "hf://org/a"}, "scale": scale}]));
        let errors = cel_errors(&crd, &m, None);
        assert_eq!(errors.is_empty(), ok, "scale {scale}: {errors:?}");
        if !ok {
            assert!(
                errors
                    .iter()
                    .any(|e| e.contains("scale must be greater than 0")),
                "{errors:?}"
            );
        }
    }
    // The schema half: a list map keyed by name (one entry per name), at most 64 entries, and
    // a scale within [0, 16] (the rule above excludes 0).
    let schema = generate::schema_of(&crd);
    let list = &schema["properties"]["spec"]["properties"]["adapters"];
    assert_eq!(
        (
            &list["x-kubernetes-list-type"],
            &list["x-kubernetes-list-map-keys"],
            &list["maxItems"]
        ),
        (&json!("map"), &json!(["name"]), &json!(64))
    );
    let scale = &list["items"]["properties"]["scale"];
    assert_eq!(
        (&scale["minimum"], &scale["maximum"]),
        (&json!(0.0), &json!(16.0))
    );
}
