//! Engine host, the node's side of a worker (`process` isolation; the model calls of
//! `plugin/model.rs` land here when the plugin runs out of process): starts
//! `gantry-node engine-worker`, makes the calls over its socket and shared mapping, and
//! notices at once when it dies.
//!
//! One worker serves one loaded model (one replica), so a crash takes exactly that model
//! down and an unload returns all its memory to the system. A reaper thread waits on the
//! child: when it exits without the node asking, every call on it fails with an
//! error naming the plugin and the signal (a [`WorkerCrash`] to whoever asks), and the node's crash hook runs
//! (node/crash.rs restarts the model).

use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use gantry_api::WorkerCrash;
use gantry_engine_abi::{EngineConfig, EngineError, EngineInfo, ModelDescriptor, ModelInfo};

use super::wire::{self, Op, Reader, Writer};
use crate::model::WorkerProcess;

/// What the node does when a worker dies on its own (node/crash.rs).
pub type CrashHook = Arc<dyn Fn(WorkerCrash) + Send + Sync>;

/// How the node starts workers.
#[derive(Clone)]
pub struct WorkerSettings {
    /// The `gantry-node` executable (`$GANTRY_ENGINE_WORKER`, else this process's own).
    pub exe: PathBuf,
    /// Set once by the node; a crash before it is set is only logged.
    pub hook: Arc<OnceLock<CrashHook>>,
}

impl std::fmt::Debug for WorkerSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSettings")
            .field("exe", &self.exe)
            .finish()
    }
}

impl Default for WorkerSettings {
    fn default() -> Self {
        let exe = std::env::var_os("GANTRY_ENGINE_WORKER")
            .map(PathBuf::from)
            .or_else(|| std::env::current_exe().ok())
            .unwrap_or_else(|| PathBuf::from("gantry-node"));
        Self {
            exe,
            hook: Arc::new(OnceLock::new()),
        }
    }
}

/// A signal's name, as `kill -l` spells it.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGTRAP => "SIGTRAP",
        _ => return format!("signal {sig}"),
    };
    name.into()
}

/// How the child ended, as the reaper saw it.
#[derive(Clone, Copy, Debug)]
struct Exit {
    signal: Option<i32>,
    code: Option<i32>,
}

/// What the reaper thread and the worker's users share.
struct Life {
    exit: Mutex<Option<Exit>>,
    cv: Condvar,
    /// The node is stopping it: its end is no crash.
    stopping: AtomicBool,
    /// The watchdog is killing it.
    hung: AtomicBool,
}

impl Life {
    fn exit(&self) -> Option<Exit> {
        *self.exit.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait up to `limit` for the child to end.
    fn wait(&self, limit: Duration) -> Option<Exit> {
        let g = self.exit.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .cv
            .wait_timeout_while(g, limit, |e| e.is_none())
            .unwrap_or_else(|p| p.into_inner());
        *g
    }
}

pub(super) static NEXT: AtomicU64 = AtomicU64::new(0);

/// A private directory for this node's worker sockets and pinned libraries.
pub fn private_dir() -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = private_dir_path();
    if !dir.is_dir() {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(&dir)?;
    }
    Ok(dir)
}

/// Remove this node's private directory (at shutdown); nothing when it was never made.
pub fn remove_private_dir() {
    let _ = std::fs::remove_dir_all(private_dir_path());
}

/// `$TMPDIR/gantry-workers-<node pid>`.
pub fn private_dir_path() -> PathBuf {
    std::env::temp_dir().join(format!("gantry-workers-{}", std::process::id()))
}

/// `lib_dir` first, then what the node had.
fn library_path(lib_dir: &Path) -> std::ffi::OsString {
    let mut v = lib_dir.as_os_str().to_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        v.push(":");
        v.push(old);
    }
    v
}

/// Where the step mappings live: tmpfs (`/dev/shm`) when the pod has it, else the temp dir.
pub(super) fn shm_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() && std::fs::metadata(shm).is_ok_and(|m| !m.permissions().readonly()) {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// One running `engine-worker` process.
pub struct Worker {
    pid: u32,
    plugin: String,
    model: String,
    socket: PathBuf,
    life: Arc<Life>,
    /// The first connection: the worker lives as long as it is open.
    control: Mutex<UnixStream>,
    /// Connections for the calls any thread may make (tokenize, detokenize), reused.
    spare: Mutex<Vec<UnixStream>>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("pid", &self.pid)
            .field("plugin", &self.plugin)
            .field("model", &self.model)
            .finish()
    }
}

