//! Custom resources, schema helpers: hand-written schema fragments where the derived ones would
//! not validate at admission or would not merge well under server-side apply.

use gantry_api::config::Isolation;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::{Schema, SchemaGenerator, json_schema};

use crate::model::{
    ADAPTER_SERVED_NAMES_RULE, Adapter, AdapterStatus, MAX_ADAPTER_SCALE, MAX_ADAPTERS,
};

/// Kubernetes' quantity grammar (the same pattern controller-gen emits), so that `memory: lots`
/// is refused at admission instead of failing later when the Deployment is applied.
pub const QUANTITY_PATTERN: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// An optional `Quantity` field: int-or-string with the quantity pattern. `nullable: false` is
/// explicit so that kube's `OptionalIntOrString` transform does not add `nullable: true` to a
/// node without a `type` (the field is omitted when unset, never sent as `null`).
pub fn quantity_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": true,
        "nullable": false,
    })
}

/// Every engine isolation mode, in the order the schema lists them.
pub const ISOLATION_MODES: [Isolation; 2] = [Isolation::InProcess, Isolation::Process];

/// An optional `Isolation` field: a plain string enum of [`ISOLATION_MODES`]. The derived
/// schema of an optional enum carries the type's doc in place of the field's, which is what
/// `kubectl explain` should show; the field is omitted when unset, never sent as `null`.
pub fn isolation_schema(_: &mut SchemaGenerator) -> Schema {
    let modes: Vec<&str> = ISOLATION_MODES.iter().map(|m| m.as_str()).collect();
    json_schema!({
        "type": "string",
        "enum": modes,
    })
}

/// `conditions`: a list map keyed by `type`, so server-side apply merges conditions by type
/// rather than replacing the list wholesale.
pub fn conditions_schema(generator: &mut SchemaGenerator) -> Schema {
    let mut schema = generator.subschema_for::<Vec<Condition>>();
    schema.insert("x-kubernetes-list-type".into(), "map".into());
    schema.insert(
        "x-kubernetes-list-map-keys".into(),
        serde_json::json!(["type"]),
    );
    schema
}

/// A list of objects keyed by `name`: server-side apply (and the GitOps tools built on it)
/// merges entries by name, and the apiserver refuses two entries with one name.
fn list_map_by_name(mut schema: Schema) -> Schema {
    schema.insert("x-kubernetes-list-type".into(), "map".into());
    schema.insert(
        "x-kubernetes-list-map-keys".into(),
        serde_json::json!(["name"]),
    );
    schema
}

/// `spec.adapters`: at most [`MAX_ADAPTERS`] entries, a list map keyed by `name`, and no
/// adapter served under another's id (the CEL rule, which the validate step repeats).
pub fn adapter_list_schema(generator: &mut SchemaGenerator) -> Schema {
    let mut schema = list_map_by_name(generator.subschema_for::<Vec<Adapter>>());
    schema.insert("maxItems".into(), MAX_ADAPTERS.into());
    schema.insert(
        "x-kubernetes-validations".into(),
        serde_json::json!([{
            "rule": ADAPTER_SERVED_NAMES_RULE,
            "message": "spec.adapters[].servedName must be unique among the adapters",
        }]),
    );
    schema
}

/// `status.adapters`: a list map keyed by `name`, like `spec.adapters`.
pub fn adapter_status_list_schema(generator: &mut SchemaGenerator) -> Schema {
    let mut schema = list_map_by_name(generator.subschema_for::<Vec<AdapterStatus>>());
    schema.insert("maxItems".into(), MAX_ADAPTERS.into());
    schema
}

/// `spec.adapters[].scale`: `0 < scale <= 16`. The exclusive lower bound is a CEL rule: the
/// OpenAPI v3.0 way (a boolean `exclusiveMinimum` beside `minimum`) is a number in every later
/// JSON Schema draft, so tools that read the schema as one (kubeconform, editors, the chart's
/// admission tests) would refuse the whole CRD.
pub fn adapter_scale_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "number",
        "minimum": 0.0,
        "maximum": MAX_ADAPTER_SCALE,
        "x-kubernetes-validations": [{
            "rule": "self > 0.0",
            "message": "spec.adapters[].scale must be greater than 0",
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_isolation_schema_lists_every_mode_as_serde_spells_it() {
        for mode in ISOLATION_MODES {
            // A new mode does not compile here until it is listed in ISOLATION_MODES.
            match mode {
                Isolation::InProcess | Isolation::Process => {}
            }
            assert_eq!(
                serde_json::to_value(mode).expect("json"),
                serde_json::json!(mode.as_str())
            );
        }
        let schema = isolation_schema(&mut SchemaGenerator::default());
        assert_eq!(
            schema.get("enum"),
            Some(&serde_json::json!(["inProcess", "process"]))
        );
    }
}
