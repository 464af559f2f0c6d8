//! The structural-schema check the CRD generator runs (before any reconcile: `crdgen`), on
//! hand-written schemas.

use gantry_operator::crdgen::structural::check;
use serde_json::Value;
use serde_json::json;

fn rules(schema: Value) -> Vec<&'static str> {
    check(&schema).into_iter().map(|v| v.rule).collect()
}

#[test]
fn a_typed_tree_is_structural() {
    let s = json!({"type": "object", "properties": {
        "a": {"type": "string"},
        "b": {"type": "array", "items": {"type": "integer"}},
        "c": {"type": "object", "additionalProperties": {"type": "string"}},
        "q": {"x-kubernetes-int-or-string": true, "anyOf": [{"type": "integer"}, {"type": "string"}]},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
    }});
    assert_eq!(check(&s), vec![]);
}

#[test]
fn untyped_nodes_and_nullable_without_type_are_reported() {
    let r = rules(json!({"type": "object", "properties": {"a": {"nullable": true}}}));
    assert!(r.iter().any(|r| r.starts_with("every node needs a type")));
    assert!(r.contains(&"nullable without a type"));
}

#[test]
fn types_inside_any_of_are_reported_except_for_int_or_string() {
    let r = rules(json!({"type": "object", "properties": {
        "a": {"type": "string", "anyOf": [{"type": "string"}, {"type": "integer"}]}}}));
    assert!(r.iter().any(|r| r.starts_with("junctors")), "{r:?}");
    let r = rules(json!({"type": "object", "properties": {
        "a": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}));
    assert!(
        r.iter().any(|r| r.starts_with("every node needs a type")),
        "{r:?}"
    );
}

#[test]
fn fields_only_inside_one_of_are_reported() {
    let r = rules(
        json!({"type": "object", "properties": {"a": {"type": "object",
        "properties": {"x": {"type": "string"}},
        "oneOf": [{"required": ["x"]}, {"properties": {"y": {}}}]}}}),
    );
    assert_eq!(
        r,
        vec!["a field inside a junctor must also be specified outside it"]
    );
}

#[test]
fn references_false_additional_properties_and_bad_list_maps_are_reported() {
    let r = rules(json!({"type": "object", "properties": {
        "r": {"$ref": "#/definitions/x", "type": "object"},
        "f": {"type": "object", "additionalProperties": false},
        "l": {"type": "array", "x-kubernetes-list-type": "map", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
    }}));
    assert!(r.contains(&"references and definitions are not allowed; inline every subschema"));
    assert!(r.contains(&"additionalProperties: false is not allowed"));
    assert!(r.contains(&"x-kubernetes-list-type: map needs x-kubernetes-list-map-keys"));
}

#[test]
fn metadata_restrictions_beyond_name_are_reported() {
    let r = rules(
        json!({"type": "object", "properties": {"metadata": {"type": "object",
        "properties": {"labels": {"type": "object"}}}}}),
    );
    assert_eq!(r, vec!["metadata may only restrict name and generateName"]);
}
