//! Node state (under the HTTP layer): the models this node serves, their lifecycle and verdicts.
//!
//! A request meets this module once, at `ready_model` (node/lifecycle.rs),
//! between validation and the chat template. `status` answers the probes and
//! `/v1/status`; memory/node.rs applies the memory policy to loads.
//!
//! For each configured model: fetch remote artifacts through the model store
//! (in the background, after the HTTP server is up; the model answers 503
//! with `Retry-After` meanwhile), find its primary artifact, read its metadata
//! without loading weights (GGUF header or `config.json`), ask the engine
//! registry for a verdict, and — when supported — load it and start its
//! scheduler. The state of every model is what `/readyz`, `/v1/models` and
//! `/v1/status` report; there is no silent fallback to another engine.
//!
//! The set of models is replaceable while the node runs (node/reload.rs): readers take a
//! snapshot of the map with [`Node::models`] and keep the models they found for as long as
//! they need them; a reload swaps the map and retires what left it.

mod adapters;
mod crash;
mod draft;
pub mod engine_choice;
mod lifecycle;
mod plugin_update;
mod reload;
mod status;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Instant;

use gantry_api::EngineVerdict;
use gantry_engine_abi::{EngineConfig, Format};

use crate::engine_host::{EngineRegistry, ModelShared};
use crate::memory::{ModelMemory, NodeMemory};
use crate::metrics::Metrics;
use crate::replicas::EngineReplicas;
use crate::response_cache::ResponseCache;
use crate::store::{DownloadProgress, FetchRequest, Fetched, ModelStore, StoreSetup};
use crate::template::{ChatTemplate, TemplateSource};
use crate::tokenizer::Tokenizer;
use gantry_api::config::{LoadPolicy, ModelConfig, NodeConfig};

pub use adapters::{AdapterLease, ServedAdapter};
pub use crash::CrashRecord;
pub use lifecycle::Unavailable;
pub use reload::{ModelDiff, ReloadError, ReloadReport, node_wide_changes};

/// The models a node serves, by OpenAI id.
pub type ModelMap = BTreeMap<String, Arc<ServedModel>>;

/// Default per-sequence context when neither the config nor a smaller trained length says otherwise.
pub const DEFAULT_CONTEXT: u32 = 4096;
/// Default sequences decoded together.
pub const DEFAULT_MAX_BATCH: u32 = 8;

/// A model ready to serve.
pub struct ReadyModel {
    /// The first replica's engine model: model facts, tokenizer and vocabulary (every
    /// replica loads the same files).
    pub shared: Arc<ModelShared>,
    /// The schedulers of the model's replicas; requests go to them in turn.
    pub scheduler: EngineReplicas,
    pub template: ChatTemplate,
    pub tokenizer: Tokenizer,
    pub plugin: String,
    /// The vocabulary for constrained decoding (built in the background once ready).
    pub vocabulary: Arc<crate::constraint::Vocabulary>,
    /// Its draft model for speculative decoding, when the config names one.
    pub draft: Option<gantry_api::DraftStatus>,
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
    pub download: Option<Arc<DownloadProgress>>,
    /// The artifacts once fetched (remote sources).
    pub fetched: OnceLock<Fetched>,
    /// Serializes loads (eager start-up and lazy first requests).
    pub(crate) load_lock: std::sync::Mutex<()>,
    /// Last use and the memory policy's last decision (memory.rs).
    pub memory: ModelMemory,
    /// Devices each replica was placed on at its last load, main first (devices.rs).
    pub placement: RwLock<Vec<Vec<u32>>>,
    /// The fall in its devices' free memory across its last load (0 = not measured).
    pub measured_vram: std::sync::atomic::AtomicU64,
    /// Whether `/readyz` waits for it: the models of the config the node started with do; a
    /// model a reload added does not take readiness from a node that serves the others.
    pub gates_readiness: bool,
    /// `Node::start_model` ran for it (at start, or by the reload that added it).
    started: AtomicBool,
    /// A reload removed or replaced it: it takes no new request, never loads again, and is
    /// unloaded once no request holds it (node/reload.rs).
    retired: AtomicBool,
    /// Its engine workers' crashes and the restart they wait for (node/crash.rs).
    pub crashes: Mutex<CrashRecord>,
    /// How the engine was chosen among several that support the model (`/v1/status`).
    pub engine_choice: RwLock<Option<gantry_api::EngineChoice>>,
    /// Its LoRA adapters, in config order (node/adapters.rs); a reload that changes only the
    /// adapter list swaps it in place (node/reload.rs).
    adapters: RwLock<Arc<Vec<Arc<ServedAdapter>>>>,
}

