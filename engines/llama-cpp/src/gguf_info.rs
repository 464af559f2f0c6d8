//! The llama.cpp plugin's view of a GGUF file's header (adapter load → `adapters.rs` checks):
//! its string metadata and tensor shapes, read with llama.cpp's own GGUF reader (`gguf.h`,
//! `no_alloc`: no tensor data is read). The plugin is written against the engine ABI alone, as
//! an outside vendor's would be, so it reads files with the library it wraps rather than with a
//! Gantry crate.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::path::Path;

/// What the adapter checks need of a GGUF header.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct GgufInfo {
    /// The string-valued metadata (other kinds are left out).
    pub(crate) metadata: BTreeMap<String, String>,
    pub(crate) tensors: Vec<TensorInfo>,
    /// Absolute file offset of the tensor data.
    pub(crate) data_offset: u64,
}

/// One tensor's name and shape, ggml order (`dims[0]` contiguous), at least two dimensions
/// (trailing 1s beyond the second dropped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TensorInfo {
    pub(crate) name: String,
    pub(crate) dims: Vec<u64>,
}

impl GgufInfo {
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    pub(crate) fn architecture(&self) -> Option<&str> {
        self.get("general.architecture")
    }
}

/// Read `path`'s header; the error says why llama.cpp could not.
pub(crate) fn read(path: &Path) -> Result<GgufInfo, String> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| "its path has a NUL byte".to_string())?;
    let params = llama_cpp_sys_2::gguf_init_params {
        no_alloc: true,
        ctx: std::ptr::null_mut(),
    };
    // SAFETY: a NUL-terminated path valid for the call; with `ctx` null llama.cpp makes no
    // ggml context and reads only the header (`no_alloc`).
    let ctx = unsafe { llama_cpp_sys_2::gguf_init_from_file(c_path.as_ptr(), params) };
    if ctx.is_null() {
        return Err("llama.cpp cannot read it as GGUF".into());
    }
    let text = |p: *const std::os::raw::c_char| {
        // SAFETY: llama.cpp returns NUL-terminated strings owned by `ctx`, alive until
        // `gguf_free` below; they are copied at once.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    let mut info = GgufInfo::default();
    // SAFETY (this block): `ctx` is a live context from `gguf_init_from_file`; every index is
    // below the counts llama.cpp reports; `ne` points at GGML_MAX_DIMS (4) values.
    unsafe {
        for k in 0..llama_cpp_sys_2::gguf_get_n_kv(ctx) {
            if llama_cpp_sys_2::gguf_get_kv_type(ctx, k) == llama_cpp_sys_2::GGUF_TYPE_STRING
                && let (Some(key), Some(value)) = (
                    text(llama_cpp_sys_2::gguf_get_key(ctx, k)),
                    text(llama_cpp_sys_2::gguf_get_val_str(ctx, k)),
                )
            {
                info.metadata.insert(key, value);
            }
        }
        for t in 0..llama_cpp_sys_2::gguf_get_n_tensors(ctx) {
            let name = text(llama_cpp_sys_2::gguf_get_tensor_name(ctx, t)).unwrap_or_default();
            let ne = std::slice::from_raw_parts(llama_cpp_sys_2::gguf_get_tensor_ne(ctx, t), 4);
            let mut dims: Vec<u64> = ne.iter().map(|&n| n.max(0) as u64).collect();
            while dims.len() > 2 && dims.last() == Some(&1) {
                dims.pop();
            }
            info.tensors.push(TensorInfo { name, dims });
        }
        info.data_offset = llama_cpp_sys_2::gguf_get_data_offset(ctx) as u64;
        llama_cpp_sys_2::gguf_free(ctx);
    }
    Ok(info)
}
