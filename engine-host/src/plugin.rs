//! Engine host, call boundary: opens a plugin library and wraps its vtable in safe Rust.
//!
//! This is the only place the node calls plugin code. The order on load is
//! fixed: `dlopen`, look up `gantry_engine_entry`, call it, check
//! `abi_major` — and only then touch the vtable (`plugin/library.rs`). A loaded model's calls
//! go through [`ModelShared`] and [`ModelExec`] (`model.rs`): into the plugin here
//! (`plugin/local.rs`) or to the model's worker (`worker/remote.rs`).
//!
//! A plugin library opened in this process is never closed: llama.cpp's threads and
//! thread-local destructors outlive `destroy`, so unmapping the code would crash the
//! node. A plugin in `process` isolation is never opened here at all: its models run in
//! worker processes (`worker.rs`), and the same safe handles forward to them.

mod library;
mod local;

use std::path::Path;
use std::sync::Arc;

use gantry_api::config::Isolation;
use gantry_engine_abi::{EngineConfig, EngineError, EngineInfo, ModelDescriptor};

use crate::error::OpenError;
use crate::model::{ExecCalls, ModelExec, ModelShared, SharedCalls};
use crate::worker::{RemoteExec, RemoteModel, RemotePlugin, WorkerSettings};
use library::PluginInner;
use local::LocalModel;

/// A loaded engine plugin: opened in this process, or checked by a probe worker and run in
/// worker processes (`process` isolation).
#[derive(Clone)]
pub struct Plugin {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Local {
        inner: Arc<PluginInner>,
        loader: Arc<std::sync::Mutex<()>>,
    },
    Remote(Arc<RemotePlugin>),
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("info", self.info())
            .field("isolation", &self.isolation())
            .finish()
    }
}

impl Plugin {
    /// Open `path`, check the ABI from the entry descriptor, then create the
    /// engine. `expected_id` is the manifest's id, which the plugin must report.
    pub fn open(
        path: &Path,
        expected_id: &str,
        config: &EngineConfig,
    ) -> Result<Plugin, OpenError> {
        Ok(Plugin {
            kind: Kind::Local {
                inner: Arc::new(PluginInner::open(path, expected_id, config)?),
                loader: Arc::new(std::sync::Mutex::new(())),
            },
        })
    }

    /// The plugin at `path` in `process` isolation: a probe worker runs the checks of
    /// [`Plugin::open`]; this process never maps the library.
    pub fn open_isolated(
        path: &Path,
        expected_id: &str,
        config: &EngineConfig,
        settings: &WorkerSettings,
    ) -> Result<Plugin, OpenError> {
        let remote = RemotePlugin::probe(path, expected_id, config, settings)?;
        if remote.info.engine_id != expected_id {
            return Err(OpenError::IdMismatch {
                manifest: expected_id.to_string(),
                reported: remote.info.engine_id,
            });
        }
        Ok(Plugin {
            kind: Kind::Remote(Arc::new(remote)),
        })
    }

    pub fn info(&self) -> &EngineInfo {
        match &self.kind {
            Kind::Local { inner, .. } => &inner.info,
            Kind::Remote(r) => &r.info,
        }
    }

    /// Where the plugin's code runs.
    pub fn isolation(&self) -> Isolation {
        match &self.kind {
            Kind::Local { .. } => Isolation::InProcess,
            Kind::Remote(_) => Isolation::Process,
        }
    }

    /// Load a model. Loads on one plugin are serialized, as the header requires; in
    /// `process` isolation each load starts the model's own worker.
    pub fn load_model(
        &self,
        desc: &ModelDescriptor,
    ) -> Result<(Arc<ModelShared>, ModelExec), EngineError> {
        let (calls, exec, info): (Box<dyn SharedCalls>, Box<dyn ExecCalls>, _) = match &self.kind {
            Kind::Local { inner, loader } => {
                let _serial = loader.lock().unwrap_or_else(|p| p.into_inner());
                let handle = local::load(inner, desc)?;
                let info = handle.read_info()?;
                (
                    Box::new(LocalModel(handle.clone())),
                    Box::new(LocalModel(handle)),
                    info,
                )
            }
            Kind::Remote(r) => {
                let (worker, info) = r.load_model(desc)?;
                let exec = RemoteExec::new(worker.clone())?;
                let model = RemoteModel::new(worker, Arc::new(r.info.clone()));
                (Box::new(model), Box::new(exec), info)
            }
        };
        let shared = Arc::new(ModelShared::new(calls, info));
        let exec = ModelExec::new(exec, shared.clone());
        Ok((shared, exec))
    }
}
