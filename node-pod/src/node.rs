//! Node state (under the HTTP layer): the models this node serves, their lifecycle and verdicts.
//!
//! For each configured model: fetch remote artifacts through the model store
//! (in the background, after the HTTP server is up; the model answers 503
//! with `Retry-After` meanwhile), find its primary artifact, read its metadata
//! without loading weights (GGUF header or `config.json`), ask the engine
//! registry for a verdict, and — when supported — load it and start its
//! scheduler. The state of every model is what `/readyz`, `/v1/models` and
//! `/v1/status` report; there is no silent fallback to another engine.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use gantry_api::{
    ArtifactState, ArtifactStatus, EngineVerdict, LoadState, LoadStatus, ModelStatus, NodeStatus,
    PluginStatus, QueueStatus,
};
use gantry_engine_abi::{EngineConfig, Format, ModelDescriptor, Status};

use crate::cache::ResponseCache;
use crate::config::{LoadPolicy, ModelConfig, NodeConfig};
use crate::engine_host::{EngineRegistry, ModelShared, PluginState};
use crate::memory::{self, Bytes, ModelMemory, NodeMemory, Note, Pool, Refusal, Resident, Unload};
use crate::metrics::Metrics;
use crate::scheduler::{SchedulerHandle, SchedulerSettings};
use crate::store::{FetchRequest, Fetched, ModelStore, Progress};
use crate::template::{ChatTemplate, TemplateSource};
use crate::tokenizer::Tokenizer;

/// Default per-sequence context when neither the config nor a smaller trained length says otherwise.
pub const DEFAULT_CONTEXT: u32 = 4096;
/// Default sequences decoded together.
pub const DEFAULT_MAX_BATCH: u32 = 8;

/// A model ready to serve.
pub struct ReadyModel {
    pub shared: Arc<ModelShared>,
    pub scheduler: SchedulerHandle,
    pub template: ChatTemplate,
    pub tokenizer: Tokenizer,
    pub plugin: String,
}

impl ReadyModel {
    pub fn template_source(&self) -> TemplateSource {
        self.template.source()
    }
}

/// Where a model is in its life.
#[derive(Clone)]
pub enum ModelState {
    /// Not inspected yet.
    Pending,
    /// Supported, waiting for its first request (`load: lazy`).
    Idle,
    Loading,
    Ready(Arc<ReadyModel>),
    /// No engine can serve it; the verdict says why.
    Unsupported,
    /// Artifacts missing or the load failed.
    Failed(String),
}

pub struct ServedModel {
    pub config: ModelConfig,
    pub format: Format,
    pub state: RwLock<ModelState>,
    pub verdict: RwLock<Option<EngineVerdict>>,
    pub architecture: RwLock<Option<String>>,
    pub primary: RwLock<Option<PathBuf>>,
    /// Size of the primary artifact, read once at inspection.
    pub artifact_bytes: std::sync::atomic::AtomicU64,
    /// Download progress; `Some` for sources the model store fetches.
    pub download: Option<Arc<Progress>>,
    /// The artifacts once fetched (remote sources).
    pub fetched: OnceLock<Fetched>,
    /// Serializes loads (eager start-up and lazy first requests).
    load_lock: std::sync::Mutex<()>,
    /// Last use and the memory policy's last decision (memory.rs).
    pub memory: ModelMemory,
}

impl ServedModel {
    pub fn state(&self) -> ModelState {
        self.state
            .read()
            .map(|s| s.clone())
            .unwrap_or(ModelState::Pending)
    }
    fn set(&self, s: ModelState) {
        if let Ok(mut g) = self.state.write() {
            *g = s;
        }
    }
    pub fn ready(&self) -> Option<Arc<ReadyModel>> {
        match self.state() {
            ModelState::Ready(r) => Some(r),
            _ => None,
        }
    }
}

