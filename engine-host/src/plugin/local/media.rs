//! Engine host, in-process model calls for inputs and media (call boundary: the scheduler's
//! admission and finish, and its speech turns, land here for a plugin in this process): ABI
//! 1.9's `seq_set_input`, 1.10's speech calls and 1.11's token times and probability, each a
//! vtable slot a plugin may lack. `LocalModel`'s exec calls (`local.rs`) delegate here; their
//! `&mut` keeps these calls exclusive.

use gantry_engine_abi::ffi;
use gantry_engine_abi::{EngineError, Input, SpeechPiece, SpeechRequest};

use super::LocalModel;
use crate::plugin::library::{cstring, fill_growing, new_err, read_err};

/// What a plugin without ABI 1.11's `seq_token_times` is told when asked for token times.
const NO_TOKEN_TIMES: &str =
    "the plugin does not align tokens with their audio (no ABI 1.11 seq_token_times)";

pub(super) fn seq_set_input(
    m: &mut LocalModel,
    seq: u64,
    input: &Input<'_>,
) -> Result<(), EngineError> {
    let h = &m.0;
    let f = h.plugin.vt.seq_set_input.ok_or_else(|| {
        EngineError::unsupported("the plugin takes no inputs (no ABI 1.9 seq_set_input)")
    })?;
    let raw = match *input {
        Input::Audio {
            samples,
            sample_rate,
            align,
        } => {
            if align && h.plugin.vt.seq_token_times.is_none() {
                return Err(EngineError::unsupported(NO_TOKEN_TIMES));
            }
            ffi::gantry_input_t {
                struct_size: size_of::<ffi::gantry_input_t>() as u32,
                kind: ffi::GANTRY_INPUT_AUDIO,
                data: samples.as_ptr().cast(),
                n: samples.len(),
                sample_rate,
                width: 0,
                height: 0,
                flags: if align { ffi::GANTRY_INPUT_ALIGN } else { 0 },
            }
        }
        Input::Image { rgb, width, height } => ffi::gantry_input_t {
            struct_size: size_of::<ffi::gantry_input_t>() as u32,
            kind: ffi::GANTRY_INPUT_IMAGE,
            data: rgb.as_ptr().cast(),
            n: rgb.len(),
            sample_rate: 0,
            width,
            height,
            flags: 0,
        },
    };
    let mut err = new_err();
    // SAFETY: live handle; `raw` and the slice it points into outlive the call;
    // `&mut` on the model keeps exec calls exclusive.
    let status = unsafe { f(h.raw, seq, &raw, err.as_mut()) };
    if status != ffi::GANTRY_OK {
        return Err(read_err(status, &err));
    }
    Ok(())
}

pub(super) fn speech_open(m: &mut LocalModel, req: &SpeechRequest<'_>) -> Result<u64, EngineError> {
    let h = &m.0;
    let f = h.plugin.vt.speech_open.ok_or_else(|| {
        EngineError::unsupported("the plugin synthesizes no speech (no ABI 1.10 speech_open)")
    })?;
    let voice = req.voice.map(cstring);
    let raw = ffi::gantry_speech_request_t {
        struct_size: size_of::<ffi::gantry_speech_request_t>() as u32,
        text: req.text.as_ptr().cast(),
        n_text: req.text.len(),
        voice: voice.as_ref().map_or(std::ptr::null(), |v| v.as_ptr()),
        speed: req.speed,
    };
    let mut id = 0u64;
    let mut err = new_err();
    // SAFETY: live handle; `raw`, the text and the voice outlive the call; `&mut` on the model
    // keeps exec calls exclusive.
    let status = unsafe { f(h.raw, &raw, &mut id, err.as_mut()) };
    if status != ffi::GANTRY_OK {
        return Err(read_err(status, &err));
    }
    Ok(id)
}

pub(super) fn speech_next(m: &mut LocalModel, speech: u64) -> Result<SpeechPiece, EngineError> {
    let h = &m.0;
    let f = h.plugin.vt.speech_next.ok_or_else(|| {
        EngineError::unsupported("the plugin synthesizes no speech (no ABI 1.10 speech_next)")
    })?;
    let (mut samples, mut n, mut done) = (std::ptr::null::<f32>(), 0usize, false);
    let mut err = new_err();
    // SAFETY: live handle, host-owned out values; `&mut` on the model keeps exec calls exclusive.
    let status = unsafe { f(h.raw, speech, &mut samples, &mut n, &mut done, err.as_mut()) };
    if status != ffi::GANTRY_OK {
        return Err(read_err(status, &err));
    }
    let samples = if samples.is_null() || n == 0 {
        Vec::new()
    } else {
        // SAFETY: the plugin keeps `n` samples at `samples` until the next call for this
        // speech (header rule); they are copied out now.
        unsafe { std::slice::from_raw_parts(samples, n) }.to_vec()
    };
    Ok(SpeechPiece { samples, done })
}

pub(super) fn seq_token_times(
    m: &mut LocalModel,
    seq: u64,
    first: usize,
) -> Result<Vec<f32>, EngineError> {
    let h = &m.0;
    let f = h
        .plugin
        .vt
        .seq_token_times
        .ok_or_else(|| EngineError::unsupported(NO_TOKEN_TIMES))?;
    // A sequence's tokens fit Whisper's decoder context: 512 holds them at once.
    fill_growing("seq_token_times", 512, |out: &mut [f32], n, err| {
        // SAFETY: live handle; `out` holds `out.len()` floats and `n` is writable for the
        // call; `&mut` on the model keeps exec calls exclusive.
        unsafe { f(h.raw, seq, first, out.as_mut_ptr(), out.len(), n, err) }
    })
}

pub(super) fn seq_token_prob(
    m: &mut LocalModel,
    seq: u64,
    n_fed: usize,
    token: i32,
) -> Result<f32, EngineError> {
    let h = &m.0;
    let f = h.plugin.vt.seq_token_prob.ok_or_else(|| {
        EngineError::unsupported(
            "the plugin does not report a token's probability (no ABI 1.11 seq_token_prob)",
        )
    })?;
    let mut p = 0f32;
    let mut err = new_err();
    // SAFETY: live handle, host-owned out value; `&mut` on the model keeps exec calls exclusive.
    let status = unsafe { f(h.raw, seq, n_fed, token, &mut p, err.as_mut()) };
    if status != ffi::GANTRY_OK {
        return Err(read_err(status, &err));
    }
    Ok(p)
}

pub(super) fn speech_close(m: &mut LocalModel, speech: u64) {
    let h = &m.0;
    if let Some(f) = h.plugin.vt.speech_close {
        // SAFETY: live handle; `&mut` on the model keeps exec calls exclusive.
        unsafe { f(h.raw, speech) }
    }
}
