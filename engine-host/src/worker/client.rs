//! Engine host, the node's side of a worker (`process` isolation; the model calls of
//! `plugin/model.rs` land here when the plugin runs out of process): starts
//! `gantry-node engine-worker`, makes the calls over its socket and shared mapping, and
//! notices at once when it dies.
//!
//! One worker serves one loaded model (one replica), so a crash takes exactly that model
//! down and an unload returns all its memory to the system. A reaper thread waits on the
//! child: when it exits without the node asking, every call on it fails with an
//! `engine_crashed` error naming the plugin and the signal, and the node's crash hook runs
//! (node/crash.rs restarts the model).

use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use gantry_engine_abi::{
    EngineConfig, EngineError, EngineInfo, ModelDescriptor, ModelInfo, SampledToken, StepEntry,
};

use super::wire::{self, Op, Reader, Writer};

/// The marker that starts the message of every error a worker crash causes; the HTTP layer
/// answers those with 503 `engine_crashed` (error.rs).
pub const CRASH_MARKER: &str = "engine_crashed: ";

/// What the node does when a worker dies on its own (node/crash.rs).
pub type CrashHook = Arc<dyn Fn(Crash) + Send + Sync>;

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

/// A worker that ended without the node asking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Crash {
    pub plugin: String,
    pub model: String,
    pub pid: u32,
    /// `SIGSEGV`, `SIGABRT`, `SIGKILL` (also the kernel's OOM killer), ...
    pub signal: Option<String>,
    pub exit_code: Option<i32>,
    /// The watchdog killed it because a step overran.
    pub hung: bool,
}

