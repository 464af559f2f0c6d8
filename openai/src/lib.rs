//! The OpenAI surface (`gantry-openai`; the first and the last step of a request in the node's
//! HTTP handlers), depending on the scheduler's events and the chat format, not on the node:
//!
//! - [`request`]: OpenAI request bodies as they arrive (unknown fields refused);
//! - [`validate`]: a parsed request becomes a checked `Valid*Request`, every refusal naming
//!   its field and limit; [`grammar`]: what it constrains its output to;
//! - [`reply`]: ids, usage, logprobs, finish reasons and stream chunks; [`tool_reply`]: the
//!   reply's tool calls in OpenAI's shapes;
//! - [`error`]: the one OpenAI-shaped error type, [`ApiError`], and its HTTP mapping.
#![forbid(unsafe_code)]

pub mod error;
pub mod grammar;
pub mod reply;
pub mod request;
pub mod tool_reply;
pub mod validate;

pub use error::ApiError;
