//! Tool calls, reading finished calls out of JSON values (`{"name", "arguments"}` objects, Mistral
//! arrays and `name[ARGS]` heads).

use serde_json::Value;

use super::*;

/// `{"name": …, "arguments"|"parameters": …}` written as text.
pub(super) fn call_from_text(text: &str) -> Option<Call> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    call_from_value(&value)
}

pub(super) fn call_from_value(value: &Value) -> Option<Call> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let arguments = object.get("arguments").or_else(|| object.get("parameters"));
    Some((name.to_owned(), arguments_text(arguments)?))
}

/// Arguments as compact JSON object text: an object as it is, a string that
/// holds an object decoded, none at all as `{}`.
pub(super) fn arguments_text(arguments: Option<&Value>) -> Option<String> {
    match arguments {
        None | Some(Value::Null) => Some("{}".to_owned()),
        Some(object @ Value::Object(_)) => Some(object.to_string()),
        Some(Value::String(text)) => object_text(text),
        Some(_) => None,
    }
}

/// `text` re-serialised compactly when it is a JSON object.
pub(super) fn object_text(text: &str) -> Option<String> {
    match serde_json::from_str(text.trim()).ok()? {
        object @ Value::Object(_) => Some(object.to_string()),
        _ => None,
    }
}

/// A Mistral v3 array `[{"name": …, "arguments": {…}}, …]`; every element must be a call.
pub(super) fn calls_from_array(text: &str) -> Option<Vec<Call>> {
    match serde_json::from_str(text).ok()? {
        Value::Array(items) if !items.is_empty() => items.iter().map(call_from_value).collect(),
        _ => None,
    }
}

pub(super) fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

pub(super) fn leading_len(text: &str, keep: impl Fn(char) -> bool) -> usize {
    text.find(|c| !keep(c)).unwrap_or(text.len())
}

/// How far a Mistral v11 call head (`name[ARGS]`, `name[CALL_ID]id[ARGS]`,
/// or `name` directly followed by `{`) has come.
pub(super) enum Head {
    Partial,
    Invalid,
    Complete { name_end: usize, args_at: usize },
}

pub(super) fn v11_head(text: &str) -> Head {
    let name_end = leading_len(text, is_name_char);
    if name_end == 0 {
        return if text.is_empty() {
            Head::Partial
        } else {
            Head::Invalid
        };
    }
    let rest = &text[name_end..];
    if let Some(id_and_rest) = rest.strip_prefix(MISTRAL_CALL_ID) {
        let id_len = leading_len(id_and_rest, |c| c.is_ascii_alphanumeric());
        return mistral_args_marker(text, name_end, name_end + MISTRAL_CALL_ID.len() + id_len);
    }
    if !rest.is_empty() && MISTRAL_CALL_ID.starts_with(rest) {
        return Head::Partial;
    }
    mistral_args_marker(text, name_end, name_end)
}

/// The `[ARGS]` (or a bare `{`) expected at `text[at..]`.
pub(super) fn mistral_args_marker(text: &str, name_end: usize, at: usize) -> Head {
    let rest = &text[at..];
    if rest.starts_with(MISTRAL_ARGS) {
        Head::Complete {
            name_end,
            args_at: at + MISTRAL_ARGS.len(),
        }
    } else if rest.starts_with('{') {
        Head::Complete {
            name_end,
            args_at: at,
        }
    } else if MISTRAL_ARGS.starts_with(rest) {
        Head::Partial
    } else {
        Head::Invalid
    }
}