impl Crash {
    /// `crashed` or `hung` (the `reason` label of `gantry_engine_crashes_total`).
    pub fn reason(&self) -> &'static str {
        if self.hung { "hung" } else { "crashed" }
    }

    /// What ended the worker, in words.
    pub fn how(&self) -> String {
        match (&self.signal, self.exit_code, self.hung) {
            (_, _, true) => "killed by the watchdog after a step overran".into(),
            (Some(s), _, _) if s == "SIGKILL" => {
                "killed by SIGKILL (the kernel's OOM killer sends it too)".into()
            }
            (Some(s), _, _) => format!("killed by {s}"),
            (None, Some(c), _) => format!("exited with code {c}"),
            (None, None, _) => "ended".into(),
        }
    }

    pub fn message(&self) -> String {
        format!(
            "the engine worker of plugin `{}` for model `{}` (pid {}) {}",
            self.plugin,
            self.model,
            self.pid,
            self.how()
        )
    }

    /// The error every call on the dead worker returns.
    pub fn error(&self) -> EngineError {
        EngineError::internal(format!("{CRASH_MARKER}{}", self.message()))
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

static NEXT: AtomicU64 = AtomicU64::new(0);

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
fn shm_dir() -> PathBuf {
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

fn io_error(what: &str, e: std::io::Error) -> EngineError {
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
                    let crash = Crash {
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
                            "{CRASH_MARKER}the engine worker of plugin `{plugin}` ended while starting ({})",
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
    pub fn crash(&self) -> Option<Crash> {
        let exit = self.life.exit()?;
        if self.life.stopping.load(Ordering::SeqCst) {
            return None;
        }
        Some(self.crash_of(exit))
    }

    fn crash_of(&self, exit: Exit) -> Crash {
        Crash {
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
    fn call(
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
    fn shared_call(&self, body: &[u8]) -> Result<Vec<u8>, EngineError> {
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

    fn connect(&self) -> Result<UnixStream, EngineError> {
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

/// The shared calls of a model in a worker (any thread).
pub struct RemoteModel {
    pub worker: Arc<Worker>,
    /// Single-token pieces, by `render_special`: the scheduler turns every sampled token into
    /// text, and a token's piece never changes, so each crosses the socket once.
    pieces: [Mutex<std::collections::HashMap<i32, Vec<u8>>>; 2],
}

impl RemoteModel {
    pub fn new(worker: Arc<Worker>) -> Self {
        Self {
            worker,
            pieces: Default::default(),
        }
    }

    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        let mut w = Writer::op(Op::Tokenize);
        w.bool(add_special).bool(parse_special).str(text);
        let reply = self.worker.shared_call(&w.buf)?;
        wire::reply(&reply)?.i32s()
    }

    pub fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        let cache = &self.pieces[usize::from(render_special)];
        if let [t] = tokens
            && let Some(b) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(t)
        {
            return Ok(b.clone());
        }
        let mut w = Writer::op(Op::Detokenize);
        w.bool(render_special).i32s(tokens);
        let reply = self.worker.shared_call(&w.buf)?;
        let bytes = wire::reply(&reply)?.bytes()?.to_vec();
        if let [t] = tokens {
            cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(*t, bytes.clone());
        }
        Ok(bytes)
    }

    /// Each token's bytes on its own, in one round trip.
    pub fn detokenize_each(
        &self,
        tokens: &[i32],
        render_special: bool,
    ) -> Result<Vec<Vec<u8>>, EngineError> {
        let mut w = Writer::op(Op::DetokenizeEach);
        w.bool(render_special).i32s(tokens);
        let reply = self.worker.shared_call(&w.buf)?;
        let mut r = wire::reply(&reply)?;
        let n = r.u32()? as usize;
        if n != tokens.len() {
            return Err(EngineError::internal("engine worker: wrong piece count"));
        }
        (0..n).map(|_| r.bytes().map(<[u8]>::to_vec)).collect()
    }
}

/// The exec calls of a model in a worker: its own connection and shared mapping.
pub struct RemoteExec {
    worker: Arc<Worker>,
    conn: UnixStream,
    map: Option<memmap2::MmapMut>,
    /// The request, encoded here and copied into the mapping (the buffer is reused).
    out: Writer,
    reply: Vec<u8>,
}

/// The smallest step mapping: a batch of 8 with 512-token prompts and masks for a 256k
/// vocabulary fits.
const MIN_SHM: usize = 1 << 20;

impl RemoteExec {
    pub fn new(worker: Arc<Worker>) -> Result<Self, EngineError> {
        let conn = worker.connect()?;
        let mut exec = Self {
            worker,
            conn,
            map: None,
            out: Writer::default(),
            reply: Vec::new(),
        };
        exec.grow(MIN_SHM)?;
        Ok(exec)
    }

    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// A new mapping of at least `need` bytes, shared with the worker.
    fn grow(&mut self, need: usize) -> Result<(), EngineError> {
        let size = need.next_power_of_two().max(MIN_SHM);
        let path = shm_dir().join(format!(
            "gantry-step-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_error(&format!("create {}", path.display()), e))?;
        let mapped = f
            .set_len(size as u64)
            .map_err(|e| io_error("size the step mapping", e))
            // SAFETY: a file this node just created for this connection alone; the worker
            // touches it only between a step request and its reply, while this side waits.
            .and_then(|()| {
                unsafe { memmap2::MmapMut::map_mut(&f) }.map_err(|e| io_error("map", e))
            });
        let result = mapped.and_then(|map| {
            let mut w = Writer::op(Op::MapShm);
            w.str(&path.to_string_lossy());
            self.worker.call(&mut self.conn, &w.buf, &mut self.reply)?;
            wire::reply(&self.reply)?;
            self.map = Some(map);
            Ok(())
        });
        // Both sides hold the mapping now (or the worker never will): the name can go.
        let _ = std::fs::remove_file(&path);
        result
    }

    fn exec_call(&mut self, body: &[u8]) -> Result<Reader<'_>, EngineError> {
        self.worker.call(&mut self.conn, body, &mut self.reply)?;
        wire::reply(&self.reply)
    }

    pub fn seq_open(&mut self) -> Result<u64, EngineError> {
        self.exec_call(&[Op::SeqOpen as u8])?.u64()
    }

    pub fn seq_release(&mut self, seq: u64) {
        let mut w = Writer::op(Op::SeqRelease);
        w.u64(seq);
        let _ = self.exec_call(&w.buf);
    }

    pub fn seq_cached_tokens(&mut self, seq: u64) -> Option<u64> {
        let mut w = Writer::op(Op::SeqCachedTokens);
        w.u64(seq);
        let n = self.exec_call(&w.buf).ok()?.i64().ok()?;
        u64::try_from(n).ok()
    }

    pub fn embed(&mut self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        let mut w = Writer::op(Op::Embed);
        w.i32s(tokens);
        self.exec_call(&w.buf)?.f32s()
    }

    pub fn step(
        &mut self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let need = wire::step_request_size(entries).max(wire::step_reply_size(entries.len()));
        if self.map.as_ref().is_none_or(|m| m.len() < need) {
            self.grow(need)?;
        }
        self.out.buf.clear();
        wire::put_step(&mut self.out, entries);
        let len = self.out.buf.len();
        let map = self
            .map
            .as_mut()
            .ok_or_else(|| EngineError::internal("no step mapping"))?;
        map[..len].copy_from_slice(&self.out.buf);
        let mut w = Writer::op(Op::Step);
        w.len(len);
        let reply_len = self.exec_call(&w.buf)?.u32()? as usize;
        let map = self
            .map
            .as_ref()
            .ok_or_else(|| EngineError::internal("no step mapping"))?;
        let body = map
            .get(..reply_len)
            .ok_or_else(|| EngineError::internal("step reply larger than the mapping"))?;
        wire::get_step_results(&mut Reader::new(body))
    }
}
