//! Engine ABI, plugin side: media in and out. The inputs a sequence is conditioned on (ABI 1.9
//! `seq_set_input`, called by the host between `seq_open` and the sequence's first step): the
//! C `gantry_input_t` read into an [`Input`] and handed to [`Model::seq_set_input`]. Speech
//! out (ABI 1.10 `speech_open` / `speech_next` / `speech_close`, called by the host's
//! scheduler between steps): the request read into a [`SpeechRequest`], each piece kept in
//! the model's box until the host's next call for it.

use std::ffi::CStr;

use crate::ffi;
use crate::types::*;

use super::Model;
use super::convert::slice_or_empty;
use super::guard::{guarded, guarded_void};
use super::shims::model_ref;

/// The host's input as an [`Input`]; an unknown kind is refused naming it.
///
/// # Safety
/// `input` must be null or point to a `gantry_input_t` whose `data` holds `n` elements of its
/// kind, valid for the call.
unsafe fn input_from_c<'a>(input: *const ffi::gantry_input_t) -> Result<Input<'a>, EngineError> {
    if input.is_null() {
        return Err(EngineError::internal("seq_set_input: null input"));
    }
    // SAFETY: non-null, host-owned for the call (caller's contract).
    let i = unsafe { &*input };
    // `flags` exists only where the host's struct reaches it (ABI 1.11).
    let flags_end = std::mem::offset_of!(ffi::gantry_input_t, flags) + size_of::<u64>();
    let flags = if i.struct_size as usize >= flags_end {
        i.flags
    } else {
        0
    };
    match i.kind {
        ffi::GANTRY_INPUT_AUDIO => Ok(Input::Audio {
            // SAFETY: `n` floats at `data` (the header's rule for audio).
            samples: unsafe { slice_or_empty(i.data.cast::<f32>(), i.n) },
            sample_rate: i.sample_rate,
            align: flags & ffi::GANTRY_INPUT_ALIGN != 0,
        }),
        ffi::GANTRY_INPUT_IMAGE => Ok(Input::Image {
            // SAFETY: `n` bytes at `data` (the header's rule for images).
            rgb: unsafe { slice_or_empty(i.data.cast::<u8>(), i.n) },
            width: i.width,
            height: i.height,
        }),
        other => Err(EngineError::unsupported(format!(
            "seq_set_input: input kind {other} is unknown to this plugin"
        ))),
    }
}

pub(super) unsafe extern "C" fn shim_seq_set_input<M: Model>(
    model: *mut ffi::gantry_model_t,
    seq: u64,
    input: *const ffi::gantry_input_t,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle and host-owned input per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            m.model.seq_set_input(seq, &input_from_c(input)?)
        })
    }
}

/// The host's speech request; text that is not UTF-8 is refused.
///
/// # Safety
/// `req` must be null or point to a `gantry_speech_request_t` whose `text` holds `n_text`
/// bytes and whose `voice` is null or NUL-terminated, valid for the call.
unsafe fn speech_from_c<'a>(
    req: *const ffi::gantry_speech_request_t,
) -> Result<SpeechRequest<'a>, EngineError> {
    if req.is_null() {
        return Err(EngineError::internal("speech_open: null request"));
    }
    // SAFETY: non-null, host-owned for the call (caller's contract).
    let r = unsafe { &*req };
    // SAFETY: `n_text` bytes at `text` (the header's rule).
    let text = unsafe { slice_or_empty(r.text.cast::<u8>(), r.n_text) };
    let text = std::str::from_utf8(text).map_err(|e| {
        EngineError::unsupported(format!("speech_open: the text is not UTF-8: {e}"))
    })?;
    let voice =
        if r.voice.is_null() {
            None
        } else {
            // SAFETY: non-null and NUL-terminated (the header's rule).
            let v = unsafe { CStr::from_ptr(r.voice) };
            Some(v.to_str().map_err(|_| {
                EngineError::unsupported("speech_open: the voice name is not UTF-8")
            })?)
        };
    Ok(SpeechRequest {
        text,
        voice,
        speed: r.speed,
    })
}

pub(super) unsafe extern "C" fn shim_speech_open<M: Model>(
    model: *mut ffi::gantry_model_t,
    req: *const ffi::gantry_speech_request_t,
    speech: *mut u64,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle, host-owned request and out pointer per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            if speech.is_null() {
                return Err(EngineError::internal("speech_open: null out"));
            }
            let id = m.model.speech_open(&speech_from_c(req)?)?;
            if id == 0 {
                return Err(EngineError::internal(
                    "speech_open: the engine returned handle 0",
                ));
            }
            *speech = id;
            Ok(())
        })
    }
}

pub(super) unsafe extern "C" fn shim_speech_next<M: Model>(
    model: *mut ffi::gantry_model_t,
    speech: u64,
    samples: *mut *const f32,
    n: *mut usize,
    done: *mut bool,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle and host-owned out pointers per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            if samples.is_null() || n.is_null() || done.is_null() {
                return Err(EngineError::internal("speech_next: null out"));
            }
            let piece = m.model.speech_next(speech)?;
            let mut pieces = m.pieces.lock().unwrap_or_else(|p| p.into_inner());
            // The previous piece of this speech is dropped here: the host has read it.
            let kept = pieces.entry(speech).or_default();
            *kept = piece.samples;
            *samples = kept.as_ptr();
            *n = kept.len();
            *done = piece.done;
            Ok(())
        })
    }
}

pub(super) unsafe extern "C" fn shim_speech_close<M: Model>(
    model: *mut ffi::gantry_model_t,
    speech: u64,
) {
    guarded_void(|| {
        // SAFETY: live handle per the header.
        if let Ok(m) = unsafe { model_ref::<M>(model) } {
            m.pieces
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&speech);
            m.model.speech_close(speech);
        }
    })
}

pub(super) unsafe extern "C" fn shim_seq_token_times<M: Model>(
    model: *mut ffi::gantry_model_t,
    seq: u64,
    first: usize,
    times: *mut f32,
    capacity: usize,
    n: *mut usize,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle; `times` holds `capacity` floats and `n` is writable (host-owned,
    // per the header).
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            let t = m.model.seq_token_times(seq, first)?;
            if n.is_null() {
                return Err(EngineError::internal("seq_token_times: null count"));
            }
            if !times.is_null() {
                let k = t.len().min(capacity);
                std::ptr::copy_nonoverlapping(t.as_ptr(), times, k);
            }
            *n = t.len();
            Ok(())
        })
    }
}

pub(super) unsafe extern "C" fn shim_seq_token_prob<M: Model>(
    model: *mut ffi::gantry_model_t,
    seq: u64,
    n_fed: usize,
    token: i32,
    prob: *mut f32,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle; `prob` is writable (host-owned, per the header).
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            let p = m.model.seq_token_prob(seq, n_fed, token)?;
            if prob.is_null() {
                return Err(EngineError::internal("seq_token_prob: null out value"));
            }
            *prob = p;
            Ok(())
        })
    }
}
