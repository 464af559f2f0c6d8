//! Engine ABI crate: the contract between the node's engine host and every engine plugin.
//!
//! - [`ffi`]: `repr(C)` mirrors of `include/gantry_engine.h` (the source of truth).
//! - [`types`]: safe Rust values both sides convert to and from (status codes,
//!   configs, model facts, sampling parameters).
//! - [`sdk`]: the [`sdk::Engine`]/[`sdk::Model`] traits and [`declare_engine!`],
//!   which exports the entry symbol and keeps panics from crossing the boundary.
#![allow(unsafe_code)] // This crate *is* the FFI boundary; every block carries a SAFETY note.

#[allow(non_camel_case_types)]
pub mod ffi;
pub mod sdk;
pub mod types;

pub use types::*;

/// The header, embedded so tools and tests can check it without the source tree.
pub const HEADER: &str = include_str!("../include/gantry_engine.h");