/// Everything the HTTP handlers share.
pub struct Node {
    pub config: NodeConfig,
    pub models: BTreeMap<String, Arc<ServedModel>>,
    pub registry: OnceLock<EngineRegistry>,
    pub engine_config: EngineConfig,
    pub plugins_dir: PathBuf,
    pub metrics: Metrics,
    pub hung: Arc<AtomicBool>,
    pub draining: AtomicBool,
    pub inflight: AtomicUsize,
    pub cache: ResponseCache,
    pub started: Instant,
    /// VRAM/RAM budgets and the load lock of the memory policy.
    pub memory: NodeMemory,
    /// Fetches remote sources; `None` on a node serving local files only.
    pub store: Option<ModelStore>,
}

impl Node {
    pub fn new(config: NodeConfig, plugins_dir: PathBuf, engine_config: EngineConfig) -> Self {
        let models = config
            .models
            .iter()
            .map(|m| {
                let format = m.format().unwrap_or(Format::Gguf); // validated by NodeConfig::validate
                (
                    m.id.clone(),
                    Arc::new(ServedModel {
                        config: m.clone(),
                        format,
                        state: RwLock::new(ModelState::Pending),
                        verdict: RwLock::new(None),
                        architecture: RwLock::new(None),
                        primary: RwLock::new(None),
                        artifact_bytes: std::sync::atomic::AtomicU64::new(0),
                        download: m.is_remote().then(|| Arc::new(Progress::default())),
                        fetched: OnceLock::new(),
                        load_lock: std::sync::Mutex::new(()),
                        memory: ModelMemory::default(),
                    }),
                )
            })
            .collect();
        let metrics = Metrics::new();
        let cache = ResponseCache::with_ram_fraction(
            config.scheduler.response_cache_ram_fraction,
            metrics.clone(),
        );
        let memory = NodeMemory::new(engine_config.backend, engine_config.vram_limit_bytes, 0);
        Self {
            config,
            models,
            registry: OnceLock::new(),
            engine_config,
            plugins_dir,
            metrics,
            hung: Arc::new(AtomicBool::new(false)),
            draining: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            cache,
            started: Instant::now(),
            memory,
            store: None,
        }
    }

    /// Use `store` for the models with remote sources.
    pub fn with_store(mut self, store: ModelStore) -> Self {
        self.store = Some(store);
        self
    }

    /// Discover plugins, start the downloads of remote models, then inspect
    /// and (eagerly) load every local one; a downloaded model is inspected
    /// and loaded when its artifacts are complete. Blocking: run it off the
    /// async runtime, from a task of the runtime the downloads run on.
    pub fn start(self: &Arc<Self>) {
        let reg = self
            .registry
            .get_or_init(|| EngineRegistry::discover(&self.plugins_dir, &self.engine_config));
        for m in self.models.values().filter(|m| m.download.is_some()) {
            self.spawn_fetch(m.clone());
        }
        for m in self.models.values().filter(|m| m.download.is_none()) {
            self.inspect(reg, m);
            if m.config.load == LoadPolicy::Eager && matches!(m.state(), ModelState::Idle) {
                self.load(m);
            }
        }
    }

    /// Fetch a remote model's artifacts in the background, then inspect and load it.
    fn spawn_fetch(self: &Arc<Self>, m: Arc<ServedModel>) {
        let Some(progress) = m.download.clone() else {
            return;
        };
        let (Some(store), Some(source)) = (self.store.clone(), m.config.source.clone()) else {
            let why = "this node has no model store configured for downloading sources".to_string();
            progress.set(gantry_api::ArtifactState::Failed, Some(why.clone()));
            m.set(ModelState::Failed(why));
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            m.set(ModelState::Failed("no async runtime to download on".into()));
            return;
        };
        progress.set(gantry_api::ArtifactState::Downloading, None);
        let node = self.clone();
        rt.spawn(async move {
            let req = FetchRequest {
                model_id: &m.config.id,
                source: &source,
                format: m.format,
                quantization: m.config.quantization.as_deref(),
                files: &m.config.files,
            };
            match store.fetch(&req, &progress).await {
                Ok(fetched) => {
                    let _ = m.fetched.set(fetched);
                    let blocking = tokio::task::spawn_blocking(move || {
                        if let Some(reg) = node.registry.get() {
                            node.inspect(reg, &m);
                            if m.config.load == LoadPolicy::Eager
                                && matches!(m.state(), ModelState::Idle)
                            {
                                node.load(&m);
                            }
                        }
                    });
                    if let Err(e) = blocking.await {
                        tracing::error!(error = %e, "inspecting a downloaded model failed");
                    }
                }
                Err(e) => {
                    tracing::error!(target: "gantry::alert", model = %m.config.id, source = %source, reason = e.metric_label(), "cannot fetch the model's artifacts: {e}");
                    m.set(ModelState::Failed(format!("artifacts: {e}")));
                }
            }
        });
    }

