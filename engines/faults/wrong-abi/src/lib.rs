//! Fault-injection plugin (engine layer, tests only): reports ABI major 99.
//!
//! Every exported function appends its name to `<tmp>/gantry-fault-trace-<pid>`,
//! so a test (same process, same pid) can prove the host called the entry
//! symbol and nothing else before refusing the plugin.
#![allow(unsafe_code)] // An engine crate: it *is* the C ABI.

use std::io::Write as _;

use gantry_engine_abi::ffi;

/// Where this process's trace goes; tests compute the same path.
pub fn trace_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("gantry-fault-trace-{}", std::process::id()))
}

fn trace(what: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(trace_path())
    {
        let _ = writeln!(f, "{what}");
    }
}

unsafe extern "C" fn info(_out: *mut ffi::gantry_engine_info_t) {
    trace("info");
}

unsafe extern "C" fn create(
    _c: *const ffi::gantry_engine_config_t,
    _h: *const ffi::gantry_host_api_t,
    _o: *mut *mut ffi::gantry_engine_t,
    _e: *mut ffi::gantry_error_t,
) -> ffi::gantry_status_t {
    trace("create");
    ffi::GANTRY_INTERNAL
}

unsafe extern "C" fn destroy(_e: *mut ffi::gantry_engine_t) {
    trace("destroy");
}

/// A vtable whose only populated slots trace; the host must not reach them.
static VTABLE: ffi::gantry_engine_vtable_t = ffi::gantry_engine_vtable_t {
    struct_size: size_of::<ffi::gantry_engine_vtable_t>() as u32,
    info: Some(info),
    create: Some(create),
    destroy: Some(destroy),
    load_model: None,
    model_info: None,
    tokenize: None,
    detokenize: None,
    seq_open: None,
    seq_release: None,
    step: None,
    embed: None,
    unload_model: None,
    seq_cached_tokens: None,
    seq_fork: None,
    seq_truncate: None,
    adapter_load: None,
    adapter_unload: None,
    seq_set_adapter: None,
    embed_batch: None,
    seq_set_input: None,
    speech_open: None,
    speech_next: None,
    speech_close: None,
    seq_token_times: None,
    seq_token_prob: None,
    model_counters: None,
};

static ENTRY: ffi::gantry_engine_entry_t = ffi::gantry_engine_entry_t {
    abi_major: 99,
    abi_minor: 0,
    struct_size: size_of::<ffi::gantry_engine_entry_t>() as u32,
    vtable: &VTABLE,
};

/// The entry symbol, with a major version no host supports.
#[unsafe(no_mangle)]
pub extern "C" fn gantry_engine_entry() -> *const ffi::gantry_engine_entry_t {
    trace("entry");
    &ENTRY
}
