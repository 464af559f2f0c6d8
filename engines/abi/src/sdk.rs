//! Engine ABI, plugin side: safe traits for Rust engine authors and the glue that exports them.
//!
//! A plugin implements [`Engine`] and [`Model`] and calls
//! [`declare_engine!`](crate::declare_engine). The macro exports
//! `gantry_engine_entry`, whose vtable points at the generic `extern "C"`
//! shims below. Every shim runs the trait method inside `catch_unwind`, so a
//! panic becomes `GANTRY_INTERNAL` with the panic message and never unwinds
//! into the host (since Rust 1.81 that would abort the whole node).

use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use crate::ffi;
use crate::types::*;

/// A plugin's engine: created once per node process, loads models.
pub trait Engine: Send + Sync + Sized + 'static {
    type Model: Model;

    /// Must equal the manifest's `id`.
    const ID: &'static str;
    /// Semantic version; must equal the manifest's `version`.
    const VERSION: &'static str;
    const BACKEND: Backend;
    const DESCRIPTION: &'static str;
    /// Optional features (`ffi::GANTRY_CAP_*`, since ABI 1.2). An engine that sets
    /// `GANTRY_CAP_TOKEN_MASK` must honour [`StepEntry::allowed`] in `step`.
    const CAPABILITIES: u32 = 0;

    /// How this build uses the hardware, one line (since ABI 1.3): for example the CPU
    /// variant the library picked for this machine and its SIMD extensions. Asked once,
    /// when the host first reads the engine's info, before `create`.
    fn build_info() -> String {
        String::new()
    }

    fn create(config: EngineConfig, log: HostLog) -> Result<Self, EngineError>;

    /// Load a model. On failure nothing may stay allocated.
    fn load_model(&self, desc: &ModelDescriptor) -> Result<Self::Model, EngineError>;
}

