//! Where the ONNX plugin's run-time libraries are (model load, before the first session): ONNX
//! Runtime and espeak-ng are shared libraries the plugin opens itself, found by an environment
//! variable (a development checkout points it at the wheels `scripts/setup.sh` unpacked) or
//! beside the plugin library (the plugin image ships them there).

use std::ffi::c_void;
use std::path::{Path, PathBuf};

/// ONNX Runtime's library: `GANTRY_ONNXRUNTIME_LIB`, else beside the plugin.
pub const ORT_ENV: &str = "GANTRY_ONNXRUNTIME_LIB";
/// espeak-ng's library: `GANTRY_ESPEAK_LIB`, else beside the plugin.
pub const ESPEAK_ENV: &str = "GANTRY_ESPEAK_LIB";
/// espeak-ng's data directory: `GANTRY_ESPEAK_DATA`, else `espeak-ng-data` beside the plugin.
pub const ESPEAK_DATA_ENV: &str = "GANTRY_ESPEAK_DATA";

/// The directory of the shared object this code was loaded from (the plugin), as the loader
/// opened it.
fn plugin_dir() -> Option<PathBuf> {
    // SAFETY: an all-zero Dl_info is a valid out value (null pointers).
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let here = plugin_dir as fn() -> Option<PathBuf> as *const c_void;
    // SAFETY: `here` is an address inside this library and `info` is a valid out pointer;
    // dladdr only reads the loader's tables.
    let found = unsafe { libc::dladdr(here, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader, valid while the library
    // stays loaded; it is copied at once.
    let path = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(path.to_string_lossy().into_owned());
    path.parent().map(Path::to_path_buf)
}

/// The first existing file or directory among `env` and `names` beside the plugin; the error
/// says every place that was tried.
pub fn find(env: &str, names: &[&str], what: &str) -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.exists() {
            Ok(p)
        } else {
            Err(format!("{what}: {env}={} does not exist", p.display()))
        };
    }
    let dir = plugin_dir();
    let tried: Vec<PathBuf> = match &dir {
        Some(d) => names.iter().map(|n| d.join(n)).collect(),
        None => Vec::new(),
    };
    tried.iter().find(|p| p.exists()).cloned().ok_or_else(|| {
        format!(
            "{what} not found: set {env}, or ship it beside the plugin ({})",
            if tried.is_empty() {
                "the plugin's directory is unknown".to_string()
            } else {
                tried
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        )
    })
}
