//! OpenAI surface, validation of what shapes the output: strict schemas by default (part of
//! `structured`, before the grammar is compiled).
//!
//! A JSON Schema leaves an object open unless it says `additionalProperties: false`, and a
//! grammar compiled from an open object lets a small model write keys no tool declared, one
//! after another, until `max_tokens`. So, as OpenAI's strict function calling and xgrammar's
//! strict mode do, every object a schema describes is closed unless the schema itself says how
//! other keys are treated (`additionalProperties` or `unevaluatedProperties`, true or a
//! schema). A number or integer without bounds gets I-JSON's (RFC 7493): within ±(2^53 - 1), at
//! most 16 integer digits and no exponent, where a grammar would otherwise admit a digit run of
//! any length; the digits after a decimal point are bounded by the node's mask instead
//! (`ConstraintRequest::fraction_digits`: JSON Schema has no way to say it). A request opts out
//! per schema with `strict: false` (`response_format.json_schema`, `tools[].function`), which
//! keeps the permissive reading.

use serde_json::{Map, Value, json};

/// Whether `obj` describes an object: it lists properties or its type is (or includes) object.
fn is_object_schema(obj: &Map<String, Value>) -> bool {
    obj.contains_key("properties")
        || match obj.get("type") {
            Some(Value::String(t)) => t == "object",
            Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
            _ => false,
        }
}

/// Close every object of `schema` that leaves its other keys unsaid (see the module header).
/// The branches of `allOf` describe parts of one object, so their own level stays as written
/// (closing each would refuse the others' keys); what is inside them is closed. Nothing under
/// `not` changes (closing there would widen what the schema accepts).
pub fn close_objects(schema: &mut Value) {
    close(schema, true);
}

/// The largest integer an I-JSON number holds exactly (2^53 - 1).
const SAFE_INTEGER: i64 = 9_007_199_254_740_991;

/// Whether `obj` describes a number or an integer (alone or among its types).
fn is_numeric_schema(obj: &Map<String, Value>) -> bool {
    let numeric = |t: &Value| t == "integer" || t == "number";
    match obj.get("type") {
        Some(t @ Value::String(_)) => numeric(t),
        Some(Value::Array(ts)) => ts.iter().any(numeric),
        _ => false,
    }
}

