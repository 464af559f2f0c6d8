//! What a request constrains its output to (validation → the node's grammar compiler):
//! structured outputs, forced tool calls and the vLLM-style extras, as data, before the model
//! is known. The node compiles it against the model's vocabulary (`constraint.rs`).

use serde_json::Value;

/// What a request constrains its output to, before the model is known.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// A JSON Schema (`response_format.json_schema.schema`, a tool's parameters, `guided_json`).
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// The whole output matches this regular expression.
    Regex(String),
    /// The output is exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar in llguidance's dialect.
    Lark(String),
}

/// A grammar and the request field that asked for it (named by every refusal).
#[derive(Clone, Debug, PartialEq)]
pub struct ConstraintRequest {
    pub spec: GrammarSpec,
    /// At most this many digits after a number's decimal point, where a strict schema asks
    /// for JSON (`validate/structured/strict.rs`). JSON Schema cannot say it (`multipleOf`
    /// still admits trailing zeros), so the node's constraint enforces it on the mask.
    pub fraction_digits: Option<u32>,
    pub field: String,
}

/// The fraction digits a strict schema's numbers may have: as many as the integer digits
/// I-JSON allows (2^53 - 1 has 16), enough for any value an f64 holds near 1.
pub const STRICT_FRACTION_DIGITS: u32 = 16;