/// A loaded model. `info`, `tokenize` and `detokenize` may run concurrently
/// with `step` (see the header's THREADING section), hence `&self` + `Sync`.
pub trait Model: Send + Sync + 'static {
    /// Called once right after load; the result is cached for the model's life.
    fn info(&self) -> ModelInfo;
    fn tokenize(
        &self,
        text: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError>;
    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError>;
    fn seq_open(&self) -> Result<u64, EngineError>;
    fn seq_release(&self, seq: u64);
    /// One forward pass. Returns one slot per entry: `Some` exactly for the
    /// entries that asked for a sample.
    fn step(&self, entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError>;
    fn embed(&self, tokens: &[i32]) -> Result<Vec<f32>, EngineError>;
    /// How many tokens of `seq`'s first entry came from a cache instead of being evaluated
    /// (since ABI 1.4, `seq_cached_tokens`); `None` when unknown. The host asks after the step
    /// that carried the first entry. The default reports nothing, as a 1.3 plugin does.
    fn seq_cached_tokens(&self, _seq: u64) -> Option<u64> {
        None
    }
}

/// The host's log callback, safe to call from any thread.
#[derive(Clone, Copy)]
pub struct HostLog {
    ctx: *mut c_void,
    log: Option<unsafe extern "C" fn(*mut c_void, ffi::gantry_log_level_t, *const c_char)>,
}

// SAFETY: the header guarantees the host's log callback and its ctx may be
// used from any plugin thread until `destroy` returns.
unsafe impl Send for HostLog {}
// SAFETY: as above; the callback is re-entrant by contract.
unsafe impl Sync for HostLog {}

impl HostLog {
    /// A logger that drops every line (for tests and hosts without a callback).
    pub fn discard() -> Self {
        Self {
            ctx: std::ptr::null_mut(),
            log: None,
        }
    }

    pub fn log(&self, level: LogLevel, message: &str) {
        let Some(log) = self.log else { return };
        // Interior NULs would truncate the line; replace them instead.
        let line = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
        // SAFETY: `log` and `ctx` come from the host's gantry_host_api_t, valid
        // until destroy; `line` outlives the call.
        unsafe { log(self.ctx, level.as_raw(), line.as_ptr()) }
    }
}

/// Everything the shims need behind a `gantry_model_t*`.
struct ModelBox<M> {
    model: M,
    /// The C view of `model.info()`, built once so its pointers stay valid until unload.
    info: CModelInfo,
}

struct CModelInfo {
    architecture: CString,
    bos_text: Option<CString>,
    eos_text: Option<CString>,
    chat_template: Option<CString>,
    eog_tokens: Vec<i32>,
    info: ModelInfo,
}

impl CModelInfo {
    fn new(info: ModelInfo) -> Self {
        let c = |s: &Option<String>| s.as_deref().map(cstring_lossy);
        Self {
            architecture: cstring_lossy(&info.architecture),
            bos_text: c(&info.bos_text),
            eos_text: c(&info.eos_text),
            chat_template: c(&info.chat_template),
            eog_tokens: info.eog_tokens.clone(),
            info,
        }
    }

    fn write(&self, out: &mut ffi::gantry_model_info_t) {
        let opt = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        let i = &self.info;
        let full = ffi::gantry_model_info_t {
            struct_size: size_of::<ffi::gantry_model_info_t>() as u32,
            architecture: self.architecture.as_ptr(),
            vocab_size: i.vocab_size,
            context_length: i.context_length,
            trained_context_length: i.trained_context_length,
            kv_capacity_tokens: i.kv_capacity_tokens,
            max_sequences: i.max_sequences,
            bos_token: i.bos_token.unwrap_or(-1),
            eos_token: i.eos_token.unwrap_or(-1),
            eog_tokens: self.eog_tokens.as_ptr(),
            n_eog_tokens: self.eog_tokens.len(),
            bos_text: opt(&self.bos_text),
            eos_text: opt(&self.eos_text),
            chat_template: opt(&self.chat_template),
            bytes_used: i.bytes_used,
            modalities: i.modalities,
            embedding_dims: i.embedding_dims,
            add_bos: i.add_bos,
        };
        // SAFETY: `out` is the host's struct, whose `struct_size` it set (header rule).
        unsafe { write_sized(out, &full, size_of::<ffi::gantry_model_info_t>()) };
    }
}

/// Copy `full` into a host-allocated out struct that starts with `struct_size`: at most the
/// size the host set there, and record the size written (the header's out-struct rule, so a
/// newer plugin never writes past an older host's struct). A host that left `struct_size`
/// below 4 gets `legacy` bytes, the struct as ABI 1.1 knew it.
///
/// # Safety
/// `out` must point to a writable `T` as the host allocated it: at least `struct_size` bytes,
/// or `legacy` bytes when `struct_size` < 4.
unsafe fn write_sized<T>(out: *mut T, full: &T, legacy: usize) {
    // SAFETY: every out struct starts with a `uint32_t struct_size` (caller's contract).
    let host = unsafe { out.cast::<u32>().read() } as usize;
    let n = if host < size_of::<u32>() {
        legacy
    } else {
        host
    }
    .min(size_of::<T>());
    // SAFETY: `n` bytes fit both the host's struct and `full`; they do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::from_ref(full).cast::<u8>(), out.cast::<u8>(), n);
        out.cast::<u32>().write(n as u32);
    }
}

fn cstring_lossy(s: &str) -> CString {
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

/// Turn a panic payload into its message.
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("plugin panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("plugin panicked: {s}")
    } else {
        "plugin panicked".to_string()
    }
}

/// Write `message` into the host's error buffer, truncated at a char boundary.
///
/// # Safety
/// `err` must be null or point to a writable `gantry_error_t`.
pub unsafe fn write_error(err: *mut ffi::gantry_error_t, message: &str) {
    if err.is_null() {
        return;
    }
    let mut end = message.len().min(ffi::GANTRY_ERROR_MESSAGE_MAX - 1);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = &message.as_bytes()[..end];
    // SAFETY: the caller guarantees `err` is writable; `end` < the buffer size
    // leaves room for the NUL.
    unsafe {
        let dst = (*err).message.as_mut_ptr().cast::<u8>();
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
        *dst.add(bytes.len()) = 0;
    }
}

