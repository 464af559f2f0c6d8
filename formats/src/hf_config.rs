//! Model metadata (before engine selection): reads a Hugging Face `config.json` without touching
//! the weights.
//!
//! Hugging Face metadata is the source of truth for a safetensors model
//! (seeds 000/001): the first `architectures` class (`LlamaForCausalLM`) is
//! the architecture matched against a plugin's list (the class names the
//! implementation that runs the weights), `model_type` the family, and the trained
//! context length sits under `max_position_embeddings` or one of its older
//! aliases. Multimodal configs keep the language model's settings under
//! `text_config`, which is read when the top level lacks them. The file is
//! untrusted: its size is bounded before parsing, serde_json bounds nesting,
//! and every field is type-checked with an error naming it.

use std::io::Read;
use std::path::Path;

use serde_json::{Map, Value};

/// Real `config.json` files are a few KiB; this leaves room for label maps.
pub const MAX_CONFIG_BYTES: usize = 4 << 20;

/// Keys that hold the trained context length, in the order they are tried:
/// the modern name first, then GPT-2 (`n_positions`, `n_ctx`), ChatGLM and
/// Qwen 1 (`seq_length`), MPT (`max_seq_len`) and others
/// (`max_sequence_length`).
pub const CONTEXT_LENGTH_KEYS: [&str; 6] = [
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "n_ctx",
];

/// The most a context length may claim (tokens); larger is a hostile or broken file.
pub const MAX_CONTEXT_LENGTH: u64 = u32::MAX as u64;

/// Longest `model_type` or class name accepted (real ones are under 64 bytes).
const MAX_NAME_BYTES: usize = 256;
/// Most entries accepted in `architectures` (real files list one).
const MAX_ARCHITECTURES: usize = 64;

/// What the node needs from a `config.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfConfig {
    /// `model_type` (`llama`, `qwen2`, `gemma3_text`, ...): the family.
    pub model_type: String,
    /// `architectures` (`LlamaForCausalLM`, ...); empty when absent. The first one is the
    /// architecture a plugin manifest lists.
    pub architectures: Vec<String>,
    /// The trained context length, when the file states one.
    pub context_length: Option<ContextLength>,
    /// `torch_dtype` (`bfloat16`, ...), when present.
    pub torch_dtype: Option<String>,
}

/// A context length and where it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContextLength {
    pub tokens: u64,
    /// The key it came from, with `text_config.` in front when nested.
    pub key: String,
}

/// Why a `config.json` was refused. Messages name the field and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HfConfigError {
    #[error("config.json is {len} bytes; the limit is {MAX_CONFIG_BYTES} bytes")]
    TooLarge { len: u64 },
    #[error("config.json is not valid JSON: {0}")]
    Json(String),
    #[error("config.json must be a JSON object, got {0}")]
    NotAnObject(&'static str),
    #[error("config.json has no `model_type`")]
    MissingModelType,
    #[error("config.json `{field}` {reason}")]
    Field { field: String, reason: String },
    #[error("cannot read config.json: {0}")]
    Io(String),
}

