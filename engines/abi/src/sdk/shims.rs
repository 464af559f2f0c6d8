//! Engine ABI, plugin side: the exported entry and its vtable (the host's every call into a
//! plugin lands here): generic `extern "C"` shims that check the host's pointers, convert the
//! C structs ([`super::convert`]), call the [`Engine`]/[`Model`] method inside the panic guard
//! ([`super::guard`]) and write the results back.

use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use crate::ffi;
use crate::types::*;

use super::convert::{
    CModelInfo, allowed_from_c, cstring_lossy, opt_str, sampling_from_c, slice_or_empty,
    write_sized,
};
use super::guard::{guarded, guarded_void};
use super::{Engine, HostLog, Model};

/// Everything the shims need behind a `gantry_model_t*`.
pub(super) struct ModelBox<M> {
    pub(super) model: M,
    /// The C view of `model.info()`, built once so its pointers stay valid until unload.
    info: CModelInfo,
    /// The last piece of each open speech (ABI 1.10), kept until the next `speech_next` for
    /// it or its `speech_close`: the host reads the samples through the pointer it was given.
    pub(super) pieces: std::sync::Mutex<std::collections::HashMap<u64, Vec<f32>>>,
    /// The last `model_counters` answer (ABI 1.12), kept until the next: the host reads the
    /// array and its names through the pointer it was given.
    pub(super) counters: std::sync::Mutex<(Vec<CString>, Vec<ffi::gantry_counter_t>)>,
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
        seq_fork: Some(shim_seq_fork::<E::Model>),
        seq_truncate: Some(shim_seq_truncate::<E::Model>),
        adapter_load: Some(super::adapters::shim_adapter_load::<E::Model>),
        adapter_unload: Some(super::adapters::shim_adapter_unload::<E::Model>),
        seq_set_adapter: Some(super::adapters::shim_seq_set_adapter::<E::Model>),
        embed_batch: Some(shim_embed_batch::<E::Model>),
        seq_set_input: Some(super::media::shim_seq_set_input::<E::Model>),
        speech_open: Some(super::media::shim_speech_open::<E::Model>),
        speech_next: Some(super::media::shim_speech_next::<E::Model>),
        speech_close: Some(super::media::shim_speech_close::<E::Model>),
        seq_token_times: Some(super::media::shim_seq_token_times::<E::Model>),
        seq_token_prob: Some(super::media::shim_seq_token_prob::<E::Model>),
        model_counters: Some(super::counters::shim_model_counters::<E::Model>),
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
                // Only a host of ABI 1.12 or later says a model's threads.
                n_threads: if d.struct_size as usize
                    >= std::mem::offset_of!(ffi::gantry_model_desc_t, n_threads) + size_of::<u32>()
                {
                    d.n_threads
                } else {
                    0
                },
            };
            let model = engine.load_model(&desc)?;
            let info = CModelInfo::new(model.info());
            *out = Box::into_raw(Box::new(ModelBox {
                model,
                info,
                pieces: Default::default(),
                counters: Default::default(),
            }))
            .cast();
            Ok(())
        })
    }
}

/// # Safety
/// `model` must be a live handle from `shim_load_model` for model type `M`.
pub(super) unsafe fn model_ref<'a, M: Model>(
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
                    sample_all: e.flags & ffi::GANTRY_STEP_SAMPLE_ALL != 0,
                });
            }
            let slots: usize = safe.iter().map(StepEntry::result_slots).sum();
            let out = m.model.step(&safe)?;
            if out.len() != slots {
                return Err(EngineError::internal(format!(
                    "step returned {} results for {} entries ({slots} result slots)",
                    out.len(),
                    raw.len()
                )));
            }
            if results.is_null() && slots > 0 {
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

unsafe extern "C" fn shim_seq_fork<M: Model>(
    model: *mut ffi::gantry_model_t,
    src: u64,
    out: *mut u64,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle and host-owned out pointer per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            if out.is_null() {
                return Err(EngineError::internal("seq_fork: null out"));
            }
            *out = m.model.seq_fork(src)?;
            Ok(())
        })
    }
}

unsafe extern "C" fn shim_seq_truncate<M: Model>(
    model: *mut ffi::gantry_model_t,
    seq: u64,
    n_keep: u64,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            let n = usize::try_from(n_keep)
                .map_err(|_| EngineError::internal("seq_truncate: n_keep out of range"))?;
            m.model.seq_truncate(seq, n)
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

#[allow(clippy::too_many_arguments)] // The ABI's signature.
unsafe extern "C" fn shim_embed_batch<M: Model>(
    model: *mut ffi::gantry_model_t,
    tokens: *const i32,
    lengths: *const usize,
    n_inputs: usize,
    out: *mut f32,
    capacity: usize,
    dims: *mut usize,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: buffers are valid for the given lengths per the header: `lengths` holds
    // `n_inputs` counts and `tokens` their sum.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            let lengths = slice_or_empty(lengths, n_inputs);
            let total = lengths
                .iter()
                .try_fold(0usize, |a, &n| a.checked_add(n))
                .ok_or_else(|| EngineError::internal("embed_batch: lengths overflow"))?;
            let all = slice_or_empty(tokens, total);
            let mut inputs = Vec::with_capacity(n_inputs);
            let mut at = 0;
            for &n in lengths {
                inputs.push(&all[at..at + n]);
                at += n;
            }
            let vectors = m.model.embed_batch(&inputs)?;
            if vectors.len() != n_inputs {
                return Err(EngineError::internal(format!(
                    "embed_batch: {} vectors for {n_inputs} inputs",
                    vectors.len()
                )));
            }
            let d = vectors.first().map_or(0, Vec::len);
            if vectors.iter().any(|v| v.len() != d) {
                return Err(EngineError::internal(
                    "embed_batch: vectors of different sizes",
                ));
            }
            if dims.is_null() {
                return Err(EngineError::internal("embed_batch: null dims"));
            }
            *dims = d;
            if n_inputs * d <= capacity && !out.is_null() {
                for (i, v) in vectors.iter().enumerate() {
                    std::ptr::copy_nonoverlapping(v.as_ptr(), out.add(i * d), d);
                }
            }
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
