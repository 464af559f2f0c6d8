//! Engine ABI, plugin side: the C structs read and written across the boundary (under every
//! shim, between the host's call and the trait method): strings and arrays from the host,
//! sampling parameters, the model info and error out-structs, sized by the host's
//! `struct_size` so a newer plugin never writes past an older host's struct.

use std::ffi::{CStr, CString, c_char};

use crate::ffi;
use crate::types::*;

pub(super) struct CModelInfo {
    architecture: CString,
    bos_text: Option<CString>,
    eos_text: Option<CString>,
    chat_template: Option<CString>,
    eog_tokens: Vec<i32>,
    /// The voices joined by `\n` (ABI 1.10); `None` without voices.
    voices: Option<CString>,
    info: ModelInfo,
}

impl CModelInfo {
    pub(super) fn new(info: ModelInfo) -> Self {
        let c = |s: &Option<String>| s.as_deref().map(cstring_lossy);
        Self {
            architecture: cstring_lossy(&info.architecture),
            bos_text: c(&info.bos_text),
            eos_text: c(&info.eos_text),
            chat_template: c(&info.chat_template),
            eog_tokens: info.eog_tokens.clone(),
            voices: (!info.voices.is_empty()).then(|| cstring_lossy(&info.voices.join("\n"))),
            info,
        }
    }

    pub(super) fn write(&self, out: &mut ffi::gantry_model_info_t) {
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
            recurrent_state_bytes: i.recurrent_state_bytes,
            audio_sample_rate: i.audio_sample_rate,
            audio_max_samples: i.audio_max_samples,
            voices: opt(&self.voices),
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
pub(super) unsafe fn write_sized<T>(out: *mut T, full: &T, legacy: usize) {
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

pub(super) fn cstring_lossy(s: &str) -> CString {
    CString::new(s.replace('\0', "")).unwrap_or_default()
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

/// # Safety
/// `p` must be null or a NUL-terminated string valid for this call.
pub(super) unsafe fn opt_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: non-null and NUL-terminated by the caller's contract.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

/// # Safety
/// `p` must be null or point to `n` readable values of `T` valid for `'a`.
pub(super) unsafe fn slice_or_empty<'a, T>(p: *const T, n: usize) -> &'a [T] {
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
