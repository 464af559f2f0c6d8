//! Engine host (`gantry-engine-host`; below the scheduler): discovers, validates and loads engine plugins, and resolves
//! which plugin serves a model.
//!
//! Discovery scans `<plugins>/{engine_id}/{gpu_backend}/manifest.json` in
//! directory order (sorted, so it is the same on every node). Each manifest
//! passes the specification's validation table (`gantry_formats::manifest`), then the
//! library is opened and its ABI checked ([`plugin`]); the registry of what was found is
//! `registry.rs`, a loaded model's calls [`model`]. A refused plugin is
//! recorded with its reason and logged as an alert; the node keeps going.
#![allow(unsafe_code)] // The engine host is one of the three places allowed to call plugin code.
// Each `unsafe` block carries a SAFETY note (tests/tests/house_rules.rs).

pub mod cuda;
pub mod error;
pub mod model;
pub mod plugin;
mod registry;
pub mod worker;

pub use error::OpenError;
pub use gantry_formats::manifest::{ManifestError, PluginManifest};
pub use model::{ModelExec, ModelShared, WorkerProcess};
pub use plugin::Plugin;
pub use registry::*;
pub use worker::WorkerSettings;
