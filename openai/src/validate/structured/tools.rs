//! OpenAI surface, validation of what shapes the output: the declared `tools`, `tool_choice`
//! against them, and the schema a forced call is generated under (part of `structured`, which
//! turns a forced call into the request's constraint).

use serde_json::{Map, Value, json};

use super::{ToolMode, check_schema_shape, close_objects, invalid, valid_name};
use crate::error::ApiError;

/// A declared tool: its name, its parameter schema (closed when strict) and whether it is
/// strict (unless `strict: false`).
pub(super) struct Tool {
    pub(super) name: String,
    pub(super) params: Value,
    pub(super) strict: bool,
}

/// `tools`: each `{"type": "function", "function": {"name", "description"?, "parameters"?}}`.
pub(super) fn tools(sent: Option<&[Value]>) -> Result<Vec<Tool>, ApiError> {
    let mut out: Vec<Tool> = Vec::new();
    for (i, t) in sent.unwrap_or_default().iter().enumerate() {
        let kind = t.get("type").and_then(Value::as_str);
        if kind != Some("function") {
            return Err(invalid(
                format!("tools[{i}].type"),
                format!("`tools[{i}].type` must be \"function\", got {kind:?}"),
            ));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                invalid(
                    format!("tools[{i}].function"),
                    format!("`tools[{i}].function` must be an object"),
                )
            })?;
        let name = match f.get("name") {
            Some(Value::String(n)) if valid_name(n) => n.clone(),
            _ => {
                return Err(invalid(
                    format!("tools[{i}].function.name"),
                    format!(
                        "`tools[{i}].function.name` is required: 1 to 64 characters of a-z, A-Z, 0-9, `_` or `-`"
                    ),
                ));
            }
        };
        if out.iter().any(|t| t.name == name) {
            return Err(invalid(
                format!("tools[{i}].function.name"),
                format!(
                    "`tools[{i}].function.name` {name:?} is already the name of an earlier tool"
                ),
            ));
        }
        let field = format!("tools[{i}].function.parameters");
        let params = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(invalid(
                    &field,
                    format!("`{field}` must be a JSON Schema object"),
                ));
            }
        };
        check_schema_shape(&params, &field)?;
        let mut params = params;
        let strict = match f.get("strict") {
            // Strict unless the tool says `strict: false` (see `strict.rs`).
            None | Some(Value::Null) | Some(Value::Bool(true)) => {
                close_objects(&mut params);
                true
            }
            Some(Value::Bool(false)) => false,
            Some(_) => {
                return Err(invalid(
                    format!("tools[{i}].function.strict"),
                    format!("`tools[{i}].function.strict` must be a boolean"),
                ));
            }
        };
        out.push(Tool {
            name,
            params,
            strict,
        });
    }
    Ok(out)
}

/// `tool_choice` against the tools sent.
pub(super) fn tool_choice(choice: Option<&Value>, names: &[Tool]) -> Result<ToolMode, ApiError> {
    let field = "tool_choice";
    let mode = match choice.filter(|v| !v.is_null()) {
        None if names.is_empty() => ToolMode::Off,
        None => ToolMode::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolMode::Off,
            "auto" if names.is_empty() => ToolMode::Off,
            "auto" => ToolMode::Auto,
            "required" => ToolMode::Required,
            other => {
                return Err(invalid(
                    field,
                    format!(
                        "`tool_choice` must be \"none\", \"auto\", \"required\" or a function, got {other:?}"
                    ),
                ));
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    invalid(field, "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
                })?;
            ToolMode::Named(name.to_string())
        }
        Some(_) => {
            return Err(invalid(
                field,
                "`tool_choice` must be a string or an object",
            ));
        }
    };
    match &mode {
        ToolMode::Required if names.is_empty() => Err(invalid(
            field,
            "`tool_choice` is \"required\", but the request has no `tools`",
        )),
        ToolMode::Named(n) if !names.iter().any(|t| t.name == *n) => Err(invalid(
            field,
            format!(
                "`tool_choice` names the function {n:?}, which is not in `tools` ({})",
                names
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
        _ => Ok(mode),
    }
}

/// The schema of Gantry's forced-call format, `[{"name": ..., "arguments": {...}}, ...]`:
/// one alternative per tool, each tool's `$defs` moved to the root under a prefix so its
/// references still resolve.
pub(super) fn calls_schema(tools: &[Tool], parallel: bool) -> Value {
    let mut defs = Map::new();
    let alternatives: Vec<Value> = tools
        .iter()
        .enumerate()
        .map(|(i, Tool { name, params, .. })| {
            let mut params = params.clone();
            hoist_defs(&mut params, &format!("t{i}_"), &mut defs);
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = json!({
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": alternatives},
    });
    if !parallel {
        schema["maxItems"] = json!(1);
    }
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    schema
}

/// Move `schema`'s `$defs` / `definitions` into `defs` under `prefix`, rewriting the
/// references to them.
fn hoist_defs(schema: &mut Value, prefix: &str, defs: &mut Map<String, Value>) {
    let mut own = Map::new();
    if let Some(obj) = schema.as_object_mut() {
        for key in ["$defs", "definitions"] {
            if let Some(Value::Object(d)) = obj.remove(key) {
                own.extend(d);
            }
        }
    }
    fn rewrite(v: &mut Value, prefix: &str) {
        match v {
            Value::Object(m) => {
                for (k, sub) in m.iter_mut() {
                    if k == "$ref"
                        && let Value::String(r) = sub
                    {
                        for old in ["#/$defs/", "#/definitions/"] {
                            if let Some(rest) = r.strip_prefix(old) {
                                *r = format!("#/$defs/{prefix}{rest}");
                                break;
                            }
                        }
                    } else {
                        rewrite(sub, prefix);
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|x| rewrite(x, prefix)),
            _ => {}
        }
    }
    rewrite(schema, prefix);
    for (k, mut v) in own {
        rewrite(&mut v, prefix);
        defs.insert(format!("{prefix}{k}"), v);
    }
}
