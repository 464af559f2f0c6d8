//! Engine ABI, plugin side: LoRA adapters (ABI 1.6 `adapter_load`, `adapter_unload`,
//! `seq_set_adapter`, called by the host's scheduler between steps): the host's adapter
//! descriptor read into an [`AdapterDescriptor`] and handed to the [`Model`].

use crate::ffi;
use crate::types::*;

use super::Model;
use super::convert::opt_str;
use super::guard::{guarded, guarded_void};
use super::shims::model_ref;

pub(super) unsafe extern "C" fn shim_adapter_load<M: Model>(
    model: *mut ffi::gantry_model_t,
    desc: *const ffi::gantry_adapter_desc_t,
    out: *mut u64,
    bytes: *mut u64,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle, host-owned descriptor and out pointers per the header.
    unsafe {
        guarded(err, || {
            let m = model_ref::<M>(model)?;
            if desc.is_null() || out.is_null() || bytes.is_null() {
                return Err(EngineError::internal("adapter_load: null argument"));
            }
            let d = &*desc;
            let path =
                opt_str(d.path).ok_or_else(|| EngineError::internal("adapter_load: null path"))?;
            let format = Format::from_raw(d.format).ok_or_else(|| {
                EngineError::unsupported(format!("adapter format {} is unknown", d.format))
            })?;
            let loaded = m.model.adapter_load(&AdapterDescriptor {
                name: opt_str(d.name).unwrap_or_default(),
                path: path.into(),
                format,
                scale: d.scale,
            })?;
            *out = loaded.id;
            *bytes = loaded.bytes;
            Ok(())
        })
    }
}

pub(super) unsafe extern "C" fn shim_adapter_unload<M: Model>(
    model: *mut ffi::gantry_model_t,
    adapter: u64,
) {
    guarded_void(|| {
        // SAFETY: live handle per the header.
        if let Ok(m) = unsafe { model_ref::<M>(model) } {
            m.model.adapter_unload(adapter);
        }
    });
}

pub(super) unsafe extern "C" fn shim_seq_set_adapter<M: Model>(
    model: *mut ffi::gantry_model_t,
    seq: u64,
    adapter: u64,
    err: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    // SAFETY: live handle per the header.
    unsafe {
        guarded(err, || {
            model_ref::<M>(model)?.model.seq_set_adapter(seq, adapter)
        })
    }
}
