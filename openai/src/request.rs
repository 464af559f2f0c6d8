//! OpenAI surface, wire shapes (first step of a request, in the node's HTTP handlers): OpenAI request bodies as they arrive.
//!
//! Bodies are parsed with `serde_path_to_error`, so a type error names its
//! field. Fields are listed explicitly: a known field Gantry cannot honour is
//! refused by validation, and an unknown one is refused here — never ignored.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// Declares a request struct with the sampling and output fields shared by
/// chat and legacy completions. (A macro rather than `#[serde(flatten)]`,
/// which serde cannot combine with `deny_unknown_fields`.)
macro_rules! request_with_common_fields {
    ($(#[$meta:meta])* pub struct $name:ident { $($body:tt)* }) => {
        $(#[$meta])*
        pub struct $name {
            pub model: String,
            #[serde(default)]
            pub max_tokens: Option<i64>,
            #[serde(default)]
            pub temperature: Option<f64>,
            #[serde(default)]
            pub top_p: Option<f64>,
            #[serde(default)]
            pub n: Option<i64>,
            #[serde(default)]
            pub stream: Option<bool>,
            #[serde(default)]
            pub stream_options: Option<StreamOptions>,
            #[serde(default)]
            pub stop: Option<StopSpec>,
            #[serde(default)]
            pub presence_penalty: Option<f64>,
            #[serde(default)]
            pub frequency_penalty: Option<f64>,
            #[serde(default)]
            pub logit_bias: Option<Map<String, Value>>,
            #[serde(default)]
            pub seed: Option<i64>,
            #[serde(default)]
            pub user: Option<String>,
            // Extensions common among OpenAI-compatible servers (llama-server, vLLM).
            #[serde(default)]
            pub top_k: Option<i64>,
            #[serde(default)]
            pub min_p: Option<f64>,
            #[serde(default)]
            pub repetition_penalty: Option<f64>,
            /// Gantry extension: request deadline in seconds (0 = none, within the model's maximum).
            #[serde(default)]
            pub timeout: Option<f64>,
            /// Gantry extension: `false` opts this request out of speculative decoding.
            #[serde(default)]
            pub speculation: Option<bool>,
            #[serde(default)]
            pub response_format: Option<Value>,
            // vLLM-compatible output constraints (docs/structured-outputs.md).
            #[serde(default)]
            pub guided_json: Option<Value>,
            #[serde(default)]
            pub guided_regex: Option<Value>,
            #[serde(default)]
            pub guided_choice: Option<Value>,
            #[serde(default)]
            pub guided_grammar: Option<Value>,
            #[serde(default)]
            pub structured_outputs: Option<Value>,
            $($body)*
        }

        impl $name {
            /// The shared fields, for validation.
            pub fn common(&self) -> Common<'_> {
                Common {
                    model: &self.model,
                    max_tokens: self.max_tokens,
                    temperature: self.temperature,
                    top_p: self.top_p,
                    n: self.n,
                    stream: self.stream.unwrap_or(false),
                    include_usage: self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
                    stop: self.stop.clone().map(StopSpec::into_vec).unwrap_or_default(),
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    logit_bias: self.logit_bias.as_ref(),
                    seed: self.seed,
                    top_k: self.top_k,
                    min_p: self.min_p,
                    repetition_penalty: self.repetition_penalty,
                    timeout: self.timeout,
                    speculation: self.speculation,
                }
            }

            /// The vLLM-style constraint fields.
            pub fn extras(&self) -> crate::validate::structured::Extras<'_> {
                crate::validate::structured::Extras {
                    guided_json: self.guided_json.as_ref(),
                    guided_regex: self.guided_regex.as_ref(),
                    guided_choice: self.guided_choice.as_ref(),
                    guided_grammar: self.guided_grammar.as_ref(),
                    structured_outputs: self.structured_outputs.as_ref(),
                }
            }
        }
    };
}

/// A borrowed view of the shared fields.
#[derive(Clone, Debug)]
pub struct Common<'a> {
    pub model: &'a str,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub n: Option<i64>,
    pub stream: bool,
    pub include_usage: bool,
    pub stop: Vec<String>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<&'a Map<String, Value>>,
    pub seed: Option<i64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub timeout: Option<f64>,
    pub speculation: Option<bool>,
}

request_with_common_fields! {
    #[derive(Clone, Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct ChatRequest {
    pub messages: Vec<Value>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Extra variables for the chat template (as llama-server and vLLM accept).
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    // Accepted metadata with no effect on generation.
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub service_tier: Option<Value>,
    // Known OpenAI features Gantry refuses explicitly (see validate.rs).
    #[serde(default)]
    pub audio: Option<Value>,
    #[serde(default)]
    pub modalities: Option<Value>,
    #[serde(default)]
    pub prediction: Option<Value>,
    #[serde(default)]
    pub reasoning_effort: Option<Value>,
    #[serde(default)]
    pub web_search_options: Option<Value>,
    #[serde(default)]
    pub functions: Option<Value>,
    #[serde(default)]
    pub function_call: Option<Value>,
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptSpec {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

request_with_common_fields! {
    #[derive(Clone, Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct CompletionRequest {
    pub prompt: PromptSpec,
    /// Legacy: number of alternatives (0..=20 here; OpenAI allows 5).
    #[serde(default)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub best_of: Option<i64>,
    #[serde(default)]
    pub suffix: Option<String>,
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    pub model: String,
    pub input: EmbeddingInput,
    #[serde(default)]
    pub encoding_format: Option<String>,
    #[serde(default)]
    pub dimensions: Option<i64>,
    #[serde(default)]
    pub user: Option<String>,
}

/// `POST /v1/audio/speech`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeechRequest {
    pub model: String,
    pub input: String,
    #[serde(default)]
    pub voice: Option<String>,
    #[serde(default)]
    pub response_format: Option<String>,
    #[serde(default)]
    pub speed: Option<f64>,
    #[serde(default)]
    pub stream_format: Option<String>,
    #[serde(default)]
    pub instructions: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub model: String,
    pub content: String,
    #[serde(default)]
    pub add_special: Option<bool>,
}

/// Parse a JSON body into `T`, naming the field on error.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::invalid(
            "body",
            "the request body is empty; send a JSON object",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        // serde reports unknown fields (flatten included) with the field name in backticks.
        if let Some(field) = msg
            .strip_prefix("unknown field `")
            .and_then(|r| r.split('`').next())
        {
            return ApiError::unsupported(
                field,
                format!("unknown parameter `{field}`: Gantry does not support it"),
            );
        }
        if path.is_empty() || path == "." {
            ApiError::invalid("body", format!("invalid request body: {msg}"))
        } else {
            ApiError::invalid(path.clone(), format!("`{path}`: {msg}"))
        }
    })
}
