//! llama.cpp engine, logging: routes llama.cpp's and ggml's log output through the host's log callback.
//!
//! llama.cpp logs in fragments (a line may arrive in several calls, the later
//! ones at level CONT), so fragments are buffered until a newline and each
//! whole line goes to the host once, which prefixes it with the plugin id.
//!
//! llama.cpp's log hook is global to this copy of the library while engines
//! come and go, so every engine registers its host logger and unregisters it
//! on drop; lines go to the newest live one. A logger is never used after its
//! engine is destroyed (the host frees the callback's context then).

use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use gantry_engine_abi::LogLevel;
use gantry_engine_abi::sdk::HostLog;
use llama_cpp_sys_2::ggml_log_level;

struct Router {
    /// Live engines' loggers, newest last, keyed by a registration id.
    hosts: Mutex<Vec<(u64, HostLog)>>,
    pending: Mutex<(LogLevel, String)>,
    next: AtomicU64,
}

static ROUTER: OnceLock<Router> = OnceLock::new();

fn router() -> &'static Router {
    ROUTER.get_or_init(|| Router {
        hosts: Mutex::new(Vec::new()),
        pending: Mutex::new((LogLevel::Info, String::new())),
        next: AtomicU64::new(1),
    })
}

/// Keeps an engine's logger registered; unregisters it on drop.
pub(crate) struct Registration(u64);

impl Drop for Registration {
    fn drop(&mut self) {
        let mut hosts = router().hosts.lock().unwrap_or_else(|p| p.into_inner());
        hosts.retain(|(id, _)| *id != self.0);
    }
}

/// Route llama.cpp's logs to `host` until the returned registration is dropped.
pub(crate) fn route_to_host(host: HostLog) -> Registration {
    let router = router();
    let id = router.next.fetch_add(1, Ordering::Relaxed);
    router
        .hosts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((id, host));
    let user = std::ptr::from_ref(router).cast_mut().cast::<c_void>();
    // SAFETY: `router` is a static that outlives every callback; the callback
    // only reads it through a shared reference.
    unsafe {
        llama_cpp_sys_2::llama_log_set(Some(on_log), user);
        llama_cpp_sys_2::ggml_log_set(Some(on_log), user);
    }
    Registration(id)
}

/// A line of the engine's own at `level`, to the newest live host logger.
fn own_line(level: LogLevel, line: &str) {
    let hosts = router().hosts.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, host)) = hosts.last() {
        host.log(level, line);
    }
}

/// A line of the engine's own at debug level.
pub(crate) fn debug(line: &str) {
    own_line(LogLevel::Debug, line);
}

/// A line of the engine's own at warning level.
pub(crate) fn warn(line: &str) {
    own_line(LogLevel::Warn, line);
}

thread_local! {
    /// The error lines llama.cpp logs on this thread while `capture_errors` runs.
    static CAPTURED: std::cell::RefCell<Option<Vec<String>>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` and return what it returns with the error lines llama.cpp logged on this thread
/// meanwhile (they still go to the host too). For calls that fail with a null and say why only
/// in the log, such as `llama_adapter_lora_init`.
pub(crate) fn capture_errors<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    CAPTURED.with(|c| *c.borrow_mut() = Some(Vec::new()));
    let out = f();
    let lines = CAPTURED.with(|c| c.borrow_mut().take()).unwrap_or_default();
    (out, lines)
}

fn level_of(level: ggml_log_level) -> Option<LogLevel> {
    match level {
        llama_cpp_sys_2::GGML_LOG_LEVEL_ERROR => Some(LogLevel::Error),
        llama_cpp_sys_2::GGML_LOG_LEVEL_WARN => Some(LogLevel::Warn),
        // llama.cpp's INFO is a per-tensor, per-key dump on every load: debug for the node.
        llama_cpp_sys_2::GGML_LOG_LEVEL_INFO => Some(LogLevel::Debug),
        llama_cpp_sys_2::GGML_LOG_LEVEL_DEBUG => Some(LogLevel::Debug),
        _ => None, // CONT (and NONE) continue the previous line's level
    }
}

unsafe extern "C" fn on_log(level: ggml_log_level, text: *const c_char, user: *mut c_void) {
    if text.is_null() || user.is_null() {
        return;
    }
    // SAFETY: `user` is the static Router installed in route_to_host.
    let router = unsafe { &*user.cast::<Router>() };
    // SAFETY: llama.cpp passes a NUL-terminated string valid for this call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut pending = router.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = level_of(level) {
            pending.0 = l;
        }
        pending.1.push_str(&text);
        while let Some(nl) = pending.1.find('\n') {
            let line: String = pending.1.drain(..=nl).collect();
            let line = line.trim_end();
            if !line.is_empty() {
                if pending.0 == LogLevel::Error {
                    CAPTURED.with(|c| {
                        if let Some(lines) = c.borrow_mut().as_mut() {
                            lines.push(line.to_string());
                        }
                    });
                }
                let hosts = router.hosts.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((_, host)) = hosts.last() {
                    host.log(pending.0, line);
                }
            }
        }
    }));
}
