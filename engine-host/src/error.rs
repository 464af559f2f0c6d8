//! Engine host errors (plugin discovery and load): why a library could not become a plugin,
//! with the label the registry's metrics and status report.

use std::path::PathBuf;

use gantry_engine_abi::EngineError;

/// Why a library could not become a plugin (after its manifest passed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("cannot load {}: {reason}", .path.display())]
    Dlopen { path: PathBuf, reason: String },
    #[error("entry symbol gantry_engine_entry not found in {}", .0.display())]
    NoEntry(PathBuf),
    #[error("ABI version mismatch: expected {expected}, got {got}")]
    AbiMismatch { expected: u32, got: u32 },
    #[error("plugin vtable is incomplete: {0}")]
    BadVtable(String),
    #[error("plugin reports id {reported:?}, its manifest says {manifest:?}")]
    IdMismatch { manifest: String, reported: String },
    #[error("engine create failed: {0}")]
    Create(EngineError),
    /// The probe worker of a plugin in `process` isolation refused or lost it.
    #[error("{message}")]
    InWorker {
        label: &'static str,
        message: String,
    },
}

impl OpenError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            OpenError::Dlopen { .. } => "dlopen_failed",
            OpenError::NoEntry(_) => "no_entry_symbol",
            OpenError::AbiMismatch { .. } => "abi_mismatch",
            OpenError::BadVtable(_) => "bad_vtable",
            OpenError::IdMismatch { .. } => "id_mismatch",
            OpenError::Create(_) => "create_failed",
            OpenError::InWorker { label, .. } => label,
        }
    }
}
