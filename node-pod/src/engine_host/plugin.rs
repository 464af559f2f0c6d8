//! Engine host, call boundary: opens a plugin library and wraps its vtable in safe Rust.
//!
//! This is the only place the node calls plugin code. The order on load is
//! fixed: `dlopen`, look up `gantry_engine_entry`, call it, check
//! `abi_major` — and only then touch the vtable. Models are split in two
//! handles to encode the header's threading rules in types: [`ModelShared`]
//! (`info`/`tokenize`/`detokenize`, callable from any thread) and
//! [`ModelExec`] (`seq_*`/`step`/`embed`, owned by one scheduler, `&mut self`).

use std::ffi::{CStr, CString, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gantry_engine_abi::ffi;
use gantry_engine_abi::{
    Backend, EngineConfig, EngineError, EngineInfo, LogLevel, ModelDescriptor, ModelInfo,
    SampledToken, Status, StepEntry,
};

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
}

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
        if size < size_of::<ffi::gantry_engine_vtable_t>() {
            return Err(OpenError::BadVtable(format!(
                "struct_size {size} is smaller than ABI 1.0's {}",
                size_of::<ffi::gantry_engine_vtable_t>()
            )));
        }
        // SAFETY: as above; the whole 1.0 table is covered by `size`.
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
    /// the library under them crashes the node. A replaced plugin's mapping
    /// stays until the process exits, which hot reload accepts.
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

/// A loaded engine plugin.
#[derive(Clone)]
pub struct Plugin {
    inner: Arc<PluginInner>,
    loader: Arc<std::sync::Mutex<()>>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("info", &self.inner.info)
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
            reason: e.to_string(),
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
        };
        // SAFETY: host-allocated out struct; strings live as long as the library.
        let info = unsafe {
            (vt.info)(&mut raw_info);
            EngineInfo {
                engine_id: opt_string(raw_info.engine_id).unwrap_or_default(),
                engine_version: opt_string(raw_info.engine_version).unwrap_or_default(),
                backend: Backend::from_raw(raw_info.backend),
                description: opt_string(raw_info.description),
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
            inner: Arc::new(PluginInner {
                vt,
                engine,
                info,
                _log_ctx: log_ctx,
                _host_api: host_api,
                _lib: std::mem::ManuallyDrop::new(lib),
            }),
            loader: Arc::new(std::sync::Mutex::new(())),
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.inner.info
    }

    /// Load a model. Loads on one plugin are serialized, as the header requires.
    pub fn load_model(
        &self,
        desc: &ModelDescriptor,
    ) -> Result<(Arc<ModelShared>, ModelExec), EngineError> {
        let _serial = self.loader.lock().unwrap_or_else(|p| p.into_inner());
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
        };
        let mut handle: *mut ffi::gantry_model_t = std::ptr::null_mut();
        let mut err = new_err();
        // SAFETY: `raw`'s strings outlive the call; the engine is alive.
        let status = unsafe {
            (self.inner.vt.load_model)(self.inner.engine, &raw, &mut handle, err.as_mut())
        };
        if status != ffi::GANTRY_OK || handle.is_null() {
            return Err(read_err(status, &err));
        }
        let handle = Arc::new(ModelHandle {
            plugin: self.inner.clone(),
            raw: handle,
        });
        let info = handle.read_info()?;
        let shared = Arc::new(ModelShared {
            handle: handle.clone(),
            info,
        });
        Ok((shared.clone(), ModelExec { handle, shared }))
    }
}

/// The raw model handle; unloads when the last of shared/exec is dropped.
struct ModelHandle {
    plugin: Arc<PluginInner>,
    raw: *mut ffi::gantry_model_t,
}

// SAFETY: the header allows model_info/tokenize/detokenize from any thread
// concurrently; exec calls are funnelled through the single `ModelExec`.
unsafe impl Send for ModelHandle {}
// SAFETY: as above.
unsafe impl Sync for ModelHandle {}

