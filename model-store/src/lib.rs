//! The model store (`gantry-model-store`; before the request path, at node start): a model's
//! source → verified local artifacts.
//!
//! [`ModelStore::fetch`] runs the steps, one module each: parse the source
//! (`source`), list its files (`remote`, or the disk for `file://`), choose
//! the model's files by the registered format and exact quantization
//! (`select`), and download each into the cache volume with resume,
//! checksum and an atomic rename (`download`) — under a lock file, so
//! replicas sharing the volume never write the same file at once. Progress
//! is published through [`DownloadProgress`], which `/v1/status` and the 503 answer
//! for a model still downloading read.
//!
//! Cache layout: `{cache_dir}/hf/{org}--{repo}/{revision}/…`,
//! `{cache_dir}/s3/{bucket}/{prefix}/…`, `{cache_dir}/https/{host}/{path}/…`,
//! each file as the source names it; `*.partial` while incomplete; one
//! `.gantry-lock` per model directory.

pub mod download;
pub mod remote;
pub mod select;
pub mod source;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::Retryable as _;
use gantry_api::{ArtifactState, ArtifactStatus};
use gantry_engine_abi::Format;

pub use download::RetryPolicy;
pub use select::{ArtifactSelection, select};
pub use source::{Source, SourceSettings};

/// Name of the lock file in each model's cache directory.
pub const LOCK_FILE: &str = ".gantry-lock";
/// Most entries read from a local model directory.
const MAX_LOCAL_ENTRIES: usize = 10_000;

/// One file a source offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteFile {
    /// Relative to the source (`sub/dir/x.gguf`).
    pub path: String,
    /// Bytes; 0 when the source does not say (a direct URL before the request).
    pub size: u64,
    /// Lowercase hex sha256 when the source gives one (the Hub's LFS oid).
    pub sha256: Option<String>,
}

/// What went wrong while getting a model's artifacts. Every variant names the
/// source or file, so the message can go straight into status.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("source {uri:?}: {reason}")]
    Source { uri: String, reason: String },
    #[error("{0}")]
    Listing(String),
    #[error("{0}")]
    Selection(String),
    #[error("{file}: {reason}")]
    Download { file: String, reason: String },
    /// Worth another attempt (connection lost, 5xx, a body cut short).
    #[error("{file}: {reason}")]
    Transient { file: String, reason: String },
    #[error(
        "{file}: sha256 mismatch: the source says {expected}, the download is {got}; the file was removed"
    )]
    Checksum {
        file: String,
        expected: String,
        got: String,
    },
    #[error("{file}: size mismatch: expected {expected} bytes, got {got}; the file was removed")]
    Size {
        file: String,
        expected: u64,
        got: u64,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Lock(String),
    /// The store itself cannot be set up (no cache directory).
    #[error("{0}")]
    Setup(String),
}

impl StoreError {
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Transient { .. })
    }

    /// A stable label for counting failures.
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Source { .. } => "source",
            StoreError::Listing(_) => "listing",
            StoreError::Selection(_) => "selection",
            StoreError::Download { .. } => "download",
            StoreError::Transient { .. } => "transient",
            StoreError::Checksum { .. } => "checksum",
            StoreError::Size { .. } => "size",
            StoreError::Io { .. } => "io",
            StoreError::Lock(_) => "lock",
            StoreError::Setup(_) => "setup",
        }
    }
}

/// A model's artifacts on local disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    /// The model directory (cache directory or the local source).
    pub dir: PathBuf,
    /// The file the engine opens.
    pub primary: PathBuf,
    pub mmproj: Option<PathBuf>,
    pub quantization: Option<String>,
    pub files: Vec<PathBuf>,
}

/// Download progress of one model, shared with the status endpoint.
#[derive(Debug)]
pub struct DownloadProgress {
    state: Mutex<(ArtifactState, Option<String>)>,
    /// Bytes of files complete on disk.
    completed: AtomicU64,
    /// Bytes of the file being downloaded that are on disk.
    current: AtomicU64,
    total: AtomicU64,
    /// Bytes received over the network by this process, for the rate.
    fetched: AtomicU64,
    started: Mutex<Option<Instant>>,
}

impl Default for DownloadProgress {
    fn default() -> Self {
        Self {
            state: Mutex::new((ArtifactState::Pending, None)),
            completed: AtomicU64::new(0),
            current: AtomicU64::new(0),
            total: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            started: Mutex::new(None),
        }
    }
}

impl DownloadProgress {
    pub fn set(&self, state: ArtifactState, message: Option<String>) {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        *g = (state, message);
    }

