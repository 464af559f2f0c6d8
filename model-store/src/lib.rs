//! The model store (`gantry-model-store`; before the request path, at node start): a model's
//! source → verified local artifacts.
//!
//! [`ModelStore::fetch`] (`store.rs`) runs the steps, one module each: parse the source
//! (`source`), list its files (`remote`, or the disk for `file://`), choose
//! the model's files by the registered format and exact quantization
//! (`select`), and download each into the cache volume with resume,
//! checksum and an atomic rename (`download`) — under a lock file, so
//! replicas sharing the volume never write the same file at once. Progress
//! is published through [`DownloadProgress`] (`progress.rs`), which `/v1/status` and the 503 answer
//! for a model still downloading read.
//!
//! Cache layout: `{cache_dir}/hf/{org}--{repo}/{revision}/…`,
//! `{cache_dir}/s3/{bucket}/{prefix}/…`, `{cache_dir}/https/{host}/{path}/…`,
//! each file as the source names it; `*.partial` while incomplete; one
//! `.gantry-lock` per model directory.

pub mod download;
mod error;
mod local;
mod progress;
pub mod remote;
pub mod select;
pub mod source;
mod store;

use std::path::PathBuf;

pub use download::RetryPolicy;
pub use error::StoreError;
pub use local::resolve_local;
pub use progress::DownloadProgress;
pub use select::{ArtifactSelection, select};
pub use source::{Source, SourceSettings};
pub use store::{FetchRequest, ModelStore, StoreSetup, cache_dir};

/// Name of the lock file in each model's cache directory.
pub const LOCK_FILE: &str = ".gantry-lock";

/// One file a source offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteFile {
    /// Relative to the source (`sub/dir/x.gguf`).
    pub path: String,
    /// Bytes; 0 when the source does not say (a direct URL before the request).
    pub size: u64,
    /// Lowercase hex sha256 when the source gives one (the Hub's LFS oid).
    pub sha256: Option<String>,
}

/// A model's artifacts on local disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    /// The model directory (cache directory or the local source).
    pub dir: PathBuf,
    /// The file the engine opens.
    pub primary: PathBuf,
    pub mmproj: Option<PathBuf>,
    pub quantization: Option<String>,
    pub files: Vec<PathBuf>,
}