pub(super) fn io_error(what: &str, e: std::io::Error) -> EngineError {
    EngineError::internal(format!("engine worker: {what}: {e}"))
}

impl Worker {
    /// Start a worker and connect to it. `model` names what it will serve (for messages);
    /// `lib_dir` (the plugin's own directory) is searched for the libraries it needs.
    pub fn spawn(
        settings: &WorkerSettings,
        plugin: &str,
        model: &str,
        lib_dir: &Path,
    ) -> Result<Arc<Worker>, EngineError> {
        let dir = private_dir().map_err(|e| io_error("socket directory", e))?;
        let socket = dir.join(format!("w{}.sock", NEXT.fetch_add(1, Ordering::Relaxed)));
        let mut child = Command::new(&settings.exe)
            .arg("engine-worker")
            .arg("--socket")
            .arg(&socket)
            .env("LD_LIBRARY_PATH", library_path(lib_dir))
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| io_error(&format!("cannot start {}", settings.exe.display()), e))?;
        let pid = child.id();
        let life = Arc::new(Life {
            exit: Mutex::new(None),
            cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            hung: AtomicBool::new(false),
        });
        {
            let life = life.clone();
            let hook = settings.hook.clone();
            let (plugin, model) = (plugin.to_string(), model.to_string());
            std::thread::Builder::new()
                .name(format!("reap-{pid}"))
                .spawn(move || {
                    let status = child.wait();
                    let exit = match &status {
                        Ok(s) => Exit {
                            signal: s.signal(),
                            code: s.code(),
                        },
                        Err(_) => Exit {
                            signal: None,
                            code: None,
                        },
                    };
                    *life.exit.lock().unwrap_or_else(|p| p.into_inner()) = Some(exit);
                    life.cv.notify_all();
                    if life.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let crash = WorkerCrash {
                        plugin,
                        model,
                        pid,
                        signal: exit.signal.map(signal_name),
                        exit_code: exit.code,
                        hung: life.hung.load(Ordering::SeqCst),
                    };
                    tracing::error!(target: "gantry::alert", plugin = %crash.plugin, model = %crash.model, pid, reason = crash.reason(), "{}", crash.message());
                    if let Some(h) = hook.get() {
                        h(crash);
                    }
                })
                .map_err(|e| io_error("reaper thread", e))?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let control = loop {
            match UnixStream::connect(&socket) {
                Ok(c) => break c,
                Err(e) => {
                    if let Some(exit) = life.exit() {
                        return Err(EngineError::internal(format!(
                            "the engine worker of plugin `{plugin}` ended while starting ({})",
                            exit.signal.map(signal_name).unwrap_or_else(|| format!(
                                "exit code {}",
                                exit.code.unwrap_or(-1)
                            ))
                        )));
                    }
                    if Instant::now() > deadline {
                        // SAFETY: kill takes a pid and a signal and touches no memory; the
                        // child is ours and not reaped yet (no exit recorded).
                        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                        return Err(io_error(
                            "the worker did not open its socket within 30 s",
                            e,
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        };
        Ok(Arc::new(Worker {
            pid,
            plugin: plugin.into(),
            model: model.into(),
            socket,
            life,
            control: Mutex::new(control),
            spare: Mutex::new(Vec::new()),
        }))
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The crash that ended it; `None` while it runs or when the node stopped it.
    pub fn crash(&self) -> Option<WorkerCrash> {
        let exit = self.life.exit()?;
        if self.life.stopping.load(Ordering::SeqCst) {
            return None;
        }
        Some(self.crash_of(exit))
    }

    fn crash_of(&self, exit: Exit) -> WorkerCrash {
        WorkerCrash {
            plugin: self.plugin.clone(),
            model: self.model.clone(),
            pid: self.pid,
            signal: exit.signal.map(signal_name),
            exit_code: exit.code,
            hung: self.life.hung.load(Ordering::SeqCst),
        }
    }

    /// The watchdog's way out of a hung step: kill the worker (its calls then fail as a
    /// crash with reason `hung`).
    pub fn kill_hung(&self) {
        self.life.hung.store(true, Ordering::SeqCst);
        self.signal(libc::SIGKILL);
    }

    fn signal(&self, sig: i32) {
        let g = self.life.exit.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            // SAFETY: kill takes a pid and a signal and touches no memory. The child is not
            // reaped (no exit recorded, checked under the lock the reaper records it with),
            // so the pid is still ours.
            unsafe { libc::kill(self.pid as i32, sig) };
        }
    }

    /// The error for a call whose connection broke: the crash once the reaper has seen the
    /// child end (it ends within moments of its socket closing).
    fn broken(&self, e: std::io::Error) -> EngineError {
        match self.life.wait(Duration::from_secs(2)) {
            Some(exit) => self.crash_of(exit).error(),
            None => io_error("lost the connection", e),
        }
    }

    /// One request and its reply on `conn`.
    pub(super) fn call(
        &self,
        conn: &mut UnixStream,
        body: &[u8],
        reply: &mut Vec<u8>,
    ) -> Result<(), EngineError> {
        if let Some(c) = self.crash() {
            return Err(c.error());
        }
        wire::write_frame(conn, body).map_err(|e| self.broken(e))?;
        wire::read_frame(conn, reply).map_err(|e| self.broken(e))
    }

    /// A call on the control connection (open, load).
    fn control_call(&self, body: &[u8]) -> Result<Vec<u8>, EngineError> {
        let mut conn = self.control.lock().unwrap_or_else(|p| p.into_inner());
        let mut reply = Vec::new();
        self.call(&mut conn, body, &mut reply)?;
        Ok(reply)
    }

    /// A call any thread may make, on a spare connection.
    pub(super) fn shared_call(&self, body: &[u8]) -> Result<Vec<u8>, EngineError> {
        let conn = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut conn = match conn {
            Some(c) => c,
            None => self.connect()?,
        };
        let mut reply = Vec::new();
        self.call(&mut conn, body, &mut reply)?;
        self.spare
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(conn);
        Ok(reply)
    }

    pub(super) fn connect(&self) -> Result<UnixStream, EngineError> {
        if let Some(c) = self.crash() {
            return Err(c.error());
        }
        UnixStream::connect(&self.socket).map_err(|e| self.broken(e))
    }

    /// Open the plugin in the worker: its info, or why it was refused (label, message).
    pub fn open(
        &self,
        id: &str,
        binary: &Path,
        config: &EngineConfig,
    ) -> Result<Result<EngineInfo, (String, String)>, EngineError> {
        let mut w = Writer::op(Op::Open);
        w.str(id).str(&binary.to_string_lossy());
        wire::put_engine_config(&mut w, config);
        let reply = self.control_call(&w.buf)?;
        if reply.first() == Some(&wire::OPEN_REFUSED) {
            let mut r = Reader::new(&reply[1..]);
            return Ok(Err((r.string()?, r.string()?)));
        }
        let mut r = wire::reply(&reply)?;
        Ok(Ok(wire::get_engine_info(&mut r)?))
    }

    /// Load the worker's model.
    pub fn load(&self, desc: &ModelDescriptor) -> Result<ModelInfo, EngineError> {
        let mut w = Writer::op(Op::Load);
        wire::put_descriptor(&mut w, desc);
        let reply = self.control_call(&w.buf)?;
        wire::get_model_info(&mut wire::reply(&reply)?)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Killing is the whole shutdown: the model's memory goes back with the process, and
        // an engine's `destroy` has nothing left to protect.
        self.life.stopping.store(true, Ordering::SeqCst);
        self.signal(libc::SIGKILL);
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl WorkerProcess for Worker {
    fn pid(&self) -> u32 {
        Worker::pid(self)
    }
    fn crash(&self) -> Option<WorkerCrash> {
        Worker::crash(self)
    }
    fn kill_hung(&self) {
        Worker::kill_hung(self)
    }
}
