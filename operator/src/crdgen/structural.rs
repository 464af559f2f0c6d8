//! Custom resources, structural-schema checker: run by `crdgen` before it writes YAML and by the
//! CRD tests, so a schema the apiserver would refuse never reaches `crds/`.
//!
//! Kubernetes only accepts "structural" schemas
//! (<https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/#specifying-a-structural-schema>).
//! No crate implements the apiserver's check in Rust, so the rules that
//! matter for generated schemas are written out here, one per branch, each
//! reported with the JSON path of the offending node.

use serde_json::{Map, Value};

/// One rule broken at one place in the schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// JSON-pointer-like path of the schema node, e.g. `.properties.spec.properties.source`.
    pub path: String,
    pub rule: &'static str,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {}",
            if self.path.is_empty() {
                "."
            } else {
                &self.path
            },
            self.rule
        )
    }
}

const TYPES: [&str; 6] = ["object", "array", "string", "integer", "number", "boolean"];
/// Keys a value-validation junctor (`anyOf`, `oneOf`, `allOf`, `not`) must not set.
const FORBIDDEN_IN_JUNCTOR: [&str; 5] = [
    "type",
    "description",
    "default",
    "additionalProperties",
    "nullable",
];
const JUNCTORS: [&str; 4] = ["anyOf", "oneOf", "allOf", "not"];

/// Check an `openAPIV3Schema`; an empty result means structural.
pub fn check(schema: &Value) -> Vec<Violation> {
    let mut out = Vec::new();
    match schema.as_object() {
        Some(root) => {
            if root.get("type").and_then(Value::as_str) != Some("object") {
                push(&mut out, "", "the root must have type: object");
            }
            check_metadata(root, &mut out);
            check_node(root, "", &mut out);
        }
        None => push(&mut out, "", "the schema must be an object"),
    }
    out
}

fn push(out: &mut Vec<Violation>, path: &str, rule: &'static str) {
    out.push(Violation {
        path: path.to_string(),
        rule,
    });
}

fn flag(node: &Map<String, Value>, key: &str) -> bool {
    node.get(key).and_then(Value::as_bool) == Some(true)
}

/// A node that specifies structure: under `properties`, `items` or `additionalProperties`.
///
/// Rule 1 (a type everywhere) is checked here; rules 2 and 3 (junctor contents) in
/// [`check_junctor_branch`]; list-map keys and `metadata` have their own functions.
fn check_node(node: &Map<String, Value>, path: &str, out: &mut Vec<Violation>) {
    let int_or_string = flag(node, "x-kubernetes-int-or-string");
    let preserve = flag(node, "x-kubernetes-preserve-unknown-fields");
    match node.get("type") {
        Some(Value::String(t)) if TYPES.contains(&t.as_str()) => {}
        Some(_) => push(
            out,
            path,
            "type must be one of object, array, string, integer, number, boolean",
        ),
        None if int_or_string || preserve => {}
        None => push(
            out,
            path,
            "every node needs a type (unless x-kubernetes-int-or-string or x-kubernetes-preserve-unknown-fields)",
        ),
    }
    if flag(node, "nullable") && !node.contains_key("type") {
        push(out, path, "nullable without a type");
    }
    for key in ["$ref", "$schema", "definitions", "$defs"] {
        if node.contains_key(key) {
            push(
                out,
                path,
                "references and definitions are not allowed; inline every subschema",
            );
        }
    }
    if flag(node, "uniqueItems") {
        push(out, path, "uniqueItems: true is not allowed");
    }
    if node.get("additionalProperties") == Some(&Value::Bool(false)) {
        push(out, path, "additionalProperties: false is not allowed");
    }
    if node.contains_key("properties") && node.contains_key("additionalProperties") {
        push(
            out,
            path,
            "properties and additionalProperties are mutually exclusive",
        );
    }
    if let Some(props) = node.get("properties") {
        match props.as_object() {
            Some(props) => {
                for (name, child) in props {
                    let child_path = format!("{path}.properties.{name}");
                    match child.as_object() {
                        Some(child) => check_node(child, &child_path, out),
                        None => push(out, &child_path, "a property schema must be an object"),
                    }
                }
            }
            None => push(out, path, "properties must be an object"),
        }
    }
    match node.get("items") {
        Some(Value::Object(items)) => check_node(items, &format!("{path}.items"), out),
        Some(_) => push(out, path, "items must be a single schema"),
        None if node.get("type").and_then(Value::as_str) == Some("array") => {
            push(out, path, "an array needs items")
        }
        None => {}
    }
    if let Some(Value::Object(ap)) = node.get("additionalProperties") {
        check_node(ap, &format!("{path}.additionalProperties"), out);
    }
    check_list_type(node, path, out);
    for junctor in JUNCTORS {
        if let Some(j) = node.get(junctor) {
            if int_or_string && is_int_or_string_any_of(junctor, j) {
                continue;
            }
            let branches: Vec<&Value> = match j {
                Value::Array(a) => a.iter().collect(),
                other => vec![other],
            };
            for (i, b) in branches.into_iter().enumerate() {
                let jpath = format!("{path}.{junctor}[{i}]");
                match b.as_object() {
                    Some(b) => check_junctor_branch(b, node, &jpath, out),
                    None => push(out, &jpath, "a junctor branch must be an object"),
                }
            }
        }
    }
}