impl ServedModel {
    /// A model of the config, not inspected yet. `gates_readiness`: see the field.
    pub fn new(config: &ModelConfig, gates_readiness: bool) -> Self {
        Self {
            config: config.clone(),
            format: config.format().unwrap_or(Format::Gguf), // validated by NodeConfig::validate
            state: RwLock::new(ModelState::Pending),
            verdict: RwLock::new(None),
            architecture: RwLock::new(None),
            primary: RwLock::new(None),
            artifact_bytes: std::sync::atomic::AtomicU64::new(0),
            download: config
                .is_remote()
                .then(|| Arc::new(DownloadProgress::default())),
            fetched: OnceLock::new(),
            load_lock: std::sync::Mutex::new(()),
            memory: ModelMemory::default(),
            placement: RwLock::new(Vec::new()),
            measured_vram: std::sync::atomic::AtomicU64::new(0),
            gates_readiness,
            started: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            crashes: Mutex::new(CrashRecord::default()),
            engine_choice: RwLock::new(None),
            adapters: RwLock::new(Arc::new(
                config
                    .adapters
                    .iter()
                    .map(|a| Arc::new(ServedAdapter::new(a, &config.id)))
                    .collect(),
            )),
        }
    }

    /// A reload removed or replaced it (see the field).
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::SeqCst)
    }

    pub fn state(&self) -> ModelState {
        self.state
            .read()
            .map(|s| s.clone())
            .unwrap_or(ModelState::Pending)
    }
    pub(crate) fn set(&self, s: ModelState) {
        if let Ok(mut g) = self.state.write() {
            *g = s;
        }
    }
    /// Where the model's config asks to go (`gpus`, `devices`).
    pub fn placement_request(&self) -> crate::devices::PlacementRequest {
        crate::devices::PlacementRequest {
            gpus: self.config.gpus.unwrap_or(0),
            devices: self.config.devices.clone(),
        }
    }

    /// Every device the model's replicas were placed on, in replica order.
    pub fn devices(&self) -> Vec<u32> {
        self.placement
            .read()
            .map(|p| p.iter().flatten().copied().collect())
            .unwrap_or_default()
    }

    /// Engine instances the config asks for (`replicas`, default 1).
    pub fn replicas(&self) -> u32 {
        self.config.replicas.unwrap_or(1).max(1)
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
    /// The config the node started with (flags applied). Its node-wide settings stay in force
    /// for the life of the process; its `models` are only the start-up list: the models served
    /// now are [`Node::models`].
    pub config: NodeConfig,
    /// The models served now; a reload swaps the whole map (read it through `models()`).
    models: RwLock<Arc<ModelMap>>,
    /// Models a reload removed or replaced that still hold an engine: the memory policy counts
    /// them until they are unloaded (node/reload.rs).
    pub(crate) retiring: Mutex<Vec<Arc<ServedModel>>>,
    /// The hash of the config file in force (`/v1/status` `configHash`).
    config_hash: RwLock<Option<String>>,
    /// Node-wide settings the config file changed that wait for a restart (`/v1/status`).
    restart_required: RwLock<Vec<String>>,
    /// One reload at a time.
    reload_lock: Mutex<()>,
    /// The plugins, discovered on first use; a plugin update (node/plugin_update.rs) swaps
    /// the whole registry, as a config reload swaps the model map.
    registry: RwLock<Option<Arc<EngineRegistry>>>,
    /// The last library change of each plugin the node saw while running (`/v1/status`).
    pub(crate) plugin_updates: Mutex<BTreeMap<String, (gantry_api::PluginUpdate, Instant)>>,
    /// How plugins in `process` isolation get their workers, and the crash hook.
    pub workers: crate::engine_host::WorkerSettings,
    /// This node, for the threads a crash starts (set by `start`).
    pub(crate) me: OnceLock<std::sync::Weak<Node>>,
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
    /// The GPUs this process sees and the reserve kept out of VRAM budgets (devices.rs).
    pub devices: crate::devices::NodeDevices,
    /// Fetches remote sources; unset on a node serving local files only, until a reload brings
    /// a remote model (made then from `store_setup`).
    pub store: OnceLock<ModelStore>,
    /// How to make the store; `None`: this node never downloads.
    pub store_setup: Option<StoreSetup>,
    /// The token callers must present (`http::node_auth`); `None` checks nothing.
    pub node_token: Option<crate::node_token::NodeToken>,
}

