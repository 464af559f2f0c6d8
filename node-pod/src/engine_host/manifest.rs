//! Engine host, discovery step: the plugin `manifest.json` schema and validation table.
//!
//! The parser lives in `gantry-formats` (untrusted input, fuzzed there);
//! this module keeps the node's historical path `engine_host::manifest`.

pub use gantry_formats::manifest::*;
