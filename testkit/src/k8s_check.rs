//! Manifest checker (outside the request path, used by the chart tests): every object of a
//! multi-document YAML stream must deserialize into its `k8s-openapi` type and serialize back
//! with nothing lost. `k8s-openapi`'s deserializers skip fields they do not know, so a field
//! that vanishes in the round trip is a misspelt or misplaced field that the apiserver would
//! reject (or, worse, silently drop).
//!
//! Custom resources (Model, EnginePlugin, ServiceMonitor, ...) have no `k8s-openapi` type; they
//! are reported as `custom` and validated against their CRD schemas by the Python tests.

use k8s_openapi::api::{apps, autoscaling, core, networking, policy, rbac};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The verdict on one object.
#[derive(Debug, Serialize)]
pub struct Verdict {
    pub api_version: String,
    pub kind: String,
    pub name: String,
    /// `ok`, `invalid` (problems listed) or `custom` (no built-in type; not checked here).
    pub result: &'static str,
    pub problems: Vec<String>,
}

fn round_trip<T: DeserializeOwned + Serialize>(obj: &Value) -> Result<Value, String> {
    let typed: T =
        serde_json::from_value(obj.clone()).map_err(|e| format!("does not deserialize: {e}"))?;
    serde_json::to_value(&typed).map_err(|e| format!("does not serialize: {e}"))
}

/// Paths of `input` that `output` lacks or holds differently. Nulls in the input count as absent.
fn lost(input: &Value, output: &Value, at: &str, out: &mut Vec<String>) {
    match (input, output) {
        (Value::Null, _) => {}
        (Value::Object(i), Value::Object(o)) => {
            for (k, v) in i {
                let path = format!("{at}.{k}");
                match o.get(k) {
                    Some(ov) => lost(v, ov, &path, out),
                    None if v.is_null() => {}
                    None => out.push(format!("unknown field {path}")),
                }
            }
        }
        (Value::Array(i), Value::Array(o)) if i.len() == o.len() => {
            for (n, (a, b)) in i.iter().zip(o).enumerate() {
                lost(a, b, &format!("{at}[{n}]"), out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{at}: {a} became {b}")),
    }
}

/// Check one object (already parsed from YAML).
pub fn check_object(obj: &Value) -> Verdict {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default().to_string();
    let kind = obj["kind"].as_str().unwrap_or_default().to_string();
    let name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let out = match (api_version.as_str(), kind.as_str()) {
        ("v1", "ConfigMap") => Some(round_trip::<core::v1::ConfigMap>(obj)),
        ("v1", "Secret") => Some(round_trip::<core::v1::Secret>(obj)),
        ("v1", "Service") => Some(round_trip::<core::v1::Service>(obj)),
        ("v1", "ServiceAccount") => Some(round_trip::<core::v1::ServiceAccount>(obj)),
        ("v1", "Namespace") => Some(round_trip::<core::v1::Namespace>(obj)),
        ("apps/v1", "Deployment") => Some(round_trip::<apps::v1::Deployment>(obj)),
        ("policy/v1", "PodDisruptionBudget") => {
            Some(round_trip::<policy::v1::PodDisruptionBudget>(obj))
        }
        ("networking.k8s.io/v1", "NetworkPolicy") => {
            Some(round_trip::<networking::v1::NetworkPolicy>(obj))
        }
        ("autoscaling/v2", "HorizontalPodAutoscaler") => {
            Some(round_trip::<autoscaling::v2::HorizontalPodAutoscaler>(obj))
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            Some(round_trip::<rbac::v1::ClusterRole>(obj))
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            Some(round_trip::<rbac::v1::ClusterRoleBinding>(obj))
        }
        ("rbac.authorization.k8s.io/v1", "Role") => Some(round_trip::<rbac::v1::Role>(obj)),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
            Some(round_trip::<rbac::v1::RoleBinding>(obj))
        }
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            Some(round_trip::<CustomResourceDefinition>(obj))
        }
        _ => None,
    };
    let (result, problems) = match out {
        None if api_version.contains('.') && !api_version.ends_with(".k8s.io/v1") => {
            ("custom", Vec::new())
        }
        None => (
            "invalid",
            vec![format!(
                "{api_version} {kind} is not a kind this checker knows"
            )],
        ),
        Some(Err(e)) => ("invalid", vec![e]),
        Some(Ok(back)) => {
            let mut problems = Vec::new();
            lost(obj, &back, "", &mut problems);
            (if problems.is_empty() { "ok" } else { "invalid" }, problems)
        }
    };
    Verdict {
        api_version,
        kind,
        name,
        result,
        problems,
    }
}

/// Check every document of a YAML stream; empty documents are skipped.
pub fn check_stream(yaml: &str) -> Result<Vec<Verdict>, serde_yaml::Error> {
    let mut verdicts = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = Value::deserialize(doc)?;
        if value.is_null() {
            continue;
        }
        verdicts.push(check_object(&value));
    }
    Ok(verdicts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misplaced_field_is_reported_and_a_correct_object_passes() {
        let yaml = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: good}
spec:
  replicas: 1
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      containers: [{name: c, image: x, resources: {limits: {memory: 64Mi}}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: bad}
spec:
  selector: {matchLabels: {a: b}}
  template:
    spec:
      containers: [{name: c, image: x, runAsNonRoot: true}]
---
apiVersion: gantry.dev/v1alpha1
kind: Model
metadata: {name: m}
"#;
        let v = check_stream(yaml).expect("yaml");
        assert_eq!(v[0].result, "ok", "{:?}", v[0].problems);
        assert_eq!(v[1].result, "invalid");
        assert_eq!(
            v[1].problems,
            vec!["unknown field .spec.template.spec.containers[0].runAsNonRoot"]
        );
        assert_eq!(v[2].result, "custom");
    }

    #[test]
    fn a_wrong_type_is_reported() {
        let v = check_stream(
            "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {ports: [{port: http}]}\n",
        )
        .expect("yaml");
        assert_eq!(v[0].result, "invalid");
        assert!(
            v[0].problems[0].contains("does not deserialize"),
            "{:?}",
            v[0].problems
        );
    }
}
