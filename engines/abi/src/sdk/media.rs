//! Engine ABI, plugin side: the inputs a sequence is conditioned on (ABI 1.9 `seq_set_input`,
//! called by the host between `seq_open` and the sequence's first step): the C
//! `gantry_input_t` read into an [`Input`] and handed to [`Model::seq_set_input`].

use crate::ffi;
use crate::types::*;

use super::Model;
use super::convert::slice_or_empty;
use super::guard::guarded;
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
    match i.kind {
        ffi::GANTRY_INPUT_AUDIO => Ok(Input::Audio {
            // SAFETY: `n` floats at `data` (the header's rule for audio).
            samples: unsafe { slice_or_empty(i.data.cast::<f32>(), i.n) },
            sample_rate: i.sample_rate,
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