impl HfConfigError {
    /// Stable label for metrics and status reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            HfConfigError::TooLarge { .. } => "config_too_large",
            HfConfigError::Json(_) => "config_not_json",
            HfConfigError::NotAnObject(_) => "config_not_object",
            HfConfigError::MissingModelType => "config_no_model_type",
            HfConfigError::Field { .. } => "config_invalid_field",
            HfConfigError::Io(_) => "config_unreadable",
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn field_err(field: impl Into<String>, reason: impl Into<String>) -> HfConfigError {
    HfConfigError::Field {
        field: field.into(),
        reason: reason.into(),
    }
}

/// A short, bounded rendering of a value for error messages.
fn shown(v: &Value) -> String {
    let mut s = v.to_string();
    if s.len() > 40 {
        let mut cut = 40;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

fn name(field: &str, v: &Value) -> Result<String, HfConfigError> {
    match v {
        Value::String(s) if s.is_empty() => Err(field_err(field, "must not be empty")),
        Value::String(s) if s.len() > MAX_NAME_BYTES => Err(field_err(
            field,
            format!("must be <= {MAX_NAME_BYTES} bytes, got {}", s.len()),
        )),
        Value::String(s) => Ok(s.clone()),
        other => Err(field_err(
            field,
            format!("must be a string, got {}", kind(other)),
        )),
    }
}

/// The first context-length key present (and not null) in `obj`.
fn context_length(
    obj: &Map<String, Value>,
    prefix: &str,
) -> Result<Option<ContextLength>, HfConfigError> {
    for key in CONTEXT_LENGTH_KEYS {
        let v = match obj.get(key) {
            None | Some(Value::Null) => continue,
            Some(v) => v,
        };
        let field = format!("{prefix}{key}");
        let tokens = match v.as_u64() {
            Some(0) => return Err(field_err(field, "must be >= 1, got 0")),
            Some(n) if n > MAX_CONTEXT_LENGTH => {
                return Err(field_err(
                    field,
                    format!("must be <= {MAX_CONTEXT_LENGTH}, got {n}"),
                ));
            }
            Some(n) => n,
            None => {
                return Err(field_err(
                    field,
                    format!("must be a positive integer, got {}", shown(v)),
                ));
            }
        };
        return Ok(Some(ContextLength { tokens, key: field }));
    }
    Ok(None)
}

/// Parse `config.json` bytes.
pub fn parse(bytes: &[u8]) -> Result<HfConfig, HfConfigError> {
    if bytes.len() > MAX_CONFIG_BYTES {
        return Err(HfConfigError::TooLarge {
            len: bytes.len() as u64,
        });
    }
    // serde_json refuses nesting deeper than 128 levels, so hostile input
    // cannot exhaust the stack here.
    let root: Value =
        serde_json::from_slice(bytes).map_err(|e| HfConfigError::Json(e.to_string()))?;
    let Value::Object(obj) = &root else {
        return Err(HfConfigError::NotAnObject(kind(&root)));
    };
    let model_type = match obj.get("model_type") {
        None | Some(Value::Null) => return Err(HfConfigError::MissingModelType),
        Some(v) => name("model_type", v)?,
    };
    let architectures = match obj.get("architectures") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => {
            if items.len() > MAX_ARCHITECTURES {
                return Err(field_err(
                    "architectures",
                    format!(
                        "must list <= {MAX_ARCHITECTURES} classes, got {}",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| name(&format!("architectures[{i}]"), v))
                .collect::<Result<_, _>>()?
        }
        Some(other) => {
            return Err(field_err(
                "architectures",
                format!("must be an array of strings, got {}", kind(other)),
            ));
        }
    };
    let context_length = match context_length(obj, "")? {
        Some(c) => Some(c),
        None => match obj.get("text_config") {
            Some(Value::Object(text)) => context_length(text, "text_config.")?,
            None | Some(Value::Null) => None,
            Some(other) => {
                return Err(field_err(
                    "text_config",
                    format!("must be an object, got {}", kind(other)),
                ));
            }
        },
    };
    let torch_dtype = match obj.get("torch_dtype") {
        None | Some(Value::Null) => None,
        Some(v) => Some(name("torch_dtype", v)?),
    };
    Ok(HfConfig {
        model_type,
        architectures,
        context_length,
        torch_dtype,
    })
}

/// Read and parse a `config.json` file, refusing oversized files before reading them whole.
pub fn read(path: &Path) -> Result<HfConfig, HfConfigError> {
    let f = std::fs::File::open(path)
        .map_err(|e| HfConfigError::Io(format!("{}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    // One byte over the limit is enough to know the file is too large.
    f.take(MAX_CONFIG_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| HfConfigError::Io(format!("{}: {e}", path.display())))?;
    if bytes.len() > MAX_CONFIG_BYTES {
        let len = std::fs::metadata(path).map_or(bytes.len() as u64, |m| m.len());
        return Err(HfConfigError::TooLarge { len });
    }
    parse(&bytes)
}
