//! OpenAI surface, validation of what shapes the output (part of `validate`, before the model is
//! looked up): `response_format`, `tools` / `tool_choice` / `parallel_tool_calls` and the
//! vLLM-style extras become one [`OutputSpec`].
//!
//! Everything checkable without the model is checked here, each refusal naming its field;
//! whether a schema's keywords are supported is llguidance's call, made when the grammar is
//! compiled against the model's vocabulary (`constraint.rs`), and names the same field.

use serde_json::{Value, json};

use crate::error::ApiError;
use crate::grammar::{ConstraintRequest, GrammarSpec, STRICT_FRACTION_DIGITS};

mod strict;
mod tools;
pub use strict::close_objects;
use tools::{calls_schema, tool_choice, tools};

/// The vLLM-compatible constraint fields of a request body (`guided_*`, and the newer
/// `structured_outputs` object).
#[derive(Clone, Debug, Default)]
pub struct Extras<'a> {
    pub guided_json: Option<&'a Value>,
    pub guided_regex: Option<&'a Value>,
    pub guided_choice: Option<&'a Value>,
    pub guided_grammar: Option<&'a Value>,
    pub structured_outputs: Option<&'a Value>,
}

/// How the reply's tool calls are produced and read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools, or `tool_choice: "none"`: the reply is text.
    Off,
    /// `tool_choice: "auto"` (the default with tools): the model may write its family's
    /// tool-call syntax, which the reply parses.
    Auto,
    /// A named function: the output is constrained to that function's arguments.
    Named(String),
    /// `tool_choice: "required"`: the output is constrained to a list of calls.
    Required,
}

/// What validation decided about the output.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputSpec {
    pub constraint: Option<ConstraintRequest>,
    pub tools: ToolMode,
}

fn invalid(field: impl Into<String>, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(field, msg)
}

/// `response_format`: `text`, `json_object` or `json_schema`.
fn response_format(v: Option<&Value>) -> Result<Option<ConstraintRequest>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        invalid(
            "response_format.type",
            "`response_format` must be an object with a `type`: \"text\", \"json_object\" or \"json_schema\"",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(ConstraintRequest {
            spec: GrammarSpec::JsonObject,
            fraction_digits: None,
            field: "response_format".into(),
        })),
        "json_schema" => {
            let js = v
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    invalid(
                        "response_format.json_schema",
                        "`response_format.json_schema` must be an object with `name` and `schema`",
                    )
                })?;
            match js.get("name") {
                Some(Value::String(n)) if valid_name(n) => {}
                _ => {
                    return Err(invalid(
                        "response_format.json_schema.name",
                        "`response_format.json_schema.name` must be 1 to 64 characters of a-z, A-Z, 0-9, `_` or `-`",
                    ));
                }
            }
            if let Some(strict) = js.get("strict")
                && !strict.is_boolean()
                && !strict.is_null()
            {
                return Err(invalid(
                    "response_format.json_schema.strict",
                    "`response_format.json_schema.strict` must be a boolean",
                ));
            }
            let field = "response_format.json_schema.schema";
            let schema = match js.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                // OpenAI treats a missing schema as "any JSON".
                None | Some(Value::Null) => json!({}),
                Some(_) => {
                    return Err(invalid(
                        field,
                        format!("`{field}` must be a JSON Schema object"),
                    ));
                }
            };
            check_schema_shape(&schema, field)?;
            let mut schema = schema;
            // Strict unless the request says `strict: false` (see `strict.rs`).
            let strict = js.get("strict") != Some(&Value::Bool(false));
            if strict {
                close_objects(&mut schema);
            }
            Ok(Some(ConstraintRequest {
                spec: GrammarSpec::JsonSchema(schema),
                fraction_digits: strict.then_some(STRICT_FRACTION_DIGITS),
                field: field.into(),
            }))
        }
        other => Err(invalid(
            "response_format.type",
            format!(
                "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\", got {other:?}"
            ),
        )),
    }
}

