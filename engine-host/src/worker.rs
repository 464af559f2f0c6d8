//! Engine host, `process` isolation (between the scheduler and a plugin that runs in its own
//! process): a plugin's models run in `gantry-node engine-worker` children, one per loaded
//! model, so a crash, an abort or a hang in plugin code ends one worker instead of the node.
//!
//! - `wire.rs`: the frames on the Unix socket (control) and the step layout in the shared
//!   mapping (per-step data); no JSON on either.
//! - `client.rs`: the node's side: starting, calling, reaping and killing workers;
//! - `remote.rs`: a model's calls, forwarded to its worker.
//! - `serve.rs`: the worker's side, which runs the in-process call boundary (`plugin.rs`).
//!
//! [`RemotePlugin`] is what the registry holds for a plugin in `process` mode: at discovery a
//! short-lived probe worker opens the library (so the node never maps it) and reports its
//! info or its refusal; each `load_model` then starts the model's own worker.

pub mod client;
pub mod remote;
pub mod serve;
pub mod wire;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gantry_engine_abi::{EngineConfig, EngineError, EngineInfo, ModelDescriptor};

pub use client::{CrashHook, Worker, WorkerSettings};
pub use gantry_api::WorkerCrash;
pub use remote::{RemoteExec, RemoteModel};

use crate::error::OpenError;

/// A plugin whose models run in worker processes.
#[derive(Debug)]
pub struct RemotePlugin {
    pub id: String,
    /// The node's private copy of the library the probe checked ([`pin`]).
    pub binary: PathBuf,
    /// The directory the library came from, searched for the libraries it needs.
    pub lib_dir: PathBuf,
    pub config: EngineConfig,
    pub info: EngineInfo,
    pub settings: WorkerSettings,
}

/// A private copy of `binary`, named by its content, that every worker of this version opens:
/// the version a probe checked is the version the workers run, even after the file in the
/// plugin directory is replaced by another (which a plugin update then checks on its own).
fn pin(binary: &Path) -> Result<PathBuf, String> {
    use sha2::{Digest, Sha256};
    let bytes =
        std::fs::read(binary).map_err(|e| format!("cannot read {}: {e}", binary.display()))?;
    let digest = hex::encode(Sha256::digest(&bytes));
    let dir = client::private_dir()
        .map_err(|e| format!("cannot make the worker directory: {e}"))?
        .join("lib");
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
    let name = binary
        .file_name()
        .map_or_else(|| "plugin.so".into(), |n| n.to_string_lossy().into_owned());
    let pinned = dir.join(format!("{}-{name}", &digest[..16]));
    if !pinned.is_file() {
        let tmp = dir.join(format!(".{}-{name}.tmp", &digest[..16]));
        std::fs::write(&tmp, &bytes)
            .and_then(|()| std::fs::rename(&tmp, &pinned))
            .map_err(|e| format!("cannot copy {}: {e}", binary.display()))?;
    }
    Ok(pinned)
}

/// The refusal labels a worker may report, as the static labels the registry keeps.
fn static_label(label: &str) -> &'static str {
    const KNOWN: [&str; 6] = [
        "dlopen_failed",
        "no_entry_symbol",
        "abi_mismatch",
        "bad_vtable",
        "id_mismatch",
        "create_failed",
    ];
    KNOWN
        .into_iter()
        .find(|k| *k == label)
        .unwrap_or("worker_failed")
}

impl RemotePlugin {
    /// Check the library in a probe worker: the same checks as in-process, in a process
    /// whose crash cannot take the node along.
    pub fn probe(
        binary: &Path,
        id: &str,
        config: &EngineConfig,
        settings: &WorkerSettings,
    ) -> Result<RemotePlugin, OpenError> {
        let in_worker =
            |label: &'static str, message: String| OpenError::InWorker { label, message };
        let lib_dir = binary.parent().unwrap_or(Path::new(".")).to_path_buf();
        let pinned = pin(binary).map_err(|e| in_worker("binary_unreadable", e))?;
        let worker = Worker::spawn(settings, id, "(probe)", &lib_dir)
            .map_err(|e| in_worker("worker_failed", e.message))?;
        let info = match worker.open(id, &pinned, config) {
            Ok(Ok(info)) => info,
            Ok(Err((label, message))) => return Err(in_worker(static_label(&label), message)),
            Err(e) => return Err(in_worker("worker_crashed", e.message)),
        };
        drop(worker);
        Ok(RemotePlugin {
            id: id.to_string(),
            binary: pinned,
            lib_dir,
            config: config.clone(),
            info,
            settings: settings.clone(),
        })
    }

    /// Start a worker for one model, open the plugin in it and load the model.
    pub fn load_model(
        &self,
        desc: &ModelDescriptor,
    ) -> Result<(Arc<Worker>, gantry_engine_abi::ModelInfo), EngineError> {
        let worker = Worker::spawn(&self.settings, &self.id, &desc.model_id, &self.lib_dir)?;
        match worker.open(&self.id, &self.binary, &self.config)? {
            Ok(_) => {}
            Err((label, message)) => {
                return Err(EngineError::new(
                    gantry_engine_abi::Status::LoadFailed,
                    format!("the plugin no longer opens ({label}): {message}"),
                ));
            }
        }
        let info = worker.load(desc)?;
        Ok((worker, info))
    }
}