/// Run `f`, mapping both `Err` and a panic to a status plus message.
///
/// # Safety
/// `err` must be null or point to a writable `gantry_error_t`.
unsafe fn guarded(
    err: *mut ffi::gantry_error_t,
    f: impl FnOnce() -> Result<(), EngineError>,
) -> ffi::gantry_status_t {
    let outcome = catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(EngineError::internal(panic_message(payload))));
    match outcome {
        Ok(()) => ffi::GANTRY_OK,
        Err(e) => {
            // SAFETY: forwarded from the caller's contract.
            unsafe { write_error(err, &e.message) };
            // A plugin must never report OK with an error; keep the code honest.
            if e.status == Status::Ok {
                ffi::GANTRY_INTERNAL
            } else {
                e.status.as_raw()
            }
        }
    }
}

/// Run an infallible shim body; a panic is swallowed (there is no error channel).
fn guarded_void(f: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(f));
}

/// # Safety
/// `p` must be null or a NUL-terminated string valid for this call.
unsafe fn opt_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: non-null and NUL-terminated by the caller's contract.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

/// # Safety
/// `p` must be null or point to `n` readable values of `T` valid for `'a`.
unsafe fn slice_or_empty<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if p.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: non-null with `n` elements by the caller's contract.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
}

/// The allowed-token mask of a C sampling struct: `None` when the struct predates ABI 1.2
/// (its `struct_size` does not cover the field) or the pointer is null.
///
/// # Safety
/// `s` must point to a valid `gantry_sampling_t` whose mask, when present, holds
/// `n_allowed_words` words.
pub unsafe fn allowed_from_c(s: &ffi::gantry_sampling_t) -> Option<&[u32]> {
    let end = std::mem::offset_of!(ffi::gantry_sampling_t, n_allowed_words) + size_of::<usize>();
    if (s.struct_size as usize) < end || s.allowed_tokens.is_null() {
        return None;
    }
    // SAFETY: covered by `struct_size` and non-null; `n_allowed_words` words per the caller.
    Some(unsafe { std::slice::from_raw_parts(s.allowed_tokens, s.n_allowed_words) })
}

/// Read a C sampling struct into a [`Sampling`].
///
/// # Safety
/// `s` must point to a valid `gantry_sampling_t` whose `logit_bias` array is valid.
pub unsafe fn sampling_from_c(s: &ffi::gantry_sampling_t) -> Sampling {
    // SAFETY: forwarded from the caller's contract.
    let bias = unsafe { slice_or_empty(s.logit_bias, s.n_logit_bias) };
    Sampling {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        penalty_last_n: s.penalty_last_n,
        seed: s.seed,
        logit_bias: bias.iter().map(|b| (b.token, b.bias)).collect(),
        top_logprobs: s.top_logprobs.min(ffi::GANTRY_MAX_TOP_LOGPROBS as u32),
        want_logprob: s.want_logprob,
    }
}

/// The static entry a plugin exports; built by [`declare_engine!`](crate::declare_engine).
pub const fn entry(vtable: &'static ffi::gantry_engine_vtable_t) -> ffi::gantry_engine_entry_t {
    ffi::gantry_engine_entry_t {
        abi_major: ffi::GANTRY_ABI_MAJOR,
        abi_minor: ffi::GANTRY_ABI_MINOR,
        struct_size: size_of::<ffi::gantry_engine_entry_t>() as u32,
        vtable,
    }
}

/// The vtable of shims for engine type `E`.
pub const fn vtable<E: Engine>() -> ffi::gantry_engine_vtable_t {
    ffi::gantry_engine_vtable_t {
        struct_size: size_of::<ffi::gantry_engine_vtable_t>() as u32,
        info: Some(shim_info::<E>),
        create: Some(shim_create::<E>),
        destroy: Some(shim_destroy::<E>),
        load_model: Some(shim_load_model::<E>),
        model_info: Some(shim_model_info::<E::Model>),
        tokenize: Some(shim_tokenize::<E::Model>),
        detokenize: Some(shim_detokenize::<E::Model>),
        seq_open: Some(shim_seq_open::<E::Model>),
        seq_release: Some(shim_seq_release::<E::Model>),
        step: Some(shim_step::<E::Model>),
        embed: Some(shim_embed::<E::Model>),
        unload_model: Some(shim_unload_model::<E::Model>),
        seq_cached_tokens: Some(shim_seq_cached_tokens::<E::Model>),
    }
}

/// Static NUL-terminated copies of the engine's identity strings.
struct InfoStrings {
    id: CString,
    version: CString,
    description: CString,
    /// Empty when the engine says nothing (then NULL on the wire).
    build_info: CString,
}