/// A function or schema name as OpenAI allows it.
fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The structural mistakes llguidance would report less clearly: keywords of the wrong JSON
/// type (`"type": 5`, `"properties": []`), checked through the whole schema.
fn check_schema_shape(schema: &Value, field: &str) -> Result<(), ApiError> {
    fn walk(v: &Value, path: &str, field: &str) -> Result<(), ApiError> {
        let Some(obj) = v.as_object() else {
            return if v.is_boolean() {
                Ok(())
            } else {
                Err(invalid(
                    field,
                    format!("`{field}`: the schema at {path} must be an object or a boolean"),
                ))
            };
        };
        let bad = |k: &str, want: &str| {
            Err(invalid(
                field,
                format!("`{field}`: `{k}` at {path} must be {want}"),
            ))
        };
        for (k, val) in obj {
            // Each keyword with the JSON type it must have, and how a refusal says so.
            let (ok, want) = match k.as_str() {
                "type" => (
                    match val {
                        Value::String(_) => true,
                        Value::Array(a) => a.iter().all(Value::is_string),
                        _ => false,
                    },
                    "a type name or a list of them",
                ),
                "properties" | "$defs" | "definitions" | "patternProperties" => {
                    (val.is_object(), "an object")
                }
                "required" | "enum" | "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                    (val.is_array(), "an array")
                }
                "items" | "additionalProperties" | "not" => {
                    (val.is_object() || val.is_boolean(), "a schema")
                }
                "minItems" | "maxItems" | "minLength" | "maxLength" | "minProperties"
                | "maxProperties" => (val.as_u64().is_some(), "a non-negative integer"),
                "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" | "multipleOf" => {
                    (val.is_number(), "a number")
                }
                "pattern" | "format" | "$ref" => (val.is_string(), "a string"),
                _ => (true, ""),
            };
            if !ok {
                return bad(k, want);
            }
            match (k.as_str(), val) {
                (
                    "properties" | "$defs" | "definitions" | "patternProperties",
                    Value::Object(m),
                ) => {
                    for (name, sub) in m {
                        walk(sub, &format!("{path}/{k}/{name}"), field)?;
                    }
                }
                ("anyOf" | "oneOf" | "allOf" | "prefixItems", Value::Array(a)) => {
                    for (i, sub) in a.iter().enumerate() {
                        walk(sub, &format!("{path}/{k}/{i}"), field)?;
                    }
                }
                ("items" | "additionalProperties" | "not", sub) => {
                    walk(sub, &format!("{path}/{k}"), field)?;
                }
                _ => {}
            }
        }
        Ok(())
    }
    walk(schema, "#", field)
}

/// The vLLM-style extras; at most one of them.
fn extras(x: &Extras<'_>) -> Result<Option<ConstraintRequest>, ApiError> {
    let mut found: Vec<ConstraintRequest> = Vec::new();
    let mut one = |field: &str, v: Option<&Value>| -> Result<(), ApiError> {
        if let Some(v) = v.filter(|v| !v.is_null()) {
            found.push(extra(field, v)?);
        }
        Ok(())
    };
    one("guided_json", x.guided_json)?;
    one("guided_regex", x.guided_regex)?;
    one("guided_choice", x.guided_choice)?;
    one("guided_grammar", x.guided_grammar)?;
    if let Some(so) = x.structured_outputs.filter(|v| !v.is_null()) {
        let obj = so.as_object().ok_or_else(|| {
            invalid(
                "structured_outputs",
                "`structured_outputs` must be an object",
            )
        })?;
        for (k, v) in obj {
            match k.as_str() {
                "json" | "regex" | "choice" | "grammar" => {
                    one(&format!("structured_outputs.{k}"), Some(v))?;
                }
                other => {
                    return Err(ApiError::unsupported(
                        format!("structured_outputs.{other}"),
                        format!(
                            "`structured_outputs.{other}` is not supported; use json, regex, choice or grammar"
                        ),
                    ));
                }
            }
        }
    }
    if found.len() > 1 {
        return Err(invalid(
            found[1].field.clone(),
            format!(
                "give one output constraint per request; got `{}` and `{}`",
                found[0].field, found[1].field
            ),
        ));
    }
    Ok(found.pop())
}