    pub fn state(&self) -> ArtifactState {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    fn begin(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        self.completed.store(0, Ordering::Relaxed);
        self.current.store(0, Ordering::Relaxed);
        self.fetched.store(0, Ordering::Relaxed);
        *self.started.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    fn add_cached(&self, bytes: u64, size_was_unknown: bool) {
        self.completed.fetch_add(bytes, Ordering::Relaxed);
        if size_was_unknown {
            self.total.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    fn start_file(&self, on_disk: u64) {
        self.current.store(on_disk, Ordering::Relaxed);
    }

    fn add_done(&self, bytes: u64) {
        self.current.fetch_add(bytes, Ordering::Relaxed);
        self.fetched.fetch_add(bytes, Ordering::Relaxed);
    }

    fn reset_current(&self) {
        self.current.store(0, Ordering::Relaxed);
    }

    fn complete_current(&self) {
        let n = self.current.swap(0, Ordering::Relaxed);
        self.completed.fetch_add(n, Ordering::Relaxed);
    }

    /// A size learned from response headers (a direct URL, the one file of
    /// its fetch); idempotent across retries.
    fn learn_total(&self, bytes: u64) {
        let floor = self.completed.load(Ordering::Relaxed) + bytes;
        self.total.fetch_max(floor, Ordering::Relaxed);
    }

    pub fn bytes_done(&self) -> u64 {
        self.completed.load(Ordering::Relaxed) + self.current.load(Ordering::Relaxed)
    }

    pub fn bytes_total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Network bytes per second since this process started the download.
    pub fn rate(&self) -> f64 {
        let started = *self.started.lock().unwrap_or_else(|p| p.into_inner());
        match started {
            Some(t) if self.state() == ArtifactState::Downloading => {
                let secs = t.elapsed().as_secs_f64();
                if secs > 0.0 {
                    self.fetched.load(Ordering::Relaxed) as f64 / secs
                } else {
                    0.0
                }
            }
            _ => 0.0,
        }
    }

    pub fn snapshot(&self) -> ArtifactStatus {
        let (state, message) = self.state.lock().unwrap_or_else(|p| p.into_inner()).clone();
        ArtifactStatus {
            state,
            bytes_done: self.bytes_done(),
            bytes_total: self.bytes_total(),
            bytes_per_second: self.rate(),
            message,
        }
    }
}

/// What to fetch: a model config's source fields.
#[derive(Clone, Copy, Debug)]
pub struct FetchRequest<'a> {
    pub model_id: &'a str,
    pub source: &'a str,
    pub format: Format,
    pub quantization: Option<&'a str>,
    pub files: &'a [String],
}

/// How a node makes its model store: the `serve` flags that override the environment's source
/// settings, and the cache directory flag. The node makes the store at start when a model is
/// remote, or at the reload that brings its first remote model (node/reload.rs).
#[derive(Clone, Debug, Default)]
pub struct StoreSetup {
    pub hf_endpoint: Option<String>,
    pub s3_endpoint: Option<String>,
    pub s3_region: Option<String>,
    /// `--cache-dir`: wins over the config's `cacheDir`.
    pub cache_dir: Option<PathBuf>,
}

impl StoreSetup {
    /// The store for `config`'s remote models: settings from the environment (read now, so a
    /// rotated token file is picked up) with the flags over them, and the cache directory from
    /// the flag, else the config's `cacheDir`, else `~/.cache/gantry-node`.
    pub fn store_for(&self, config: &gantry_api::NodeConfig) -> Result<ModelStore, StoreError> {
        let mut settings = SourceSettings::from_env()?;
        if let Some(e) = &self.hf_endpoint {
            settings.hf_endpoint = Some(e.clone());
        }
        if let Some(e) = &self.s3_endpoint {
            settings.s3_endpoint = Some(e.clone());
        }
        if let Some(r) = &self.s3_region {
            settings.s3_region = Some(r.clone());
        }
        let cache_dir = cache_dir(Some(self), config).ok_or_else(|| {
            StoreError::Setup(
                "no cache directory: set `cacheDir` in the config, --cache-dir or GANTRY_CACHE_DIR"
                    .into(),
            )
        })?;
        tracing::info!(cache_dir = %cache_dir.display(), ?settings, "model store");
        ModelStore::new(cache_dir, settings)
    }
}

/// The node's cache directory: `--cache-dir` (`setup`), else the config's `cacheDir`, else
/// `~/.cache/gantry-node`. The model store and the engine choice cache live there.
pub fn cache_dir(setup: Option<&StoreSetup>, config: &gantry_api::NodeConfig) -> Option<PathBuf> {
    setup
        .and_then(|s| s.cache_dir.clone())
        .or_else(|| config.cache_dir.clone())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/gantry-node")))
}

/// Gets models' artifacts into the cache directory.
#[derive(Clone, Debug)]
pub struct ModelStore {
    pub cache_dir: PathBuf,
    settings: SourceSettings,
    client: reqwest::Client,
    pub retry: RetryPolicy,
    /// Longest wait for another process's lock on a model directory.
    pub lock_timeout: Duration,
    /// Interval of the progress log lines.
    pub log_every: Duration,
}

impl ModelStore {
    pub fn new(cache_dir: PathBuf, settings: SourceSettings) -> Result<Self, StoreError> {
        let client = reqwest::Client::builder()
            .user_agent(concat!("gantry-node/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            // A stalled body (no bytes for this long) counts as a lost connection.
            .read_timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| StoreError::Source {
                uri: String::new(),
                reason: format!("cannot build the HTTP client: {e}"),
            })?;
        Ok(Self {
            cache_dir,
            settings,
            client,
            retry: RetryPolicy::default(),
            lock_timeout: Duration::from_secs(6 * 3600),
            log_every: Duration::from_secs(10),
        })
    }

    /// The quantization asked for: the config's, or the `:QUANT` of the URI; both must agree.
    fn quantization(req: &FetchRequest<'_>, source: &Source) -> Result<Option<String>, StoreError> {
        let from_uri = match source {
            Source::Hf { quantization, .. } => quantization.clone(),
            _ => None,
        };
        match (req.quantization, from_uri) {
            (Some(a), Some(b)) if a != b => Err(StoreError::Source {
                uri: req.source.to_string(),
                reason: format!("names quantization `{b}` but `quantization` is `{a}`"),
            }),
            (Some(a), _) => Ok(Some(a.to_string())),
            (None, b) => Ok(b),
        }
    }

    /// Resolve a model's artifacts, downloading them first when the source is
    /// remote. Progress and the final state go into `progress`.
    pub async fn fetch(
        &self,
        req: &FetchRequest<'_>,
        progress: &Arc<DownloadProgress>,
    ) -> Result<Fetched, StoreError> {
        let result = self.fetch_inner(req, progress).await;
        match &result {
            Ok(_) => progress.set(ArtifactState::Ready, None),
            Err(e) => progress.set(ArtifactState::Failed, Some(e.to_string())),
        }
        result
    }

    async fn fetch_inner(
        &self,
        req: &FetchRequest<'_>,
        progress: &Arc<DownloadProgress>,
    ) -> Result<Fetched, StoreError> {
        let source = Source::parse_on_node(req.source)?;
        let quantization = Self::quantization(req, &source)?;
        if let Source::File { path } = &source {
            return resolve_local(path, req.format, quantization.as_deref(), req.files);
        }
        progress.set(
            ArtifactState::Downloading,
            Some("listing the source".into()),
        );
        let remote = remote::Remote::new(source.clone(), self.settings.clone())?;
        let listing = (|| remote.list(&self.client))
            .retry(self.retry.backoff())
            .when(StoreError::is_transient)
            .await?;
        let selection = select(&listing, req.format, quantization.as_deref(), req.files)?;
        let dir = self.cache_dir.join(source::cache_subdir(&source));
        std::fs::create_dir_all(&dir).map_err(|source| StoreError::Io {
            path: dir.clone(),
            source,
        })?;
        let _lock = self.lock(&dir, progress).await?;
        progress.begin(selection.files.iter().map(|f| f.size).sum());
        progress.set(ArtifactState::Downloading, None);
        tracing::info!(
            model = req.model_id,
            source = req.source,
            files = selection.files.len(),
            bytes = progress.bytes_total(),
            dir = %dir.display(),
            "fetching model artifacts"
        );
        let logger = self.progress_logger(req.model_id, progress);
        let mut paths = Vec::new();
        let mut outcome = Ok(());
        for f in &selection.files {
            let dest = dir.join(&f.path);
            if let Err(e) =
                download::fetch_file(&self.client, &remote, f, &dest, progress, self.retry).await
            {
                outcome = Err(e);
                break;
            }
            paths.push(dest);
        }
        drop(logger);
        outcome?;
        tracing::info!(
            model = req.model_id,
            bytes = progress.bytes_done(),
            "model artifacts complete"
        );
        Ok(Fetched {
            primary: dir.join(&selection.primary),
            mmproj: selection.mmproj.as_ref().map(|m| dir.join(m)),
            quantization: selection.quantization,
            files: paths,
            dir,
        })
    }

    /// Hold the model directory's lock; while another process holds it, wait
    /// (bounded by `lock_timeout`) and say so in the status.
    async fn lock(
        &self,
        dir: &Path,
        progress: &DownloadProgress,
    ) -> Result<std::fs::File, StoreError> {
        use fs4::fs_std::FileExt as _;
        let path = dir.join(LOCK_FILE);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
        let t0 = Instant::now();
        let mut told = false;
        loop {
            match file.try_lock_exclusive() {
                Ok(true) => return Ok(file),
                Ok(false) => {}
                Err(source) => return Err(StoreError::Io { path, source }),
            }
            if !told {
                tracing::info!(lock = %path.display(), "another process is fetching into this cache directory; waiting");
                progress.set(
                    ArtifactState::Downloading,
                    Some("waiting for another replica fetching into the same cache".into()),
                );
                told = true;
            }
            if t0.elapsed() > self.lock_timeout {
                return Err(StoreError::Lock(format!(
                    "{} stayed locked by another process for {:?}",
                    path.display(),
                    self.lock_timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Log a progress line every `log_every` until dropped.
    fn progress_logger(&self, model: &str, progress: &Arc<DownloadProgress>) -> ProgressLogger {
        let (model, progress, every) = (model.to_string(), progress.clone(), self.log_every);
        ProgressLogger(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            // Bounded by the download: the guard aborts this task when it ends.
            loop {
                tick.tick().await;
                let s = progress.snapshot();
                let pct = if s.bytes_total > 0 {
                    100.0 * s.bytes_done as f64 / s.bytes_total as f64
                } else {
                    0.0
                };
                tracing::info!(model = %model, bytes_done = s.bytes_done, bytes_total = s.bytes_total, percent = format!("{pct:.1}"), mib_per_s = format!("{:.2}", s.bytes_per_second / 1048576.0), "download progress");
            }
        }))
    }
}

/// Ends the progress log task when the download ends.
struct ProgressLogger(tokio::task::JoinHandle<()>);

impl Drop for ProgressLogger {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A local file or directory: list it, select by the same rules, no copy.
/// A file is the model itself, when it is of the registered format.
pub fn resolve_local(
    path: &Path,
    format: Format,
    quantization: Option<&str>,
    files: &[String],
) -> Result<Fetched, StoreError> {
    if path.is_file() {
        if !select::is_model_file(&path.to_string_lossy(), format) {
            return Err(StoreError::Selection(format!(
                "{} is not a {format} file (the registered format is fixed)",
                path.display()
            )));
        }
        return Ok(Fetched {
            dir: path.parent().unwrap_or(Path::new("/")).to_path_buf(),
            primary: path.to_path_buf(),
            mmproj: None,
            quantization: quantization.map(str::to_string),
            files: vec![path.to_path_buf()],
        });
    }
    if !path.is_dir() {
        return Err(StoreError::Source {
            uri: path.display().to_string(),
            reason: "does not exist".into(),
        });
    }
    let listing = list_dir(path)?;
    let s = select(&listing, format, quantization, files)?;
    Ok(Fetched {
        dir: path.to_path_buf(),
        primary: path.join(&s.primary),
        mmproj: s.mmproj.as_ref().map(|m| path.join(m)),
        quantization: s.quantization,
        files: s.files.iter().map(|f| path.join(&f.path)).collect(),
    })
}

fn list_dir(root: &Path) -> Result<Vec<RemoteFile>, StoreError> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|source| StoreError::Io {
            path: dir.clone(),
            source,
        })?;
        for e in entries.filter_map(Result::ok) {
            if out.len() + stack.len() >= MAX_LOCAL_ENTRIES {
                return Err(StoreError::Listing(format!(
                    "{} holds more than {MAX_LOCAL_ENTRIES} entries",
                    root.display()
                )));
            }
            let p = e.path();
            let Ok(ft) = e.file_type() else { continue };
            let Ok(rel) = p.strip_prefix(root) else {
                continue;
            };
            let rel = rel.to_string_lossy().replace('\\', "/");
            if rel.starts_with('.') || rel.ends_with(".partial") {
                continue;
            }
            if ft.is_dir() {
                stack.push(p);
            } else {
                let size = e.metadata().map_or(0, |m| m.len());
                out.push(RemoteFile {
                    path: rel,
                    size,
                    sha256: None,
                });
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}