fn info_strings<E: Engine>() -> &'static InfoStrings {
    use std::sync::OnceLock;
    // One cell per plugin library: a cdylib declares exactly one engine type.
    static STRINGS: OnceLock<InfoStrings> = OnceLock::new();
    STRINGS.get_or_init(|| InfoStrings {
        id: cstring_lossy(E::ID),
        version: cstring_lossy(E::VERSION),
        description: cstring_lossy(E::DESCRIPTION),
        build_info: cstring_lossy(&E::build_info()),
    })
}

unsafe extern "C" fn shim_info<E: Engine>(out: *mut ffi::gantry_engine_info_t) {
    if out.is_null() {
        return;
    }
    guarded_void(|| {
        let s = info_strings::<E>();
        let full = ffi::gantry_engine_info_t {
            struct_size: size_of::<ffi::gantry_engine_info_t>() as u32,
            engine_id: s.id.as_ptr(),
            engine_version: s.version.as_ptr(),
            backend: E::BACKEND.as_raw(),
            description: s.description.as_ptr(),
            capabilities: E::CAPABILITIES,
            build_info: if s.build_info.is_empty() {
                std::ptr::null()
            } else {
                s.build_info.as_ptr()
            },
        };
        // SAFETY: `out` is non-null and host-allocated with its `struct_size` set; the
        // strings are static.
        unsafe {
            write_sized(
                out,
                &full,
                std::mem::offset_of!(ffi::gantry_engine_info_t, capabilities),
            )
        }
    });
}

unsafe extern "C" fn shim_create<E: Engine>(
    config: *const ffi::gantry_engine_config_t,
    host: *const ffi::gantry_host_api_t,
    out: *mut *mut ffi::gantry_engine_t,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: pointers are valid per the header's create() contract.
    unsafe {
        guarded(err, || {
            if config.is_null() || out.is_null() {
                return Err(EngineError::internal("create: null config or out pointer"));
            }
            let c = &*config;
            let backend = Backend::from_raw(c.backend).ok_or_else(|| {
                EngineError::unsupported(format!("unknown backend {}", c.backend))
            })?;
            let cfg = EngineConfig {
                backend,
                device_ids: slice_or_empty(c.device_ids, c.n_device_ids).to_vec(),
                vram_limit_bytes: c.vram_limit_bytes,
                n_threads: c.n_threads,
                max_batch_size: c.max_batch_size,
                context_length: c.context_length,
            };
            let log = if host.is_null() {
                HostLog::discard()
            } else {
                HostLog {
                    ctx: (*host).ctx,
                    log: (*host).log,
                }
            };
            let engine = E::create(cfg, log)?;
            *out = Box::into_raw(Box::new(engine)).cast();
            Ok(())
        })
    }
}

unsafe extern "C" fn shim_destroy<E: Engine>(engine: *mut ffi::gantry_engine_t) {
    if engine.is_null() {
        return;
    }
    // SAFETY: `engine` came from Box::into_raw in shim_create and is released once.
    guarded_void(|| drop(unsafe { Box::from_raw(engine.cast::<E>()) }));
}

unsafe extern "C" fn shim_load_model<E: Engine>(
    engine: *mut ffi::gantry_engine_t,
    desc: *const ffi::gantry_model_desc_t,
    out: *mut *mut ffi::gantry_model_t,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: pointers are valid per the header's load_model() contract.
    unsafe {
        guarded(err, || {
            if engine.is_null() || desc.is_null() || out.is_null() {
                return Err(EngineError::internal("load_model: null pointer"));
            }
            let engine = &*engine.cast::<E>();
            let d = &*desc;
            let format = Format::from_raw(d.format)
                .ok_or_else(|| EngineError::unsupported(format!("unknown format {}", d.format)))?;
            let desc = ModelDescriptor {
                model_id: opt_str(d.model_id).unwrap_or_default(),
                model_dir: PathBuf::from(opt_str(d.model_dir).unwrap_or_default()),
                primary_file: PathBuf::from(opt_str(d.primary_file).unwrap_or_default()),
                format,
                quantization: opt_str(d.quantization),
                mmproj: opt_str(d.mmproj).map(PathBuf::from),
                context_length: d.context_length,
                max_sequences: d.max_sequences,
                // Only a host that wrote the fields (ABI 1.3 or later) places the model.
                device_ids: if d.struct_size as usize
                    >= std::mem::offset_of!(ffi::gantry_model_desc_t, n_device_ids)
                        + size_of::<usize>()
                {
                    slice_or_empty(d.device_ids, d.n_device_ids).to_vec()
                } else {
                    Vec::new()
                },
            };
            let model = engine.load_model(&desc)?;
            let info = CModelInfo::new(model.info());
            *out = Box::into_raw(Box::new(ModelBox { model, info })).cast();
            Ok(())
        })
    }
}

