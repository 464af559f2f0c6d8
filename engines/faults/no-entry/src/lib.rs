//! Fault-injection plugin (engine layer, tests only): a shared library without the entry symbol.
//!
//! It exports a near-miss name instead, as a plugin built against a
//! different header might.
#![allow(unsafe_code)] // `no_mangle` exports count as unsafe attributes.

/// Not the symbol the host looks for (`gantry_engine_entry`).
#[unsafe(no_mangle)]
pub extern "C" fn gantry_engine_entry_v0() -> u32 {
    0
}