    /// Find the artifact, read its architecture, and record the verdict.
    fn inspect(&self, reg: &EngineRegistry, m: &ServedModel) {
        let located = match m.fetched.get() {
            Some(f) => Ok(f.primary.clone()),
            None => m
                .config
                .local_path()
                .map_err(|e| e.to_string())
                .and_then(|p| {
                    if !p.is_dir() {
                        return Ok(p);
                    }
                    // A directory: the store's selection rules (exact quantization, mmproj).
                    let f = crate::store::resolve_local(
                        &p,
                        m.format,
                        m.config.quantization.as_deref(),
                        &m.config.files,
                    )
                    .map_err(|e| e.to_string())?;
                    let primary = f.primary.clone();
                    let _ = m.fetched.set(f);
                    Ok(primary)
                }),
        };
        let primary = match located.and_then(|p| primary_artifact(&p, m.format)) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(model = %m.config.id, "{e}");
                m.set(ModelState::Failed(e));
                return;
            }
        };
        let arch = match read_architecture(&primary, m.format) {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(model = %m.config.id, "{e}");
                m.set(ModelState::Failed(e));
                return;
            }
        };
        let verdict = reg.resolve(m.format, &arch, m.config.engine.as_deref());
        if let EngineVerdict::Unsupported { rejections } = &verdict {
            let why: Vec<String> = rejections
                .iter()
                .map(|r| format!("{}: {}", r.plugin, r.reason))
                .collect();
            tracing::error!(target: "gantry::alert", model = %m.config.id, architecture = %arch, "no engine supports this model: {}", if why.is_empty() { "no plugins installed".to_string() } else { why.join("; ") });
            m.set(ModelState::Unsupported);
        } else {
            m.set(ModelState::Idle);
        }
        *m.architecture.write().unwrap_or_else(|p| p.into_inner()) = Some(arch);
        let size = std::fs::metadata(&primary).map_or(0, |md| md.len());
        m.artifact_bytes.store(size, Ordering::Relaxed);
        *m.primary.write().unwrap_or_else(|p| p.into_inner()) = Some(primary);
        *m.verdict.write().unwrap_or_else(|p| p.into_inner()) = Some(verdict);
    }

    /// Load a supported model and start its scheduler. Blocking.
    pub fn load(&self, m: &ServedModel) {
        let _serial = m.load_lock.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(m.state(), ModelState::Idle) {
            return;
        }
        let Some(reg) = self.registry.get() else {
            return;
        };
        let plugin_id = match m.verdict.read().ok().and_then(|v| v.clone()) {
            Some(EngineVerdict::Supported { plugin, .. }) => plugin,
            _ => return,
        };
        let Some(plugin) = reg.plugin(&plugin_id) else {
            return;
        };
        let Some(primary) = m.primary.read().ok().and_then(|p| p.clone()) else {
            return;
        };
        // Plan, unload and load as one step: no other load counts the same free bytes.
        let _room = self.memory.lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(r) = self.make_room(m, &primary) {
            self.refuse_load(m, r);
            return;
        }
        m.set(ModelState::Loading);
        let t0 = Instant::now();
        let desc = ModelDescriptor {
            model_id: m.config.id.clone(),
            model_dir: primary.parent().unwrap_or(Path::new(".")).to_path_buf(),
            primary_file: primary.clone(),
            format: m.format,
            quantization: m
                .fetched
                .get()
                .and_then(|f| f.quantization.clone())
                .or_else(|| m.config.quantization.clone()),
            mmproj: m.fetched.get().and_then(|f| f.mmproj.clone()),
            context_length: m.config.context_length.unwrap_or(0),
            max_sequences: m.config.max_batch_size.unwrap_or(DEFAULT_MAX_BATCH),
        };
        let (shared, exec) = match plugin.load_model(&desc) {
            Ok(x) => x,
            Err(e) if matches!(e.status, Status::OomRam | Status::OomVram) => {
                // The engine refused and freed what it had (no partial loads).
                let pool = if e.status == Status::OomVram {
                    Pool::Vram
                } else {
                    Pool::Ram
                };
                let message = format!(
                    "{}: the engine refused model `{}`: {}",
                    e.status, m.config.id, e.message
                );
                let never_fits = false;
                self.refuse_load(
                    m,
                    Refusal {
                        pool,
                        message,
                        never_fits,
                    },
                );
                return;
            }
            Err(e) => {
                tracing::error!(model = %m.config.id, error = %e, "model load failed");
                m.set(ModelState::Failed(format!("load failed: {e}")));
                return;
            }
        };
        let load_s = t0.elapsed().as_secs_f64();
        self.metrics
            .model_load_seconds
            .with_label_values(&[&m.config.id])
            .set(load_s);
        let info = shared.info().clone();
        self.metrics
            .vram_used_bytes
            .with_label_values(&[&m.config.id])
            .set(info.bytes_used as f64);
        self.metrics
            .vram_total_bytes
            .with_label_values(&[&m.config.id])
            .set(self.engine_config.vram_limit_bytes as f64);
        let model_dir = primary.parent().unwrap_or(Path::new("."));
        let template = match choose_template(&m.config, &info, model_dir) {
            Ok(t) => t,
            Err(e) => {
                m.set(ModelState::Failed(format!("chat template: {e}")));
                return;
            }
        };
        if template.source() == TemplateSource::DefaultChatml {
            tracing::warn!(model = %m.config.id, "the model has no chat template; using the default ChatML template");
        }
        let tokenizer = match Tokenizer::for_model(model_dir, shared.clone()) {
            Ok(t) => t,
            Err(e) => {
                m.set(ModelState::Failed(format!("tokenizer: {e}")));
                return;
            }
        };
        let sched = &self.config.scheduler;
        let settings = SchedulerSettings {
            prefill_chunk_tokens: sched.prefill_chunk_tokens as usize,
            step_timeout: std::time::Duration::from_secs(sched.step_timeout_seconds.max(1)),
        };
        let scheduler = match crate::scheduler::spawn(
            m.config.id.clone(),
            exec,
            self.metrics.clone(),
            settings,
            self.hung.clone(),
        ) {
            Ok(s) => s,
            Err(e) => {
                m.set(ModelState::Failed(format!(
                    "cannot start the scheduler: {e}"
                )));
                return;
            }
        };
        tracing::info!(model = %m.config.id, plugin = %plugin_id, load_s, ctx = info.context_length, kv = info.kv_capacity_tokens, template = template.source().as_str(), "model ready");
        m.set(ModelState::Ready(Arc::new(ReadyModel {
            shared,
            scheduler,
            template,
            tokenizer,
            plugin: plugin_id,
        })));
        m.memory.set_note(None);
        self.after_load(m);
    }

    /// `/readyz`: every model has a supporting engine and its artifacts, and
    /// eager models are loaded; never while draining.
    pub fn is_ready(&self) -> bool {
        if self.draining.load(Ordering::SeqCst) || self.registry.get().is_none() {
            return false;
        }
        self.models.values().all(|m| match m.state() {
            ModelState::Ready(_) => true,
            ModelState::Idle => m.config.load == LoadPolicy::Lazy,
            _ => false,
        })
    }

    pub fn is_live(&self) -> bool {
        !self.hung.load(Ordering::SeqCst)
    }

    /// The document served at `/v1/status`.
    pub fn status(&self) -> NodeStatus {
        let plugins = self
            .registry
            .get()
            .map(|reg| {
                reg.records
                    .iter()
                    .map(|r| {
                        let s = r.summary();
                        let (reason, message) = match &r.state {
                            PluginState::Loaded(_) => (None, None),
                            PluginState::Refused { label, reason } => {
                                (Some(label.to_string()), Some(reason.clone()))
                            }
                        };
                        PluginStatus {
                            id: s.id,
                            version: s.version,
                            abi_version: s.abi_version,
                            gpu_backend: s.gpu_backend,
                            loaded: r.plugin().is_some(),
                            reason,
                            message,
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let models = self.models.values().map(|m| self.model_status(m)).collect();
        NodeStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            backend: self.engine_config.backend.as_str().to_string(),
            ready: self.is_ready(),
            draining: self.draining.load(Ordering::SeqCst),
            plugins,
            models,
        }
    }

    fn model_status(&self, m: &ServedModel) -> ModelStatus {
        let state = m.state();
        let artifact_ready = m.primary.read().map(|p| p.is_some()).unwrap_or(false);
        let size = m.artifact_bytes.load(Ordering::Relaxed);
        let downloaded = m.download.as_ref().map(|p| p.snapshot());
        let (load_state, message) = match &state {
            // The memory policy's last word: unloaded to relieve a pool, or refused.
            ModelState::Idle => match m.memory.note() {
                Some(Note::Refused(r)) => (LoadState::Failed, Some(r.message)),
                Some(Note::Unloaded(msg)) => (LoadState::Unloaded, Some(msg)),
                None => (LoadState::Unloaded, None),
            },
            ModelState::Pending | ModelState::Unsupported => (LoadState::Unloaded, None),
            ModelState::Loading => (LoadState::Loading, None),
            ModelState::Ready(_) => (LoadState::Loaded, None),
            ModelState::Failed(msg) => (LoadState::Failed, Some(msg.clone())),
        };
        let (plugin, bytes_used, queue) = match &state {
            ModelState::Ready(r) => {
                let f = &r.scheduler.figures;
                (
                    Some(r.plugin.clone()),
                    r.shared.info().bytes_used,
                    QueueStatus {
                        waiting: f.waiting.load(Ordering::Relaxed),
                        running: f.running.load(Ordering::Relaxed),
                        kv_capacity_tokens: r.scheduler.kv_capacity,
                        kv_used_tokens: f.kv_used.load(Ordering::Relaxed),
                    },
                )
            }
            _ => (None, 0, QueueStatus::default()),
        };
        ModelStatus {
            id: m.config.id.clone(),
            format: m.format.as_str().to_string(),
            architecture: m.architecture.read().ok().and_then(|a| a.clone()),
            verdict: m.verdict.read().ok().and_then(|v| v.clone()),
            artifact: downloaded.unwrap_or(ArtifactStatus {
                state: if artifact_ready {
                    ArtifactState::Ready
                } else if matches!(state, ModelState::Failed(_)) {
                    ArtifactState::Failed
                } else {
                    ArtifactState::Pending
                },
                bytes_done: size,
                bytes_total: size,
                bytes_per_second: 0.0,
                message: None,
            }),
            load: LoadStatus {
                state: load_state,
                plugin,
                message,
                bytes_used,
            },
            queue,
        }
    }
}

/// The file an engine loads: the `.gguf` itself, or the only `.gguf` in a
/// directory; for safetensors, the directory's index or single shard.
pub fn primary_artifact(path: &Path, format: Format) -> Result<PathBuf, String> {
    if path.is_file() {
        let ext_ok = match format {
            Format::Gguf => path.extension().is_some_and(|e| e == "gguf"),
            Format::Safetensors => path
                .extension()
                .is_some_and(|e| e == "safetensors" || e == "json"),
        };
        if !ext_ok {
            return Err(format!(
                "{} is not a {format} file (the registered format is fixed)",
                path.display()
            ));
        }
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(format!("model path {} does not exist", path.display()));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| format!("cannot list {}: {e}", path.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| match format {
            Format::Gguf => p.extension().is_some_and(|e| e == "gguf") && !is_mmproj(p),
            Format::Safetensors => {
                p.file_name()
                    .is_some_and(|n| n == "model.safetensors.index.json")
                    || p.extension().is_some_and(|e| e == "safetensors")
            }
        })
        .collect();
    found.sort();
    if format == Format::Safetensors
        && let Some(index) = found.iter().find(|p| {
            p.file_name()
                .is_some_and(|n| n == "model.safetensors.index.json")
        })
    {
        return Ok(index.clone());
    }
    match found.len() {
        0 => Err(format!("no {format} artifact in {}", path.display())),
        1 => Ok(found.remove(0)),
        _ => Err(format!(
            "several {format} candidates in {}, name one: {}",
            path.display(),
            found
                .iter()
                .filter_map(|p| p.file_name())
                .map(|n| n.to_string_lossy())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

fn is_mmproj(p: &Path) -> bool {
    p.file_name()
        .is_some_and(|n| n.to_string_lossy().to_ascii_lowercase().contains("mmproj"))
}

/// Architecture from metadata, without loading weights: the GGUF header's
/// `general.architecture`, or `config.json`'s `model_type`.
pub fn read_architecture(primary: &Path, format: Format) -> Result<String, String> {
    match format {
        Format::Gguf => {
            let h = crate::gguf::read_header(primary)
                .map_err(|e| format!("{}: {e}", primary.display()))?;
            h.architecture()
                .map(str::to_string)
                .ok_or_else(|| format!("{} has no general.architecture", primary.display()))
        }
        Format::Safetensors => {
            let cfg = primary
                .parent()
                .unwrap_or(Path::new("."))
                .join("config.json");
            gantry_formats::hf_config::read(&cfg)
                .map(|c| c.model_type)
                .map_err(|e| format!("{}: {e}", cfg.display()))
        }
    }
}

/// Override > the model's own (GGUF or tokenizer_config.json) > ChatML.
fn choose_template(
    cfg: &ModelConfig,
    info: &gantry_engine_abi::ModelInfo,
    model_dir: &Path,
) -> Result<ChatTemplate, crate::template::TemplateError> {
    let bos = info.bos_text.clone();
    let eos = info.eos_text.clone();
    if let Some(t) = &cfg.chat_template {
        return ChatTemplate::new(TemplateSource::Override, t, bos, eos);
    }
    if let Some(t) = &info.chat_template {
        return ChatTemplate::new(TemplateSource::Model, t, bos, eos);
    }
    let tc = model_dir.join("tokenizer_config.json");
    if tc.is_file() {
        match ChatTemplate::from_tokenizer_config(&tc) {
            Ok(t) => return Ok(t),
            Err(e) => {
                tracing::warn!(path = %tc.display(), error = %e, "cannot use the template in tokenizer_config.json")
            }
        }
    }
    ChatTemplate::new(
        TemplateSource::DefaultChatml,
        crate::template::CHATML,
        bos,
        eos,
    )
}

/// The memory policy's side of the node (the decisions are memory.rs's pure
/// functions): last use, estimates, unloads and refusals.
impl Node {
    /// Replace the RAM budget: `bytes`, or when 0 the cgroup limit, else MemTotal.
    pub fn with_ram_limit(mut self, bytes: u64) -> Self {
        self.memory = NodeMemory::new(
            self.engine_config.backend,
            self.engine_config.vram_limit_bytes,
            bytes,
        );
        self
    }

    /// A request was admitted for `m`: it is now the most recently used.
    pub fn touch(&self, m: &ServedModel) {
        m.memory.touch(self.started.elapsed().as_millis() as u64);
    }

    /// The pool a model's weights and KV live in on this node.
    fn pool(&self) -> Pool {
        Pool::of(self.engine_config.backend)
    }

    /// Bytes `m` will hold once loaded, before loading it: its weight files
    /// plus the KV cache for its context (per-sequence context x sequences,
    /// at f16, from the GGUF header). Returns the total and how it was made.
    fn estimate(&self, m: &ServedModel, primary: &Path) -> (u64, String) {
        let weights = memory::weight_bytes(primary, m.format);
        let mut how = format!("weights {}", memory::human(weights));
        let mut kv = 0u64;
        if m.format == Format::Gguf {
            match crate::gguf::read_header(primary) {
                Ok(h) => {
                    let wanted = m
                        .config
                        .context_length
                        .filter(|c| *c > 0)
                        .unwrap_or(self.engine_config.context_length);
                    let trained = h
                        .context_length()
                        .and_then(|c| u32::try_from(c).ok())
                        .unwrap_or(u32::MAX)
                        .max(1);
                    let per_seq = if wanted == 0 {
                        trained
                    } else {
                        wanted.min(trained)
                    };
                    let seqs = m.config.max_batch_size.unwrap_or(DEFAULT_MAX_BATCH).max(1);
                    let cells = u64::from(per_seq) * u64::from(seqs);
                    match h.kv_bytes_per_token() {
                        Some(per_cell) => {
                            kv = per_cell.saturating_mul(cells);
                            how.push_str(&format!(
                                " + KV {} ({per_seq} tokens x {seqs} sequences)",
                                memory::human(kv)
                            ));
                        }
                        None => {
                            how.push_str(" (the header gives no attention shape; KV not counted)")
                        }
                    }
                }
                Err(e) => how.push_str(&format!(" (header unreadable: {e}; KV not counted)")),
            }
        }
        (weights.saturating_add(kv), how)
    }

    /// What a loaded model holds: the engine's report, else the estimate.
    fn held(&self, m: &ServedModel, r: &ReadyModel) -> Bytes {
        let reported = r.shared.info().bytes_used;
        let n = if reported > 0 {
            reported
        } else {
            m.memory.estimate.load(Ordering::Relaxed)
        };
        Bytes::in_pool(self.pool(), n)
    }

    /// Every loaded model as the policy sees it. Idle means nothing holds
    /// the model but its state (no request between admission and its last
    /// token) and nothing is queued; only `load: lazy` models may go, since
    /// an eager model's absence would make the node unready.
    fn residents(&self) -> Vec<Resident> {
        let mut out = Vec::new();
        for m in self.models.values() {
            let Ok(state) = m.state.read() else { continue };
            if let ModelState::Ready(r) = &*state {
                out.push(Resident {
                    id: m.config.id.clone(),
                    held: self.held(m, r),
                    last_used: m.memory.last_used(),
                    evictable: m.config.load == LoadPolicy::Lazy && is_idle(r),
                });
            }
        }
        out
    }

    /// Unload `u` if it is still idle (a request may have taken it since the
    /// plan was made). Its scheduler stops and the engine frees the model
    /// once the state's reference, the last one, is dropped here.
    fn unload_for_memory(&self, u: &Unload, why: &str) -> bool {
        let Some(m) = self.models.get(&u.id) else {
            return false;
        };
        let Ok(mut state) = m.state.write() else {
            return false;
        };
        let held = match &*state {
            ModelState::Ready(r) if is_idle(r) => self.held(m, r),
            _ => return false,
        };
        let pool = u.pool;
        let limit = self.memory.limits.get(pool);
        let message = format!(
            "unloaded as the least recently used idle model: {} use was {} of {} (watermark {} %) {why}; it reloads on its next request",
            pool.name(),
            memory::human(u.used),
            memory::human(limit),
            memory::WATERMARK_PERCENT,
        );
        tracing::warn!(target: "gantry::alert", model = %u.id, pool = pool.label(), used = u.used, limit, freed = held.get(pool), "{message}");
        *state = ModelState::Idle;
        drop(state);
        m.memory.set_note(Some(Note::Unloaded(message)));
        let reason = format!("{}_watermark", pool.label());
        self.metrics
            .model_unloads
            .with_label_values(&[u.id.as_str(), reason.as_str()])
            .inc();
        self.metrics
            .vram_used_bytes
            .with_label_values(&[&u.id])
            .set(0.0);
        true
    }

    /// Before loading `m`: estimate its need and unload least-recently-used
    /// idle models until it fits under the watermark, or refuse. A model
    /// whose last request is still finishing (its response sent, its
    /// scheduler not yet idle) gets a short, bounded moment to settle before
    /// the load is refused; so does a model that became busy after the plan.
    fn make_room(&self, m: &ServedModel, primary: &Path) -> Result<(), Refusal> {
        /// How long a load waits for busy lazy models to go idle.
        const SETTLE: Duration = Duration::from_millis(500);
        let (need, how) = self.estimate(m, primary);
        m.memory.estimate.store(need, Ordering::Relaxed);
        let need = Bytes::in_pool(self.pool(), need);
        let id = m.config.id.as_str();
        let why = format!("before loading model `{id}`");
        let deadline = Instant::now() + SETTLE;
        loop {
            let settling = Instant::now() < deadline && self.lazy_model_busy(id);
            match memory::plan_load(&self.memory.limits, id, need, &self.residents()) {
                Err(mut r) if r.never_fits || !settling => {
                    r.message.push_str(&format!(" (estimate: {how})"));
                    return Err(r);
                }
                Err(_) => {}
                Ok(unloads) => {
                    let mut all = true;
                    for u in &unloads {
                        all &= self.unload_for_memory(u, &why);
                    }
                    if all {
                        self.update_memory_gauges();
                        return Ok(());
                    }
                    if Instant::now() >= deadline {
                        let pool = self.pool();
                        return Err(Refusal {
                            pool,
                            message: format!(
                                "{}: model `{id}` needs {how}; the models that could make room kept getting busy",
                                pool.oom()
                            ),
                            never_fits: false,
                        });
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A loaded `load: lazy` model other than `except` is serving a request.
    fn lazy_model_busy(&self, except: &str) -> bool {
        self.models.values().any(|m| {
            m.config.id != except
                && m.config.load == LoadPolicy::Lazy
                && m.state
                    .read()
                    .is_ok_and(|s| matches!(&*s, ModelState::Ready(r) if !is_idle(r)))
        })
    }

    /// `m` came up: bring the pools back under their watermarks, and if the
    /// engine's real footprint does not fit at all, unload `m` itself.
    fn after_load(&self, m: &ServedModel) {
        let id = m.config.id.as_str();
        let (unloads, over) = memory::plan_after_load(&self.memory.limits, id, &self.residents());
        let why = format!("after model `{id}` loaded");
        for u in &unloads {
            self.unload_for_memory(u, &why);
        }
        if let Some(pool) = over {
            let held = m.ready().map_or(0, |r| self.held(m, &r).get(pool));
            let message = format!(
                "{}: model `{id}` holds {} of {} once loaded (the engine's report), more than fits beside the models in use; unloaded again",
                pool.oom(),
                memory::human(held),
                pool.name()
            );
            m.set(ModelState::Idle);
            let never_fits = false;
            self.refuse_load(
                m,
                Refusal {
                    pool,
                    message,
                    never_fits,
                },
            );
        }
        self.update_memory_gauges();
    }

    /// Record a refused load: the model stays unloaded (its next request
    /// tries again), its status says why, and an alert is logged.
    fn refuse_load(&self, m: &ServedModel, r: Refusal) {
        tracing::error!(target: "gantry::alert", model = %m.config.id, code = %r.pool.oom(), "model load refused: {}", r.message);
        self.metrics
            .model_load_refusals
            .with_label_values(&[m.config.id.as_str(), r.pool.oom().name()])
            .inc();
        m.memory.set_note(Some(Note::Refused(r)));
        m.set(ModelState::Idle);
        self.update_memory_gauges();
    }

    fn update_memory_gauges(&self) {
        let mut used = Bytes::default();
        for r in self.residents() {
            used.vram = used.vram.saturating_add(r.held.vram);
            used.ram = used.ram.saturating_add(r.held.ram);
        }
        for pool in Pool::ALL {
            let l = [pool.label()];
            self.metrics
                .memory_used_bytes
                .with_label_values(&l)
                .set(used.get(pool) as f64);
            self.metrics
                .memory_limit_bytes
                .with_label_values(&l)
                .set(self.memory.limits.get(pool) as f64);
        }
    }
}

/// No request holds the model (the state's reference is the only one) and
/// nothing is queued or running in its scheduler.
fn is_idle(r: &Arc<ReadyModel>) -> bool {
    let f = &r.scheduler.figures;
    Arc::strong_count(r) == 1
        && f.waiting.load(Ordering::Relaxed) == 0
        && f.running.load(Ordering::Relaxed) == 0
}