/// # Safety
/// `model` must be a live handle from `shim_load_model` for model type `M`.
unsafe fn model_ref<'a, M: Model>(
    model: *mut ffi::gantry_model_t,
) -> Result<&'a ModelBox<M>, EngineError> {
    if model.is_null() {
        return Err(EngineError::internal("null model handle"));
    }
    // SAFETY: live handle of the right type by the caller's contract.
    Ok(unsafe { &*model.cast::<ModelBox<M>>() })
}

unsafe extern "C" fn shim_model_info<M: Model>(
    model: *mut ffi::gantry_model_t,
    out: *mut ffi::gantry_model_info_t,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle and host-allocated `out` per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            if out.is_null() {
                return Err(EngineError::internal("model_info: null out"));
            }
            m.info.write(&mut *out);
            Ok(())
        })
    }
}

#[allow(clippy::too_many_arguments)] // mirrors the C signature
unsafe extern "C" fn shim_tokenize<M: Model>(
    model: *mut ffi::gantry_model_t,
    text: *const c_char,
    text_len: usize,
    add_special: bool,
    parse_special: bool,
    tokens: *mut i32,
    capacity: usize,
    n_tokens: *mut usize,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: buffers are valid for the given lengths per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            let text = slice_or_empty(text.cast::<u8>(), text_len);
            let ids = m.model.tokenize(text, add_special, parse_special)?;
            let n = ids.len().min(capacity);
            if n > 0 && !tokens.is_null() {
                std::ptr::copy_nonoverlapping(ids.as_ptr(), tokens, n);
            }
            if n_tokens.is_null() {
                return Err(EngineError::internal("tokenize: null n_tokens"));
            }
            *n_tokens = ids.len();
            Ok(())
        })
    }
}

#[allow(clippy::too_many_arguments)] // mirrors the C signature
unsafe extern "C" fn shim_detokenize<M: Model>(
    model: *mut ffi::gantry_model_t,
    tokens: *const i32,
    n: usize,
    render_special: bool,
    buf: *mut c_char,
    capacity: usize,
    len: *mut usize,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: buffers are valid for the given lengths per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            let bytes = m
                .model
                .detokenize(slice_or_empty(tokens, n), render_special)?;
            let k = bytes.len().min(capacity);
            if k > 0 && !buf.is_null() {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), k);
            }
            if len.is_null() {
                return Err(EngineError::internal("detokenize: null len"));
            }
            *len = bytes.len();
            Ok(())
        })
    }
}

unsafe extern "C" fn shim_seq_open<M: Model>(
    model: *mut ffi::gantry_model_t,
    seq: *mut u64,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle and writable `seq` per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            if seq.is_null() {
                return Err(EngineError::internal("seq_open: null out"));
            }
            *seq = m.model.seq_open()?;
            Ok(())
        })
    }
}

unsafe extern "C" fn shim_seq_release<M: Model>(model: *mut ffi::gantry_model_t, seq: u64) {
    guarded_void(|| {
        // SAFETY: live handle per the header.
        if let Ok(m) = unsafe { model_ref::<M>(model) } {
            m.model.seq_release(seq);
        }
    });
}

