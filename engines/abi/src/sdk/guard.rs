//! Engine ABI, plugin side: panic containment (around every trait call a shim makes): a
//! panic or an `Err` becomes a status code plus a message in the host's error buffer, and
//! nothing unwinds into the host (since Rust 1.81 that would abort the whole node).

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::ffi;
use crate::types::*;

use super::convert::write_error;

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

/// Run `f`, mapping both `Err` and a panic to a status plus message.
///
/// # Safety
/// `err` must be null or point to a writable `gantry_error_t`.
pub(super) unsafe fn guarded(
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
pub(super) fn guarded_void(f: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(f));
}
