//! The Gantry node (`gantry-node`): composes the crates between an OpenAI request and an engine
//! plugin, and holds the node's own state.
//!
//! Request path (docs/architecture.md walks it file by file): `http` (axum routes, the node
//! token, the handlers) → the OpenAI surface (`gantry-openai`: parse, validate) → `node`
//! (`ready_model`, lazy loads) → `template` (`gantry-chat`) → `tokenizer` → `http::limits`
//! (the request against the model) → `constraint` (the grammar compiled against the model's
//! vocabulary) → `http::response` (with `response_cache`: temperature-0 answers) → `replicas`
//! (round robin; `PluginEngine` adapts the engine host to the scheduler) → `scheduler`
//! (`gantry-scheduler`: continuous batching, text and stop sequences) → `engine_host`
//! (`gantry-engine-host`: plugin calls) → back through the response as JSON or SSE, tool calls
//! read by `gantry-chat`'s `toolcall`. Beside it: `node` (model lifecycle and readiness, config
//! reload, crash restarts), `memory` (LRU unloads, OOM refusals), `store` (sources, downloads,
//! artifact selection: `gantry-model-store`), `devices`, `metrics`, `error` (the node's own
//! refusals as OpenAI errors), `node_token`, `config_file` and `cli`.
//! The rules the operator applies too (node config, source grammar, engine selection) come from
//! `gantry-api`; the GGUF header and plugin manifest parsers from `gantry-formats`.
#![deny(unsafe_code)] // Plugin code is reached only through `gantry-engine-host`.

pub mod audio;
pub mod cli;
pub mod config_file;
pub mod constraint;
pub mod devices;
pub mod error;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod node_token;
pub mod replicas;
pub mod response_cache;
pub mod tokenizer;
pub mod transcript;

// The engine host, a model family's chat format, the model store and the scheduler live in
// crates of their own; the node reaches them by these paths.
pub use gantry_chat::{template, toolcall};
pub use gantry_engine_host as engine_host;
pub use gantry_model_store as store;
pub use gantry_scheduler as scheduler;