unsafe extern "C" fn shim_step<M: Model>(
    model: *mut ffi::gantry_model_t,
    entries: *const ffi::gantry_step_entry_t,
    n_entries: usize,
    results: *mut ffi::gantry_step_result_t,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: `entries` and `results` hold `n_entries` elements per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            let raw = slice_or_empty(entries, n_entries);
            let samplings: Vec<Option<Sampling>> = raw
                .iter()
                .map(|e| {
                    (e.flags & ffi::GANTRY_STEP_SAMPLE != 0 && !e.sampling.is_null())
                        .then(|| sampling_from_c(&*e.sampling))
                })
                .collect();
            let mut safe = Vec::with_capacity(raw.len());
            for (e, s) in raw.iter().zip(&samplings) {
                if e.flags & ffi::GANTRY_STEP_SAMPLE != 0 && s.is_none() {
                    return Err(EngineError::internal("step: SAMPLE entry without sampling"));
                }
                let allowed = if s.is_some() {
                    allowed_from_c(&*e.sampling)
                } else {
                    None
                };
                safe.push(StepEntry {
                    seq: e.seq,
                    tokens: slice_or_empty(e.tokens, e.n_tokens),
                    sample: s.as_ref(),
                    fresh: e.flags & ffi::GANTRY_STEP_FRESH != 0,
                    allowed,
                });
            }
            let out = m.model.step(&safe)?;
            if out.len() != raw.len() {
                return Err(EngineError::internal(format!(
                    "step returned {} results for {} entries",
                    out.len(),
                    raw.len()
                )));
            }
            if results.is_null() && n_entries > 0 {
                return Err(EngineError::internal("step: null results"));
            }
            for (i, r) in out.into_iter().enumerate() {
                let Some(r) = r else { continue };
                let slot = &mut *results.add(i);
                slot.token = r.token;
                slot.logprob = r.logprob;
                let n = r.top.len().min(ffi::GANTRY_MAX_TOP_LOGPROBS);
                slot.n_top = n as u32;
                for (dst, (token, logprob)) in slot.top.iter_mut().zip(r.top.into_iter().take(n)) {
                    *dst = ffi::gantry_token_logprob_t { token, logprob };
                }
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn shim_embed<M: Model>(
    model: *mut ffi::gantry_model_t,
    tokens: *const i32,
    n_tokens: usize,
    out: *mut f32,
    capacity: usize,
    dims: *mut usize,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: buffers are valid for the given lengths per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            let v = m.model.embed(slice_or_empty(tokens, n_tokens))?;
            let k = v.len().min(capacity);
            if k > 0 && !out.is_null() {
                std::ptr::copy_nonoverlapping(v.as_ptr(), out, k);
            }
            if dims.is_null() {
                return Err(EngineError::internal("embed: null dims"));
            }
            *dims = v.len();
            Ok(())
        })
    }
}

unsafe extern "C" fn shim_seq_cached_tokens<M: Model>(
    model: *mut ffi::gantry_model_t,
    seq: u64,
) -> i64 {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: live handle per the header.
        let m = unsafe { model_ref::<M>(model) }.ok()?;
        m.model
            .seq_cached_tokens(seq)
            .map(|n| i64::try_from(n).unwrap_or(i64::MAX))
    }))
    .ok()
    .flatten()
    .unwrap_or(-1)
}

unsafe extern "C" fn shim_unload_model<M: Model>(model: *mut ffi::gantry_model_t) {
    if model.is_null() {
        return;
    }
    // SAFETY: `model` came from Box::into_raw in shim_load_model and is released once.
    guarded_void(|| drop(unsafe { Box::from_raw(model.cast::<ModelBox<M>>()) }));
}

/// Export an [`Engine`] implementation as a Gantry plugin.
///
/// ```text
/// gantry_engine_abi::declare_engine!(MyEngine);
/// ```
/// expands to the `gantry_engine_entry` symbol returning a static entry whose
/// vtable calls `MyEngine` through panic-catching shims.
#[macro_export]
macro_rules! declare_engine {
    ($engine:ty) => {
        static GANTRY_ENGINE_VTABLE: $crate::ffi::gantry_engine_vtable_t =
            $crate::sdk::vtable::<$engine>();
        static GANTRY_ENGINE_ENTRY: $crate::ffi::gantry_engine_entry_t =
            $crate::sdk::entry(&GANTRY_ENGINE_VTABLE);

        /// The plugin's one exported symbol (see gantry_engine.h).
        #[unsafe(no_mangle)]
        pub extern "C" fn gantry_engine_entry() -> *const $crate::ffi::gantry_engine_entry_t {
            &GANTRY_ENGINE_ENTRY
        }
    };
}