impl Node {
    pub fn new(config: NodeConfig, plugins_dir: PathBuf, engine_config: EngineConfig) -> Self {
        let models: ModelMap = config
            .models
            .iter()
            .map(|m| (m.id.clone(), Arc::new(ServedModel::new(m, true))))
            .collect();
        let metrics = Metrics::new();
        let cache = ResponseCache::with_ram_fraction(
            config.scheduler.response_cache_ram_fraction,
            metrics.clone(),
        );
        let memory = NodeMemory::new(
            engine_config.backend,
            engine_config.vram_limit_bytes,
            0,
            config.scheduler.memory_watermark_percent,
        );
        Self {
            config,
            models: RwLock::new(Arc::new(models)),
            retiring: Mutex::new(Vec::new()),
            config_hash: RwLock::new(None),
            restart_required: RwLock::new(Vec::new()),
            reload_lock: Mutex::new(()),
            registry: RwLock::new(None),
            plugin_updates: Mutex::new(BTreeMap::new()),
            workers: crate::engine_host::WorkerSettings::default(),
            me: OnceLock::new(),
            engine_config,
            plugins_dir,
            metrics,
            hung: Arc::new(AtomicBool::new(false)),
            draining: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            cache,
            started: Instant::now(),
            memory,
            devices: crate::devices::NodeDevices::from_driver(
                crate::devices::DEFAULT_VRAM_RESERVE_BYTES,
            ),
            store: OnceLock::new(),
            store_setup: None,
            node_token: None,
        }
    }