fn close(schema: &mut Value, this_level: bool) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    if is_numeric_schema(obj) {
        if !obj.contains_key("minimum") && !obj.contains_key("exclusiveMinimum") {
            obj.insert("minimum".into(), json!(-SAFE_INTEGER));
        }
        if !obj.contains_key("maximum") && !obj.contains_key("exclusiveMaximum") {
            obj.insert("maximum".into(), json!(SAFE_INTEGER));
        }
    }
    if this_level
        && is_object_schema(obj)
        && !obj.contains_key("additionalProperties")
        && !obj.contains_key("unevaluatedProperties")
    {
        obj.insert("additionalProperties".into(), json!(false));
    }
    for (key, sub) in obj.iter_mut() {
        match key.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Some(m) = sub.as_object_mut() {
                    m.values_mut().for_each(|s| close(s, true));
                }
            }
            "items"
            | "additionalProperties"
            | "unevaluatedProperties"
            | "contains"
            | "if"
            | "then"
            | "else"
            | "additionalItems" => match sub {
                Value::Array(a) => a.iter_mut().for_each(|s| close(s, true)),
                s => close(s, true),
            },
            "prefixItems" | "anyOf" | "oneOf" => {
                if let Some(a) = sub.as_array_mut() {
                    a.iter_mut().for_each(|s| close(s, true));
                }
            }
            "allOf" => {
                if let Some(a) = sub.as_array_mut() {
                    a.iter_mut().for_each(|s| close(s, false));
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_object_that_leaves_its_other_keys_unsaid_is_closed() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "b": {"type": "array", "items": {"properties": {"y": {}}}},
                "c": {"anyOf": [{"type": "object"}, {"type": "string"}]},
                "open": {"type": "object", "additionalProperties": true},
                "typed": {"type": "object", "additionalProperties": {"type": "object", "properties": {}}},
                "eval": {"type": "object", "unevaluatedProperties": false},
                "n": {"type": ["object", "null"]}
            },
            "$defs": {"d": {"type": "object", "properties": {"z": {}}}}
        });
        close_objects(&mut s);
        let closed = |p: &str| s.pointer(p).cloned();
        assert_eq!(closed("/additionalProperties"), Some(json!(false)));
        assert_eq!(
            closed("/properties/a/additionalProperties"),
            Some(json!(false))
        );
        assert_eq!(
            closed("/properties/b/items/additionalProperties"),
            Some(json!(false))
        );
        assert_eq!(
            closed("/properties/c/anyOf/0/additionalProperties"),
            Some(json!(false))
        );
        assert_eq!(
            closed("/properties/c/anyOf/1/additionalProperties"),
            None,
            "a string"
        );
        assert_eq!(
            closed("/properties/open/additionalProperties"),
            Some(json!(true)),
            "said: kept"
        );
        // A schema for the other keys is kept, and objects inside it are closed.
        assert_eq!(
            closed("/properties/typed/additionalProperties/additionalProperties"),
            Some(json!(false))
        );
        assert_eq!(closed("/properties/eval/additionalProperties"), None);
        assert_eq!(
            closed("/properties/n/additionalProperties"),
            Some(json!(false))
        );
        assert_eq!(closed("/$defs/d/additionalProperties"), Some(json!(false)));
    }

    #[test]
    fn numbers_without_bounds_get_i_json_bounds_and_said_bounds_stay() {
        let mut s = json!({"properties": {
            "n": {"type": "integer"},
            "m": {"type": ["integer", "null"], "minimum": 0},
            "x": {"type": "integer", "exclusiveMaximum": 10},
            "f": {"type": "number"},
            "g": {"type": ["number", "string"], "exclusiveMinimum": 0},
            "s": {"type": "string"}
        }});
        close_objects(&mut s);
        assert_eq!(
            s.pointer("/properties/n/minimum"),
            Some(&json!(-SAFE_INTEGER))
        );
        assert_eq!(
            s.pointer("/properties/n/maximum"),
            Some(&json!(SAFE_INTEGER))
        );
        assert_eq!(s.pointer("/properties/m/minimum"), Some(&json!(0)));
        assert_eq!(
            s.pointer("/properties/m/maximum"),
            Some(&json!(SAFE_INTEGER))
        );
        assert_eq!(s.pointer("/properties/x/maximum"), None);
        assert_eq!(
            s.pointer("/properties/f/minimum"),
            Some(&json!(-SAFE_INTEGER))
        );
        assert_eq!(
            s.pointer("/properties/f/maximum"),
            Some(&json!(SAFE_INTEGER))
        );
        assert_eq!(s.pointer("/properties/g/minimum"), None, "said: kept");
        assert_eq!(
            s.pointer("/properties/g/maximum"),
            Some(&json!(SAFE_INTEGER))
        );
        assert_eq!(s.pointer("/properties/s/maximum"), None, "not a number");
    }

    #[test]
    fn all_of_branches_stay_open_at_their_level_and_not_is_left_alone() {
        let mut s = json!({
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}},
                {"properties": {"b": {}}}
            ],
            "not": {"type": "object", "properties": {"c": {}}}
        });
        close_objects(&mut s);
        assert_eq!(s.pointer("/allOf/0/additionalProperties"), None);
        assert_eq!(s.pointer("/allOf/1/additionalProperties"), None);
        assert_eq!(
            s.pointer("/allOf/0/properties/a/additionalProperties"),
            Some(&json!(false))
        );
        assert_eq!(s.pointer("/not/additionalProperties"), None);
        // Not an object schema at all: unchanged.
        let mut any = json!({});
        close_objects(&mut any);
        assert_eq!(any, json!({}));
    }
}
