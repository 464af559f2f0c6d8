//! Engine host, an opened plugin library (call boundary, below `plugin.rs` and the in-process
//! model calls of `local.rs`): its vtable after the ABI check, the created engine, the log
//! callback, and the helpers every FFI call uses (error buffers, growing output buffers).

use std::ffi::{CStr, CString, c_char, c_void};
use std::path::Path;

use gantry_engine_abi::ffi;
use gantry_engine_abi::{Backend, EngineConfig, EngineError, EngineInfo, LogLevel, Status};

use crate::error::OpenError;

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

/// Function pointers copied out of the plugin's vtable after the ABI check.
#[derive(Clone, Copy)]
pub(super) struct Vtable {
    pub(super) info: ffi::InfoFn,
    pub(super) create: ffi::CreateFn,
    pub(super) destroy: ffi::DestroyFn,
    pub(super) load_model: ffi::LoadModelFn,
    pub(super) model_info: ffi::ModelInfoFn,
    pub(super) tokenize: ffi::TokenizeFn,
    pub(super) detokenize: ffi::DetokenizeFn,
    pub(super) seq_open: ffi::SeqOpenFn,
    pub(super) seq_release: ffi::SeqReleaseFn,
    pub(super) step: ffi::StepFn,
    pub(super) embed: ffi::EmbedFn,
    pub(super) unload_model: ffi::UnloadModelFn,
    /// ABI 1.4, optional: `None` when the plugin's table is older or leaves the slot empty.
    pub(super) seq_cached_tokens: Option<ffi::SeqCachedTokensFn>,
    /// ABI 1.5, optional.
    pub(super) seq_fork: Option<ffi::SeqForkFn>,
    /// ABI 1.5, optional (required with `GANTRY_CAP_SPECULATE`).
    pub(super) seq_truncate: Option<ffi::SeqTruncateFn>,
    /// ABI 1.6, optional (required with `GANTRY_CAP_ADAPTERS`).
    pub(super) adapter_load: Option<ffi::AdapterLoadFn>,
    pub(super) adapter_unload: Option<ffi::AdapterUnloadFn>,
    pub(super) seq_set_adapter: Option<ffi::SeqSetAdapterFn>,
    /// ABI 1.8, optional: without it, `embed` once per input.
    pub(super) embed_batch: Option<ffi::EmbedBatchFn>,
    /// ABI 1.9, optional (required with `GANTRY_MODALITY_TRANSCRIPTION`).
    pub(super) seq_set_input: Option<ffi::SeqSetInputFn>,
    /// ABI 1.10, optional (required with `GANTRY_MODALITY_SPEECH`).
    pub(super) speech_open: Option<ffi::SpeechOpenFn>,
    pub(super) speech_next: Option<ffi::SpeechNextFn>,
    pub(super) speech_close: Option<ffi::SpeechCloseFn>,
    /// ABI 1.11, optional.
    pub(super) seq_token_times: Option<ffi::SeqTokenTimesFn>,
    pub(super) seq_token_prob: Option<ffi::SeqTokenProbFn>,
    /// ABI 1.12, optional.
    pub(super) model_counters: Option<ffi::ModelCountersFn>,
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
        // A slot after ABI 1.0's: read only where the plugin's `struct_size` covers it.
        macro_rules! later {
            ($slot:ident) => {
                if std::mem::offset_of!(ffi::gantry_engine_vtable_t, $slot) + size_of_val(&v.$slot)
                    <= size
                {
                    v.$slot
                } else {
                    None
                }
            };
        }
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
            seq_cached_tokens: later!(seq_cached_tokens),
            seq_fork: later!(seq_fork),
            seq_truncate: later!(seq_truncate),
            adapter_load: later!(adapter_load),
            adapter_unload: later!(adapter_unload),
            seq_set_adapter: later!(seq_set_adapter),
            embed_batch: later!(embed_batch),
            seq_set_input: later!(seq_set_input),
            speech_open: later!(speech_open),
            speech_next: later!(speech_next),
            speech_close: later!(speech_close),
            seq_token_times: later!(seq_token_times),
            seq_token_prob: later!(seq_token_prob),
            model_counters: later!(model_counters),
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
pub(super) struct PluginInner {
    pub(super) vt: Vtable,
    pub(super) engine: *mut ffi::gantry_engine_t,
    pub(super) info: EngineInfo,
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

/// # Safety
/// `p` must be null or NUL-terminated and valid for the returned lifetime's use.
pub(super) unsafe fn opt_string(p: *const c_char) -> Option<String> {
    // SAFETY: forwarded from the caller's contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

pub(super) fn cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

pub(super) fn path_cstring(p: &Path) -> CString {
    cstring(&p.to_string_lossy())
}

pub(super) fn new_err() -> Box<ffi::gantry_error_t> {
    Box::new(ffi::gantry_error_t {
        message: [0; ffi::GANTRY_ERROR_MESSAGE_MAX],
    })
}

pub(super) fn read_err(status: ffi::gantry_status_t, err: &ffi::gantry_error_t) -> EngineError {
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
/// length it needed (`tokenize`, `detokenize`, `embed`, `embed_batch`): when the
/// length exceeds the buffer, grow it once and call again.
pub(super) fn fill_growing<T: Clone + Default>(
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

impl PluginInner {
    /// Open `path`, check the ABI from the entry descriptor, then create the
    /// engine. `expected_id` is the manifest's id, which the plugin must report.
    pub(crate) fn open(
        path: &Path,
        expected_id: &str,
        config: &EngineConfig,
    ) -> Result<PluginInner, OpenError> {
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
        Ok(PluginInner {
            vt,
            engine,
            info,
            _log_ctx: log_ctx,
            _host_api: host_api,
            _lib: std::mem::ManuallyDrop::new(lib),
        })
    }
}