    /// The models served now: a snapshot, unchanged by a later reload.
    pub fn models(&self) -> Arc<ModelMap> {
        self.models
            .read()
            .map(|m| m.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// The model served now as `id`.
    pub fn model(&self, id: &str) -> Option<Arc<ServedModel>> {
        self.models().get(id).cloned()
    }

    /// Read the devices again every 10 s for the per-device gauges (on a node that found a
    /// GPU through the driver; a machine without one does not grow one, and a recorded
    /// snapshot does not change). Loads read them again themselves.
    pub fn spawn_device_refresh(self: &Arc<Self>) {
        self.metrics.set_devices(&self.devices.snapshot());
        if !self.devices.measures_loads() || self.devices.snapshot().devices.is_empty() {
            return;
        }
        let node = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(10));
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(n) = node.upgrade() else { return };
                let _ = tokio::task::spawn_blocking(move || {
                    let snap = n.devices.refresh();
                    n.metrics.set_devices(&snap);
                })
                .await;
            }
        });
    }

    /// Use `devices` (a recorded snapshot, or the driver with another reserve).
    pub fn with_devices(mut self, devices: crate::devices::NodeDevices) -> Self {
        self.devices = devices;
        self
    }

    /// Require `token` on every request but the probes and metrics.
    pub fn with_node_token(mut self, token: Option<crate::node_token::NodeToken>) -> Self {
        self.node_token = token;
        self
    }

    /// Use `store` for the models with remote sources.
    pub fn with_store(mut self, store: ModelStore) -> Self {
        self.store = OnceLock::from(store);
        self
    }

    /// Make the model store with `setup` when a reload brings the first remote model.
    pub fn with_store_setup(mut self, setup: StoreSetup) -> Self {
        self.store_setup = Some(setup);
        self
    }

    /// The engine registry, discovered on first use, each plugin in the isolation the config
    /// gives it.
    pub(crate) fn registry(&self) -> Arc<EngineRegistry> {
        if let Some(r) = self.registry_now() {
            return r;
        }
        let mut g = self.registry.write().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert_with(|| {
            Arc::new(EngineRegistry::discover_with(
                &self.plugins_dir,
                &self.engine_config,
                &self.host_settings(),
            ))
        })
        .clone()
    }

    /// The registry once discovered; `None` before.
    pub fn registry_now(&self) -> Option<Arc<EngineRegistry>> {
        self.registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Put `reg` in force (a plugin update).
    pub(crate) fn set_registry(&self, reg: Arc<EngineRegistry>) {
        *self.registry.write().unwrap_or_else(|p| p.into_inner()) = Some(reg);
    }

    /// How this node runs plugins: the config's isolation and its worker settings.
    pub(crate) fn host_settings(&self) -> crate::engine_host::HostSettings {
        crate::engine_host::HostSettings {
            isolation: self.config.isolation.clone(),
            workers: self.workers.clone(),
        }
    }

    /// Start workers with this executable (tests run the node inside a test binary).
    pub fn with_worker_exe(mut self, exe: PathBuf) -> Self {
        self.workers.exe = exe;
        self
    }

    /// Discover plugins, start the downloads of remote models, then inspect
    /// and (eagerly) load every local one; a downloaded model is inspected
    /// and loaded when its artifacts are complete. Blocking: run it off the
    /// async runtime, from a task of the runtime the downloads run on.
    pub fn start(self: &Arc<Self>) {
        self.watch_workers();
        self.registry();
        let models = self.models();
        // Downloads first: they run in the background while the local models load.
        let (remote, mut local): (Vec<_>, Vec<_>) =
            models.values().partition(|m| m.download.is_some());
        // Draft models first: a model that drafts with one waits for it to be inspected.
        let drafts: std::collections::HashSet<&str> = models
            .values()
            .filter_map(|m| m.config.speculation.draft_model.as_deref())
            .collect();
        local.sort_by_key(|m| !drafts.contains(m.config.id.as_str()));
        for m in remote.into_iter().chain(local) {
            self.start_model(m);
        }
    }

    /// Bring one model up, once: a remote model's download starts in the background (and it
    /// is inspected and loaded when complete); a local model is inspected and, under
    /// `load: eager`, loaded. Blocking for a local model, like `start`.
    pub(crate) fn start_model(self: &Arc<Self>, m: &Arc<ServedModel>) {
        if m.started.swap(true, Ordering::SeqCst) {
            return;
        }
        self.fetch_adapters(m);
        if m.download.is_some() {
            self.spawn_fetch(m.clone());
        } else {
            self.inspect_and_load(m);
            self.warm_adapters(m);
        }
    }

    /// Read the model's artifact and verdict, then load it when it is eager and supported;
    /// nothing for a retired model.
    fn inspect_and_load(&self, m: &ServedModel) {
        if m.is_retired() {
            return;
        }
        self.inspect(&self.registry(), m);
        if m.config.load == LoadPolicy::Eager && matches!(m.state(), ModelState::Idle) {
            self.load(m);
        }
    }

    /// Fetch a remote model's artifacts in the background, then inspect and load it.
    fn spawn_fetch(self: &Arc<Self>, m: Arc<ServedModel>) {
        let Some(progress) = m.download.clone() else {
            return;
        };
        let (Some(store), Some(source)) = (self.store.get().cloned(), m.config.source.clone())
        else {
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
                    let (n, mm) = (node.clone(), m.clone());
                    let blocking = tokio::task::spawn_blocking(move || n.inspect_and_load(&mm));
                    if let Err(e) = blocking.await {
                        tracing::error!(error = %e, "inspecting a downloaded model failed");
                    }
                    node.warm_adapters(&m);
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
                    if !p.exists() {
                        return Err(format!("model path {} does not exist", p.display()));
                    }
                    // A file or a directory: the store's selection rules (the
                    // registered format only, exact quantization, mmproj).
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
        let primary = match located {
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
        let c = &m.config;
        let verdict = reg.resolve(m.format, &arch, c.engine.as_deref(), &c.modalities);
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
}

/// Architecture from metadata, without loading weights: the GGUF header's
/// `general.architecture`, the model class `config.json` names first in `architectures`
/// (`LlamaForCausalLM`, ...), or the family an ONNX graph's config describes (`PiperVoice`). The class, not `model_type`, says which implementation runs the
/// weights (seeds 000/001), so it is what safetensors engines list in their manifests and
/// what the operator selects by (it learns the architecture from this report).
pub fn read_architecture(primary: &Path, format: Format) -> Result<String, String> {
    match format {
        Format::Gguf => {
            let h = gantry_formats::gguf::read_header(primary)
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
            let c = gantry_formats::hf_config::read(&cfg)
                .map_err(|e| format!("{}: {e}", cfg.display()))?;
            c.architectures.into_iter().next().ok_or_else(|| {
                format!(
                    "{}: no `architectures` list: a safetensors model's engine is chosen by its model class",
                    cfg.display()
                )
            })
        }
        Format::Onnx => gantry_formats::onnx::architecture(primary),
    }
}
