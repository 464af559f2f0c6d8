//! Model metadata (before engine selection): the GGUF header reader.
//!
//! The parser lives in `gantry-formats` (untrusted input, fuzzed there);
//! this module keeps the node's historical path `gantry_node::gguf`.

pub use gantry_formats::gguf::*;