/// `anyOf: [{type: integer}, {type: string}]` (or that inside `allOf`), the int-or-string exception.
/// It is the only place a junctor may name types, and only under `x-kubernetes-int-or-string`.
fn is_int_or_string_any_of(junctor: &str, value: &Value) -> bool {
    let bare = |v: &Value, t: &str| {
        v.as_object().is_some_and(|o| {
            o.get("type").and_then(Value::as_str) == Some(t)
                && o.keys().all(|k| k == "type" || k == "format")
        })
    };
    match (junctor, value) {
        ("anyOf", Value::Array(a)) => {
            a.len() == 2 && bare(&a[0], "integer") && bare(&a[1], "string")
        }
        ("allOf", Value::Array(a)) => a.iter().any(|b| {
            b.get("anyOf")
                .is_some_and(|inner| is_int_or_string_any_of("anyOf", inner))
        }),
        _ => false,
    }
}

/// Inside a junctor only value validations are allowed, and every field or item it mentions
/// must also be specified outside it.
fn check_junctor_branch(
    branch: &Map<String, Value>,
    outside: &Map<String, Value>,
    path: &str,
    out: &mut Vec<Violation>,
) {
    for key in FORBIDDEN_IN_JUNCTOR {
        if branch.contains_key(key) {
            push(
                out,
                path,
                "junctors (anyOf/oneOf/allOf/not) may not set type, description, default, additionalProperties or nullable",
            );
            break;
        }
    }
    if let Some(Value::Object(props)) = branch.get("properties") {
        let outer = outside.get("properties").and_then(Value::as_object);
        for name in props.keys() {
            if !outer.is_some_and(|o| o.contains_key(name)) {
                push(
                    out,
                    &format!("{path}.properties.{name}"),
                    "a field inside a junctor must also be specified outside it",
                );
            }
        }
    }
    if branch.contains_key("items") && !outside.contains_key("items") {
        push(
            out,
            path,
            "items inside a junctor must also be specified outside it",
        );
    }
    for junctor in JUNCTORS {
        if let Some(inner) = branch.get(junctor) {
            let inner: Vec<&Value> = match inner {
                Value::Array(a) => a.iter().collect(),
                other => vec![other],
            };
            for (i, b) in inner.into_iter().enumerate() {
                if let Some(b) = b.as_object() {
                    check_junctor_branch(b, outside, &format!("{path}.{junctor}[{i}]"), out);
                }
            }
        }
    }
}

/// `x-kubernetes-list-type: map` needs keys, and each key must be a required scalar of the items.
fn check_list_type(node: &Map<String, Value>, path: &str, out: &mut Vec<Violation>) {
    let Some(list_type) = node.get("x-kubernetes-list-type").and_then(Value::as_str) else {
        return;
    };
    if node.get("type").and_then(Value::as_str) != Some("array") {
        push(out, path, "x-kubernetes-list-type only applies to arrays");
    }
    if list_type != "map" {
        return;
    }
    let keys: Vec<&str> = node
        .get("x-kubernetes-list-map-keys")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if keys.is_empty() {
        push(
            out,
            path,
            "x-kubernetes-list-type: map needs x-kubernetes-list-map-keys",
        );
    }
    let items = node.get("items").and_then(Value::as_object);
    let required: Vec<&str> = items
        .and_then(|i| i.get("required"))
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for key in keys {
        // The apiserver needs the key to identify an item, so it must always be present.
        let defaulted = items
            .and_then(|i| i.get("properties"))
            .and_then(|p| p.get(key))
            .is_some_and(|k| k.get("default").is_some());
        if !required.contains(&key) && !defaulted {
            push(
                out,
                path,
                "every list-map key must be required or defaulted",
            );
        }
    }
}

/// `metadata` may only restrict `name` and `generateName`.
fn check_metadata(root: &Map<String, Value>, out: &mut Vec<Violation>) {
    let Some(meta) = root.get("properties").and_then(|p| p.get("metadata")) else {
        return;
    };
    let Some(meta) = meta.as_object() else {
        return;
    };
    for key in meta.keys() {
        if !["type", "properties"].contains(&key.as_str()) {
            push(
                out,
                ".properties.metadata",
                "metadata may only restrict name and generateName",
            );
        }
    }
    if let Some(Value::Object(props)) = meta.get("properties") {
        for name in props.keys() {
            if name != "name" && name != "generateName" {
                push(
                    out,
                    ".properties.metadata",
                    "metadata may only restrict name and generateName",
                );
            }
        }
    }
}
