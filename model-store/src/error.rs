//! Model store errors (node start and reload, before the request path): what went wrong while
//! getting a model's artifacts, each naming the source or file, and its status label.

use std::path::PathBuf;

/// What went wrong while getting a model's artifacts. Every variant names the
/// source or file, so the message can go straight into status.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("source {uri:?}: {reason}")]
    Source { uri: String, reason: String },
    #[error("{0}")]
    Listing(String),
    #[error("{0}")]
    Selection(String),
    #[error("{file}: {reason}")]
    Download { file: String, reason: String },
    /// Worth another attempt (connection lost, 5xx, a body cut short).
    #[error("{file}: {reason}")]
    Transient { file: String, reason: String },
    #[error(
        "{file}: sha256 mismatch: the source says {expected}, the download is {got}; the file was removed"
    )]
    Checksum {
        file: String,
        expected: String,
        got: String,
    },
    #[error("{file}: size mismatch: expected {expected} bytes, got {got}; the file was removed")]
    Size {
        file: String,
        expected: u64,
        got: u64,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Lock(String),
    /// The store itself cannot be set up (no cache directory).
    #[error("{0}")]
    Setup(String),
}

impl StoreError {
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Transient { .. })
    }

    /// A stable label for counting failures.
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Source { .. } => "source",
            StoreError::Listing(_) => "listing",
            StoreError::Selection(_) => "selection",
            StoreError::Download { .. } => "download",
            StoreError::Transient { .. } => "transient",
            StoreError::Checksum { .. } => "checksum",
            StoreError::Size { .. } => "size",
            StoreError::Io { .. } => "io",
            StoreError::Lock(_) => "lock",
            StoreError::Setup(_) => "setup",
        }
    }
}
