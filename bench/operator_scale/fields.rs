//! Operator scale benchmark (outside the reconcile path), managed fields as an apiserver
//! keeps them: one entry per field manager, operation and subresource, holding the FieldsV1
//! set of what the manager last wrote (list items by their merge keys).

use serde_json::{Map, Value, json};

use crate::apiserver::NOW;

/// The key of a list item in a field set, as the apiserver derives it from the list's merge
/// keys (`name` for containers, volumes, env, ports with a name; `type` for conditions; the
/// port and protocol for unnamed ports); `None` for an atomic list.
fn item_key(item: &Value) -> Option<String> {
    let o = item.as_object()?;
    let key = if let Some(name) = o.get("name") {
        json!({"name": name})
    } else if let Some(t) = o.get("type") {
        json!({"type": t})
    } else if let Some(port) = o.get("containerPort").or_else(|| o.get("port")) {
        let field = if o.contains_key("containerPort") {
            "containerPort"
        } else {
            "port"
        };
        json!({field: port, "protocol": o.get("protocol").cloned().unwrap_or(json!("TCP"))})
    } else if let Some(uid) = o.get("uid") {
        json!({"uid": uid})
    } else {
        return None;
    };
    Some(format!("k:{key}"))
}

/// The FieldsV1 field set of a value: every object key as `f:<key>`, list items by their
/// merge key, a leaf as `{}`.
pub fn fields_v1(v: &Value) -> Value {
    let Value::Object(m) = v else {
        return json!({});
    };
    let mut out = Map::new();
    for (k, child) in m {
        let set = match child {
            Value::Object(o) if !o.is_empty() => {
                let mut set = fields_v1(child);
                set[".".to_string()] = json!({});
                set
            }
            Value::Array(items) if items.iter().all(|i| item_key(i).is_some()) => {
                let mut set = Map::new();
                for item in items {
                    let mut s = fields_v1(item);
                    s[".".to_string()] = json!({});
                    set.insert(item_key(item).unwrap_or_default(), s);
                }
                Value::Object(set)
            }
            _ => json!({}),
        };
        out.insert(format!("f:{k}"), set);
    }
    Value::Object(out)
}

/// The field set a manager claims with `config` (identity and type fields left out, as the
/// apiserver does).
fn claimed(config: &Value) -> Value {
    let mut c = config.clone();
    if let Some(o) = c.as_object_mut() {
        o.remove("apiVersion");
        o.remove("kind");
    }
    if let Some(m) = c.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in [
            "name",
            "namespace",
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "managedFields",
        ] {
            m.remove(k);
        }
        if m.is_empty() {
            c.as_object_mut().map(|o| o.remove("metadata"));
        }
    }
    fields_v1(&c)
}

/// Record that `manager` (with `operation`, on `subresource` or the main resource) now manages
/// the fields of `config`: its entry is replaced, the others stay.
pub fn set_managed(
    obj: &mut Value,
    manager: &str,
    operation: &str,
    sub: Option<&str>,
    config: &Value,
) {
    let api_version = obj["apiVersion"].clone();
    let mut entry = json!({"manager": manager, "operation": operation, "apiVersion": api_version,
        "time": NOW, "fieldsType": "FieldsV1", "fieldsV1": claimed(config)});
    if let Some(sub) = sub {
        entry["subresource"] = json!(sub);
    }
    let entries = obj["metadata"]["managedFields"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let same = |e: &Value| {
        e["manager"] == json!(manager)
            && e["operation"] == json!(operation)
            && e["subresource"].as_str() == sub
    };
    let mut kept: Vec<Value> = entries.into_iter().filter(|e| !same(e)).collect();
    kept.push(entry);
    obj["metadata"]["managedFields"] = Value::Array(kept);
}

/// A controller's status update (`Update` on the status subresource by `manager`): the
/// status replaced and the manager's entry holding it.
pub fn write_status(obj: &mut Value, manager: &str, status: Value) {
    let config = json!({"status": status});
    obj["status"] = status;
    set_managed(obj, manager, "Update", Some("status"), &config);
}
