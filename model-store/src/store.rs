//! The model store itself (node start and reload, before the request path): how a node makes
//! it, and `fetch`: list the source, select the files, download them under the model
//! directory's lock, with progress logged while it runs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::Retryable as _;
use gantry_api::ArtifactState;
use gantry_engine_abi::Format;

use crate::{
    DownloadProgress, Fetched, LOCK_FILE, RetryPolicy, Source, SourceSettings, StoreError,
    download, remote, resolve_local, select, source,
};

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
