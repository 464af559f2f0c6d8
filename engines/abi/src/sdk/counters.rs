//! Engine ABI, plugin side: a model's counters (ABI 1.12 `model_counters`, called by the
//! host's scheduler between steps about once a second): [`Model::counters`] as a C array, kept
//! with its names in the model's box until the next call.

use std::ffi::CString;

use crate::ffi;
use crate::types::*;

use super::Model;
use super::convert::cstring_lossy;
use super::guard::guarded;
use super::shims::model_ref;

pub(super) unsafe extern "C" fn shim_model_counters<M: Model>(
    model: *mut ffi::gantry_model_t,
    counters: *mut *const ffi::gantry_counter_t,
    n: *mut usize,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle; `counters` and `n` are writable (host-owned, per the header). The
    // array and its names live in the model's box until the next call replaces them.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            if counters.is_null() || n.is_null() {
                return Err(EngineError::internal("model_counters: null out pointer"));
            }
            let now = m.model.counters();
            let names: Vec<CString> = now.iter().map(|(name, _)| cstring_lossy(name)).collect();
            let mut kept = m.counters.lock().unwrap_or_else(|p| p.into_inner());
            let array = names
                .iter()
                .zip(now.iter().map(|(_, v)| *v))
                .map(|(name, value)| ffi::gantry_counter_t {
                    name: name.as_ptr(),
                    value,
                })
                .collect();
            *kept = (names, array);
            *counters = kept.1.as_ptr();
            *n = kept.1.len();
            Ok(())
        })
    }
}
