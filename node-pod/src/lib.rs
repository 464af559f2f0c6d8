//! The Gantry node (`gantry-node`): everything between an OpenAI request and an engine plugin.
//!
//! Request path, one module per step, each visited once (docs/architecture.md walks it):
//! `http` (axum; JSON only here: `openai` parses, `validate` types the
//! request) → `node` (`ready_model`, lazy loads) → `template` (chat
//! templates, from `gantry-chat`) → `tokenizer` → `http::limits` (the request against the
//! model; `constraint` compiles a grammar) → `http::response` → `cache`
//! (temperature-0 answers) → `scheduler` (continuous batching, one owner per
//! model; allowed-token masks from `constraint`) → `engine_host` (plugin calls, `gantry-engine-host`)
//! → `text` (incremental UTF-8, stop sequences) → `toolcall` (tool calls out of
//! the text, from `gantry-chat`) → JSON or SSE. Beside it: `node`
//! (model lifecycle and readiness), `memory` (LRU unloads, OOM refusals),
//! `store` (sources, downloads, artifact selection: `gantry-model-store`), `metrics`,
//! `error` (the one OpenAI-shaped error type and every HTTP mapping), `config_file` (the
//! config file, re-read on change for `node`'s reload) and `cli`.
//! The rules the operator applies too (node config, source grammar, engine selection) come from
//! `gantry-api`; the GGUF header and plugin manifest parsers from `gantry-formats`.
#![deny(unsafe_code)] // Plugin code is reached only through `gantry-engine-host`.

pub mod cache;
pub mod cli;
pub mod config_file;
pub mod constraint;
pub mod devices;
pub mod error;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod scheduler;
pub mod text;
pub mod tokenizer;

// The engine host, a model family's chat format and the model store live in crates of their
// own; the node reaches them by these paths.
pub use gantry_chat::{template, toolcall};
pub use gantry_engine_host as engine_host;
pub use gantry_model_store as store;
