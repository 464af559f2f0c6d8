//! The Gantry node (`gantry-node`): everything between an OpenAI request and an engine plugin.
//!
//! Request path, one module per step: `engine_host` (plugin discovery, ABI
//! checks, safe calls into plugins) is the bottom of it; `cli` is the
//! command-line front.
#![deny(unsafe_code)] // Only `engine_host` may opt out, with a SAFETY note on every block.

pub mod cli;
pub mod engine_host;