fn extra(field: &str, v: &Value) -> Result<ConstraintRequest, ApiError> {
    let kind = field.rsplit(['_', '.']).next().unwrap_or(field);
    let spec = match (kind, v) {
        ("json", Value::String(s)) => {
            let mut schema: Value = serde_json::from_str(s)
                .map_err(|e| invalid(field, format!("`{field}` is not valid JSON: {e}")))?;
            check_schema_shape(&schema, field)?;
            // Strict, as vLLM's default backend reads a schema (see `strict.rs`); a schema
            // opens an object by saying `additionalProperties`.
            close_objects(&mut schema);
            GrammarSpec::JsonSchema(schema)
        }
        ("json", s @ (Value::Object(_) | Value::Bool(_))) => {
            check_schema_shape(s, field)?;
            let mut schema = s.clone();
            close_objects(&mut schema);
            GrammarSpec::JsonSchema(schema)
        }
        ("regex", Value::String(rx)) if !rx.is_empty() => GrammarSpec::Regex(rx.clone()),
        ("grammar", Value::String(g)) if !g.trim().is_empty() => GrammarSpec::Lark(g.clone()),
        ("choice", Value::Array(a)) if !a.is_empty() => GrammarSpec::Choice(
            a.iter()
                .map(|c| {
                    c.as_str()
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .ok_or_else(|| {
                            invalid(
                                field,
                                format!("`{field}` must be a list of non-empty strings"),
                            )
                        })
                })
                .collect::<Result<_, _>>()?,
        ),
        _ => {
            let want = match kind {
                "json" => "a JSON Schema (object or JSON text)",
                "choice" => "a non-empty list of strings",
                "grammar" => "a Lark grammar (non-empty string)",
                _ => "a non-empty regular expression",
            };
            return Err(invalid(field, format!("`{field}` must be {want}")));
        }
    };
    Ok(ConstraintRequest {
        // The vLLM-style JSON extras are always strict (see `strict.rs`).
        fraction_digits: matches!(spec, GrammarSpec::JsonSchema(_))
            .then_some(STRICT_FRACTION_DIGITS),
        spec,
        field: field.into(),
    })
}

/// The output of a chat request: its constraint (from `response_format`, an extra or a forced
/// tool call) and its tool mode.
pub fn chat_output(
    response_format_v: Option<&Value>,
    x: &Extras<'_>,
    tools_v: Option<&[Value]>,
    tool_choice_v: Option<&Value>,
    parallel_tool_calls: Option<bool>,
) -> Result<OutputSpec, ApiError> {
    let format = response_format(response_format_v)?;
    let extra = extras(x)?;
    if let (Some(a), Some(b)) = (&format, &extra) {
        return Err(invalid(
            b.field.clone(),
            format!(
                "give one output constraint per request; got `{}` and `{}`",
                a.field, b.field
            ),
        ));
    }
    let declared = tools(tools_v)?;
    let mode = tool_choice(tool_choice_v, &declared)?;
    // A forced call is strict when every tool it may call is (see `strict.rs`).
    let forced = match &mode {
        ToolMode::Named(n) => declared
            .iter()
            .find(|t| t.name == *n)
            .map(|t| (GrammarSpec::JsonSchema(t.params.clone()), t.strict)),
        ToolMode::Required => Some((
            GrammarSpec::JsonSchema(calls_schema(&declared, parallel_tool_calls.unwrap_or(true))),
            declared.iter().all(|t| t.strict),
        )),
        ToolMode::Off | ToolMode::Auto => None,
    };
    let constraint = match (forced, format.or(extra)) {
        (Some(_), Some(other)) => {
            return Err(invalid(
                other.field.clone(),
                format!(
                    "`tool_choice` forces a tool call, so `{}` cannot also constrain the output",
                    other.field
                ),
            ));
        }
        (Some((spec, strict)), None) => Some(ConstraintRequest {
            spec,
            fraction_digits: strict.then_some(STRICT_FRACTION_DIGITS),
            field: match &mode {
                ToolMode::Named(n) => {
                    let i = declared.iter().position(|t| t.name == *n).unwrap_or(0);
                    format!("tools[{i}].function.parameters")
                }
                _ => "tools".into(),
            },
        }),
        (None, c) => c,
    };
    Ok(OutputSpec {
        constraint,
        tools: mode,
    })
}

/// The output constraint of a legacy completion: `response_format` or an extra.
pub fn completion_output(
    response_format_v: Option<&Value>,
    x: &Extras<'_>,
) -> Result<Option<ConstraintRequest>, ApiError> {
    chat_output(response_format_v, x, None, None, None).map(|o| o.constraint)
}

#[cfg(test)]
mod tests;