impl Drop for ModelHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from load_model and is released exactly once.
        unsafe { (self.plugin.vt.unload_model)(self.raw) };
    }
}

impl ModelHandle {
    fn read_info(&self) -> Result<ModelInfo, EngineError> {
        // SAFETY: zeroed is a valid bit pattern for this plain C struct
        // (null pointers, zero numbers, false).
        let mut raw: ffi::gantry_model_info_t = unsafe { std::mem::zeroed() };
        raw.struct_size = size_of::<ffi::gantry_model_info_t>() as u32;
        let mut err = new_err();
        // SAFETY: live handle, host-allocated out struct.
        let status = unsafe { (self.plugin.vt.model_info)(self.raw, &mut raw, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        let tok = |t: i32| (t >= 0).then_some(t);
        // SAFETY: strings and arrays are owned by the model, valid until unload;
        // we copy them out now.
        unsafe {
            let eog = if raw.eog_tokens.is_null() || raw.n_eog_tokens == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(raw.eog_tokens, raw.n_eog_tokens).to_vec()
            };
            Ok(ModelInfo {
                architecture: opt_string(raw.architecture).unwrap_or_default(),
                vocab_size: raw.vocab_size,
                context_length: raw.context_length,
                trained_context_length: raw.trained_context_length,
                kv_capacity_tokens: raw.kv_capacity_tokens,
                max_sequences: raw.max_sequences,
                bos_token: tok(raw.bos_token),
                eos_token: tok(raw.eos_token),
                eog_tokens: eog,
                bos_text: opt_string(raw.bos_text),
                eos_text: opt_string(raw.eos_text),
                chat_template: opt_string(raw.chat_template),
                bytes_used: raw.bytes_used,
                modalities: raw.modalities,
                embedding_dims: raw.embedding_dims,
                add_bos: raw.add_bos,
            })
        }
    }
}

/// Calls on a model that any thread may make at any time.
pub struct ModelShared {
    handle: Arc<ModelHandle>,
    info: ModelInfo,
}

impl std::fmt::Debug for ModelShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelShared")
            .field("info", &self.info)
            .finish()
    }
}

impl ModelShared {
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn plugin_id(&self) -> &str {
        &self.handle.plugin.info.engine_id
    }

    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        // Most text is at most one token per byte, plus BOS.
        fill_growing("tokenize", text.len() + 8, |buf: &mut [i32], n, err| {
            // SAFETY: `text` and `buf` are valid for the lengths given.
            unsafe {
                (self.handle.plugin.vt.tokenize)(
                    self.handle.raw,
                    text.as_ptr().cast(),
                    text.len(),
                    add_special,
                    parse_special,
                    buf.as_mut_ptr(),
                    buf.len(),
                    n,
                    err,
                )
            }
        })
    }

    /// Raw bytes of `tokens`; may end inside a UTF-8 character.
    pub fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        fill_growing(
            "detokenize",
            tokens.len() * 16 + 16,
            |buf: &mut [u8], n, err| {
                // SAFETY: `tokens` and `buf` are valid for the lengths given.
                unsafe {
                    (self.handle.plugin.vt.detokenize)(
                        self.handle.raw,
                        tokens.as_ptr(),
                        tokens.len(),
                        render_special,
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        n,
                        err,
                    )
                }
            },
        )
    }
}

/// Calls that only the model's scheduler makes (never concurrently).
pub struct ModelExec {
    handle: Arc<ModelHandle>,
    shared: Arc<ModelShared>,
}

impl std::fmt::Debug for ModelExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelExec")
            .field("model", &self.shared.info.architecture)
            .finish()
    }
}

impl ModelExec {
    pub fn shared(&self) -> &Arc<ModelShared> {
        &self.shared
    }

