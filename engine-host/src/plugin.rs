//! Engine host, call boundary: opens a plugin library and wraps its vtable in safe Rust.
//!
//! This is the only place the node calls plugin code. The order on load is
//! fixed: `dlopen`, look up `gantry_engine_entry`, call it, check
//! `abi_major` — and only then touch the vtable. Models are split in two
//! handles to encode the header's threading rules in types: [`ModelShared`]
//! (`info`/`tokenize`/`detokenize`, callable from any thread) and
//! [`ModelExec`] (`seq_*`/`step`/`embed`, owned by one scheduler, `&mut self`),
//! both in `plugin/model.rs`.
//!
//! A plugin library opened in this process is never closed: llama.cpp's threads and
//! thread-local destructors outlive `destroy`, so unmapping the code would crash the
//! node. A plugin in `process` isolation is never opened here at all: its models run in
//! worker processes (`worker.rs`), and the same safe handles forward to them.

mod model;

use model::{Exec, Handle, ModelHandle};
pub use model::{ModelExec, ModelShared};

use std::ffi::{CStr, CString, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::worker::{RemoteExec, RemoteModel, RemotePlugin, WorkerSettings};
use gantry_api::config::Isolation;
use gantry_engine_abi::ffi;
use gantry_engine_abi::{
    Backend, EngineConfig, EngineError, EngineInfo, LogLevel, ModelDescriptor, Status,
};

/// An error and its sources, `outer: inner: ...`: libloading's "dlopen failed" carries the
/// loader's own message (which file, which missing library) as its source.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

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

/// Function pointers copied out of the plugin's vtable after the ABI check.
#[derive(Clone, Copy)]
struct Vtable {
    info: ffi::InfoFn,
    create: ffi::CreateFn,
    destroy: ffi::DestroyFn,
    load_model: ffi::LoadModelFn,
    model_info: ffi::ModelInfoFn,
    tokenize: ffi::TokenizeFn,
    detokenize: ffi::DetokenizeFn,
    seq_open: ffi::SeqOpenFn,
    seq_release: ffi::SeqReleaseFn,
    step: ffi::StepFn,
    embed: ffi::EmbedFn,
    unload_model: ffi::UnloadModelFn,
    /// ABI 1.4, optional: `None` when the plugin's table is older or leaves the slot empty.
    seq_cached_tokens: Option<ffi::SeqCachedTokensFn>,
}

/// The vtable as ABI 1.0 laid it out (every slot before `seq_cached_tokens`): the least a
/// plugin's `struct_size` may cover.
const VTABLE_1_0_SIZE: usize = std::mem::offset_of!(ffi::gantry_engine_vtable_t, seq_cached_tokens);

impl Vtable {
    /// # Safety
    /// `vt` must point to a vtable that lives as long as the library.
    unsafe fn read(vt: *const ffi::gantry_engine_vtable_t) -> Result<Vtable, OpenError> {
        if vt.is_null() {
            return Err(OpenError::BadVtable("null vtable".into()));
        }
        // SAFETY: non-null and valid per the caller's contract. The size is
        // read first; only slots it covers are read (append-only policy).
        let size = unsafe { (*vt).struct_size } as usize;
        if size < VTABLE_1_0_SIZE {
            return Err(OpenError::BadVtable(format!(
                "struct_size {size} is smaller than ABI 1.0's {VTABLE_1_0_SIZE}"
            )));
        }
        // SAFETY: as above; the whole 1.0 table is covered by `size`, and a later slot is
        // read only where `size` covers it.
        let v = unsafe { &*vt };
        let need = |name: &str| OpenError::BadVtable(format!("missing function `{name}`"));
        Ok(Vtable {
            info: v.info.ok_or_else(|| need("info"))?,
            create: v.create.ok_or_else(|| need("create"))?,
            destroy: v.destroy.ok_or_else(|| need("destroy"))?,
            load_model: v.load_model.ok_or_else(|| need("load_model"))?,
            model_info: v.model_info.ok_or_else(|| need("model_info"))?,
            tokenize: v.tokenize.ok_or_else(|| need("tokenize"))?,
            detokenize: v.detokenize.ok_or_else(|| need("detokenize"))?,
            seq_open: v.seq_open.ok_or_else(|| need("seq_open"))?,
            seq_release: v.seq_release.ok_or_else(|| need("seq_release"))?,
            step: v.step.ok_or_else(|| need("step"))?,
            embed: v.embed.ok_or_else(|| need("embed"))?,
            unload_model: v.unload_model.ok_or_else(|| need("unload_model"))?,
            seq_cached_tokens: if size
                >= std::mem::offset_of!(ffi::gantry_engine_vtable_t, seq_cached_tokens)
                    + size_of::<Option<ffi::SeqCachedTokensFn>>()
            {
                v.seq_cached_tokens
            } else {
                None
            },
        })
    }
}

/// Context behind the host log callback: the plugin id every line is tagged with.
struct LogCtx {
    plugin_id: String,
}

unsafe extern "C" fn host_log(
    ctx: *mut c_void,
    level: ffi::gantry_log_level_t,
    msg: *const c_char,
) {
    if ctx.is_null() || msg.is_null() {
        return;
    }
    // SAFETY: `ctx` is the LogCtx owned by the Plugin, alive until destroy;
    // `msg` is NUL-terminated and valid for this call (header contract).
    let (ctx, msg) = unsafe {
        (
            &*ctx.cast::<LogCtx>(),
            CStr::from_ptr(msg).to_string_lossy(),
        )
    };
    let id = &ctx.plugin_id;
    match LogLevel::from_raw(level) {
        LogLevel::Error => tracing::error!(target: "gantry::plugin", plugin = %id, "[{id}] {msg}"),
        LogLevel::Warn => tracing::warn!(target: "gantry::plugin", plugin = %id, "[{id}] {msg}"),
        LogLevel::Info => tracing::info!(target: "gantry::plugin", plugin = %id, "[{id}] {msg}"),
        LogLevel::Debug => tracing::debug!(target: "gantry::plugin", plugin = %id, "[{id}] {msg}"),
    }
}

/// An opened plugin with a created engine. Dropped last: models hold an `Arc`.
struct PluginInner {
    vt: Vtable,
    engine: *mut ffi::gantry_engine_t,
    info: EngineInfo,
    // Boxed so its address is stable for the callback; dropped after destroy.
    _log_ctx: Box<LogCtx>,
    _host_api: Box<ffi::gantry_host_api_t>,
    /// Never closed. Plugin code may leave threads behind (llama.cpp's OpenMP
    /// pool) or thread-local destructors that run after `destroy`; unmapping
    /// the library under them crashes the node. The mapping stays until the
    /// process exits.
    _lib: std::mem::ManuallyDrop<libloading::Library>,
}

// SAFETY: the header allows engine-level calls from any thread as long as the
// host serializes them; `Plugin::load_model` does so through `&self` only for
// calls the header marks as serialized by the registry's single loader.
unsafe impl Send for PluginInner {}
// SAFETY: see above; shared access only reads immutable fields.
unsafe impl Sync for PluginInner {}

impl Drop for PluginInner {
    fn drop(&mut self) {
        // SAFETY: `engine` came from create and every model (which holds an
        // Arc to this) is unloaded by now.
        unsafe { (self.vt.destroy)(self.engine) };
    }
}

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

fn new_err() -> Box<ffi::gantry_error_t> {
    Box::new(ffi::gantry_error_t {
        message: [0; ffi::GANTRY_ERROR_MESSAGE_MAX],
    })
}

fn read_err(status: ffi::gantry_status_t, err: &ffi::gantry_error_t) -> EngineError {
    let bytes: Vec<u8> = err
        .message
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    let mut message = String::from_utf8_lossy(&bytes).into_owned();
    if message.is_empty() {
        message = "(the plugin gave no message)".into();
    }
    EngineError::new(Status::from_raw(status), message)
}

/// Call a plugin function that fills a host buffer and reports the full
/// length it needed (`tokenize`, `detokenize`, `embed`): when the length
/// exceeds the buffer, grow it once and call again.
fn fill_growing<T: Clone + Default>(
    what: &str,
    initial: usize,
    mut call: impl FnMut(&mut [T], &mut usize, &mut ffi::gantry_error_t) -> ffi::gantry_status_t,
) -> Result<Vec<T>, EngineError> {
    let mut buf = vec![T::default(); initial.max(1)];
    for _ in 0..2 {
        let mut n = 0usize;
        let mut err = new_err();
        let status = call(&mut buf, &mut n, err.as_mut());
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        if n <= buf.len() {
            buf.truncate(n);
            return Ok(buf);
        }
        buf = vec![T::default(); n];
    }
    Err(EngineError::internal(format!(
        "{what}: the plugin kept changing the length"
    )))
}

/// # Safety
/// `p` must be null or NUL-terminated and valid for the returned lifetime's use.
unsafe fn opt_string(p: *const c_char) -> Option<String> {
    // SAFETY: forwarded from the caller's contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

fn path_cstring(p: &Path) -> CString {
    cstring(&p.to_string_lossy())
}

impl Plugin {
    /// Open `path`, check the ABI from the entry descriptor, then create the
    /// engine. `expected_id` is the manifest's id, which the plugin must report.
    pub fn open(
        path: &Path,
        expected_id: &str,
        config: &EngineConfig,
    ) -> Result<Plugin, OpenError> {
        // SAFETY: loading a library runs its initialisers. The cluster admin
        // installed it and its manifest passed validation (and its sha256
        // when pinned); this is the trust the specification grants plugins.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| OpenError::Dlopen {
            path: path.to_path_buf(),
            reason: error_chain(&e),
        })?;
        // SAFETY: the symbol's type is fixed by the header.
        let entry_fn: ffi::EntryFn =
            unsafe { lib.get::<ffi::EntryFn>(ffi::GANTRY_ENGINE_ENTRY_SYMBOL) }
                .map(|s| *s)
                .map_err(|_| OpenError::NoEntry(path.to_path_buf()))?;
        // SAFETY: the entry function takes nothing and returns a static pointer.
        let entry = unsafe { entry_fn() };
        if entry.is_null() {
            return Err(OpenError::BadVtable("entry returned null".into()));
        }
        // SAFETY: non-null static owned by the library, which stays open.
        let entry = unsafe { &*entry };
        if entry.abi_major != ffi::GANTRY_ABI_MAJOR {
            // Refused before any other call into the plugin.
            return Err(OpenError::AbiMismatch {
                expected: ffi::GANTRY_ABI_MAJOR,
                got: entry.abi_major,
            });
        }
        // SAFETY: the ABI matched, so the vtable has the 1.0 layout; it is a
        // static of the library, which outlives the copied pointers.
        let vt = unsafe { Vtable::read(entry.vtable) }?;

        let mut raw_info = ffi::gantry_engine_info_t {
            struct_size: size_of::<ffi::gantry_engine_info_t>() as u32,
            engine_id: std::ptr::null(),
            engine_version: std::ptr::null(),
            backend: ffi::GANTRY_BACKEND_CPU,
            description: std::ptr::null(),
            capabilities: 0,
            build_info: std::ptr::null(),
        };
        // SAFETY: host-allocated out struct; strings live as long as the library.
        let info = unsafe {
            (vt.info)(&mut raw_info);
            EngineInfo {
                engine_id: opt_string(raw_info.engine_id).unwrap_or_default(),
                engine_version: opt_string(raw_info.engine_version).unwrap_or_default(),
                backend: Backend::from_raw(raw_info.backend),
                description: opt_string(raw_info.description),
                // Only a plugin that wrote the field (ABI 1.2 or later) declares capabilities.
                capabilities: if raw_info.struct_size as usize
                    > std::mem::offset_of!(ffi::gantry_engine_info_t, capabilities)
                {
                    raw_info.capabilities
                } else {
                    0
                },
                // Only a plugin that wrote the field (ABI 1.3 or later) reports it.
                build_info: if raw_info.struct_size as usize
                    >= std::mem::offset_of!(ffi::gantry_engine_info_t, build_info)
                        + size_of::<*const std::ffi::c_char>()
                {
                    opt_string(raw_info.build_info).filter(|s| !s.is_empty())
                } else {
                    None
                },
            }
        };
        if info.engine_id != expected_id {
            return Err(OpenError::IdMismatch {
                manifest: expected_id.to_string(),
                reported: info.engine_id,
            });
        }

        let log_ctx = Box::new(LogCtx {
            plugin_id: info.engine_id.clone(),
        });
        let host_api = Box::new(ffi::gantry_host_api_t {
            struct_size: size_of::<ffi::gantry_host_api_t>() as u32,
            ctx: std::ptr::from_ref(log_ctx.as_ref()).cast_mut().cast(),
            log: Some(host_log),
        });
        let raw_cfg = ffi::gantry_engine_config_t {
            struct_size: size_of::<ffi::gantry_engine_config_t>() as u32,
            backend: config.backend.as_raw(),
            device_ids: if config.device_ids.is_empty() {
                std::ptr::null()
            } else {
                config.device_ids.as_ptr()
            },
            n_device_ids: config.device_ids.len(),
            vram_limit_bytes: config.vram_limit_bytes,
            n_threads: config.n_threads,
            max_batch_size: config.max_batch_size,
            context_length: config.context_length,
        };
        let mut engine: *mut ffi::gantry_engine_t = std::ptr::null_mut();
        let mut err = new_err();
        // SAFETY: all inputs are valid for the call; host_api stays alive
        // (boxed in PluginInner) until destroy.
        let status = unsafe { (vt.create)(&raw_cfg, host_api.as_ref(), &mut engine, err.as_mut()) };
        if status != ffi::GANTRY_OK || engine.is_null() {
            return Err(OpenError::Create(read_err(status, &err)));
        }
        Ok(Plugin {
            kind: Kind::Local {
                inner: Arc::new(PluginInner {
                    vt,
                    engine,
                    info,
                    _log_ctx: log_ctx,
                    _host_api: host_api,
                    _lib: std::mem::ManuallyDrop::new(lib),
                }),
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
        let (inner, loader) = match &self.kind {
            Kind::Local { inner, loader } => (inner, loader),
            Kind::Remote(r) => {
                let (worker, info) = r.load_model(desc)?;
                let exec = RemoteExec::new(worker.clone())?;
                let shared = Arc::new(ModelShared {
                    handle: Handle::Remote {
                        model: Arc::new(RemoteModel::new(worker)),
                        plugin: Arc::new(r.info.clone()),
                    },
                    info,
                });
                return Ok((
                    shared.clone(),
                    ModelExec {
                        exec: Exec::Remote(exec),
                        shared,
                    },
                ));
            }
        };
        let _serial = loader.lock().unwrap_or_else(|p| p.into_inner());
        let id = cstring(&desc.model_id);
        let dir = path_cstring(&desc.model_dir);
        let primary = path_cstring(&desc.primary_file);
        let quant = desc.quantization.as_deref().map(cstring);
        let mmproj = desc.mmproj.as_deref().map(path_cstring);
        let raw = ffi::gantry_model_desc_t {
            struct_size: size_of::<ffi::gantry_model_desc_t>() as u32,
            model_id: id.as_ptr(),
            model_dir: dir.as_ptr(),
            primary_file: primary.as_ptr(),
            format: desc.format.as_raw(),
            quantization: quant.as_ref().map_or(std::ptr::null(), |q| q.as_ptr()),
            mmproj: mmproj.as_ref().map_or(std::ptr::null(), |m| m.as_ptr()),
            context_length: desc.context_length,
            max_sequences: desc.max_sequences,
            device_ids: if desc.device_ids.is_empty() {
                std::ptr::null()
            } else {
                desc.device_ids.as_ptr()
            },
            n_device_ids: desc.device_ids.len(),
        };
        let mut handle: *mut ffi::gantry_model_t = std::ptr::null_mut();
        let mut err = new_err();
        // SAFETY: `raw`'s strings outlive the call; the engine is alive.
        let status =
            unsafe { (inner.vt.load_model)(inner.engine, &raw, &mut handle, err.as_mut()) };
        if status != ffi::GANTRY_OK || handle.is_null() {
            return Err(read_err(status, &err));
        }
        let handle = Arc::new(ModelHandle {
            plugin: inner.clone(),
            raw: handle,
        });
        let info = handle.read_info()?;
        let shared = Arc::new(ModelShared {
            handle: Handle::Local(handle.clone()),
            info,
        });
        Ok((
            shared.clone(),
            ModelExec {
                exec: Exec::Local(handle),
                shared,
            },
        ))
    }
}
