//! Native engine, load step 1 (under [`super::parse()`]): typed access to the fields of
//! `config.json`, and the two errors a config can earn: `MODEL_CORRUPT` for a missing or
//! mistyped field, `UNSUPPORTED` for an option this engine does not implement. Every message
//! names `config.json` and the field.

use gantry_engine_abi::{EngineError, Status};
use serde_json::{Map, Value};

pub(super) fn unsupported(msg: impl Into<String>) -> EngineError {
    EngineError::new(Status::Unsupported, msg.into())
}

pub(super) fn corrupt(msg: impl Into<String>) -> EngineError {
    EngineError::new(Status::ModelCorrupt, msg.into())
}

/// Typed access to one JSON object, with errors naming `config.json` and the field.
pub(super) struct Fields<'a> {
    pub(super) obj: &'a Map<String, Value>,
    pub(super) prefix: &'a str,
}

impl Fields<'_> {
    pub(super) fn name(&self, key: &str) -> String {
        format!("config.json `{}{key}`", self.prefix)
    }

    pub(super) fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn usize(&self, key: &str) -> Result<Option<usize>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|n| *n > 0 && *n <= (1 << 31))
                .map(|n| Some(n as usize))
                .ok_or_else(|| {
                    corrupt(format!(
                        "{} must be a positive integer, got {v}",
                        self.name(key)
                    ))
                }),
        }
    }

    pub(super) fn req_usize(&self, key: &str) -> Result<usize, EngineError> {
        self.usize(key)?
            .ok_or_else(|| corrupt(format!("{} is missing", self.name(key))))
    }

    pub(super) fn f64(&self, key: &str) -> Result<Option<f64>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .map(Some)
                .ok_or_else(|| corrupt(format!("{} must be a number, got {v}", self.name(key)))),
        }
    }

    pub(super) fn bool(&self, key: &str) -> Result<Option<bool>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(corrupt(format!(
                "{} must be true or false, got {v}",
                self.name(key)
            ))),
        }
    }

    pub(super) fn str(&self, key: &str) -> Result<Option<&str>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(corrupt(format!(
                "{} must be a string, got {v}",
                self.name(key)
            ))),
        }
    }

    /// A token id or a list of them (`eos_token_id` is either).
    pub(super) fn token_ids(&self, key: &str) -> Result<Vec<i32>, EngineError> {
        let one = |v: &Value| {
            v.as_i64()
                .and_then(|n| i32::try_from(n).ok())
                .filter(|n| *n >= 0)
                .ok_or_else(|| corrupt(format!("{} must hold token ids, got {v}", self.name(key))))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}
