//! Custom resources, schema helpers: hand-written schema fragments where the derived ones would
//! not validate at admission or would not merge well under server-side apply.

use gantry_api::config::Isolation;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::{Schema, SchemaGenerator, json_schema};

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