    pub fn seq_open(&mut self) -> Result<u64, EngineError> {
        let mut seq = 0u64;
        let mut err = new_err();
        // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
        let status =
            unsafe { (self.handle.plugin.vt.seq_open)(self.handle.raw, &mut seq, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        Ok(seq)
    }

    pub fn seq_release(&mut self, seq: u64) {
        // SAFETY: live handle; unknown ids are a no-op by contract.
        unsafe { (self.handle.plugin.vt.seq_release)(self.handle.raw, seq) };
    }

    /// One forward pass; see the header's `step`.
    pub fn step(
        &mut self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        // The C views borrow from these vectors, which outlive the call.
        let biases: Vec<Vec<ffi::gantry_logit_bias_t>> = entries
            .iter()
            .map(|e| {
                e.sample.map_or_else(Vec::new, |s| {
                    s.logit_bias
                        .iter()
                        .map(|&(token, bias)| ffi::gantry_logit_bias_t { token, bias })
                        .collect()
                })
            })
            .collect();
        let samplings: Vec<Option<ffi::gantry_sampling_t>> = entries
            .iter()
            .zip(&biases)
            .map(|(e, b)| {
                e.sample.map(|s| ffi::gantry_sampling_t {
                    struct_size: size_of::<ffi::gantry_sampling_t>() as u32,
                    temperature: s.temperature,
                    top_p: s.top_p,
                    top_k: s.top_k,
                    min_p: s.min_p,
                    repetition_penalty: s.repetition_penalty,
                    presence_penalty: s.presence_penalty,
                    frequency_penalty: s.frequency_penalty,
                    penalty_last_n: s.penalty_last_n,
                    seed: s.seed,
                    logit_bias: if b.is_empty() {
                        std::ptr::null()
                    } else {
                        b.as_ptr()
                    },
                    n_logit_bias: b.len(),
                    top_logprobs: s.top_logprobs.min(ffi::GANTRY_MAX_TOP_LOGPROBS as u32),
                    want_logprob: s.want_logprob,
                })
            })
            .collect();
        let raw: Vec<ffi::gantry_step_entry_t> = entries
            .iter()
            .zip(&samplings)
            .map(|(e, s)| ffi::gantry_step_entry_t {
                seq: e.seq,
                tokens: e.tokens.as_ptr(),
                n_tokens: e.tokens.len(),
                flags: if s.is_some() {
                    ffi::GANTRY_STEP_SAMPLE
                } else {
                    0
                },
                sampling: s.as_ref().map_or(std::ptr::null(), std::ptr::from_ref),
            })
            .collect();
        let mut results = vec![ffi::gantry_step_result_t::default(); raw.len()];
        let mut err = new_err();
        // SAFETY: `raw`, `samplings`, `biases` and `results` are valid and
        // outlive the call; `&mut self` keeps exec calls exclusive.
        let status = unsafe {
            (self.handle.plugin.vt.step)(
                self.handle.raw,
                raw.as_ptr(),
                raw.len(),
                results.as_mut_ptr(),
                err.as_mut(),
            )
        };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        Ok(results
            .into_iter()
            .zip(entries)
            .map(|(r, e)| {
                e.sample.map(|_| SampledToken {
                    token: r.token,
                    logprob: r.logprob,
                    top: r.top[..(r.n_top as usize).min(ffi::GANTRY_MAX_TOP_LOGPROBS)]
                        .iter()
                        .map(|t| (t.token, t.logprob))
                        .collect(),
                })
            })
            .collect())
    }

    pub fn embed(&mut self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        let dims = self.shared.info.embedding_dims as usize;
        fill_growing("embed", dims, |out: &mut [f32], n, err| {
            // SAFETY: buffers valid for the lengths given; exclusive via &mut self.
            unsafe {
                (self.handle.plugin.vt.embed)(
                    self.handle.raw,
                    tokens.as_ptr(),
                    tokens.len(),
                    out.as_mut_ptr(),
                    out.len(),
                    n,
                    err,
                )
            }
        })
    }
}
