//! A model's LoRA adapters on the node (request → `Node::adapter_lease` → scheduler; status):
//! which model id names an adapter, where its artifact is (a local path, or the model
//! store's download), its load into every replica of the ready base model (engine ABI 1.6),
//! the memory it holds and its LRU eviction, and its state for `/v1/status`.
//!
//! An adapter loads when its base model becomes ready (so a refused adapter shows in the
//! status at once) and again on the first request after an eviction or a restart. A request
//! holds an [`AdapterLease`] until its last token, so an adapter in use is never evicted.
//! Adapters count in the memory policy's budget through their model's `bytes_used`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use gantry_api::config::AdapterConfig;
use gantry_api::{AdapterState, AdapterStatus};
use gantry_engine_abi::{AdapterDescriptor, Format, Status};
use gantry_openai::ApiError;
use gantry_scheduler::GenError;

use super::{ModelState, Node, ReadyModel, ServedModel};
use crate::store::FetchRequest;

/// One adapter of a served model.
pub struct ServedAdapter {
    pub config: AdapterConfig,
    /// The OpenAI model id it is served under.
    pub id: String,
    /// Its name in the model's list: what the scheduler and engine know it by.
    pub name: Arc<str>,
    record: Mutex<Record>,
    /// Requests holding it (between admission and their last token).
    in_flight: AtomicUsize,
    /// Serializes loads of this adapter (a first burst of requests loads it once).
    load: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Record {
    /// The artifact on disk: a GGUF LoRA file or a PEFT directory.
    path: Option<PathBuf>,
    downloading: bool,
    /// Why it cannot serve: (reason label, message). Permanent until a new config.
    refused: Option<(String, String)>,
    last_used: Option<Instant>,
}

/// A request's hold on a loaded adapter: it is not evicted while any is alive.
pub struct AdapterLease(Arc<ServedAdapter>);

impl AdapterLease {
    pub fn name(&self) -> Arc<str> {
        self.0.name.clone()
    }
    pub fn id(&self) -> &str {
        &self.0.id
    }
}

impl Clone for AdapterLease {
    fn clone(&self) -> Self {
        self.0.lease()
    }
}

impl Drop for AdapterLease {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.0.record().last_used = Some(Instant::now());
    }
}

impl std::fmt::Debug for AdapterLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.id)
    }
}

impl ServedAdapter {
    pub fn new(config: &AdapterConfig, model_id: &str) -> Self {
        Self {
            id: config.model_id(model_id),
            name: config.name.as_str().into(),
            record: Mutex::new(Record {
                path: config.local_path(),
                ..Record::default()
            }),
            config: config.clone(),
            in_flight: AtomicUsize::new(0),
            load: tokio::sync::Mutex::new(()),
        }
    }

    fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn refuse(&self, reason: &str, message: String) {
        tracing::error!(target: "gantry::alert", adapter = %self.id, reason, "adapter refused: {message}");
        self.record().refused = Some((reason.into(), message));
    }

    fn lease(self: &Arc<Self>) -> AdapterLease {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.record().last_used = Some(Instant::now());
        AdapterLease(self.clone())
    }

    fn status(&self, ready: Option<&ReadyModel>) -> AdapterStatus {
        let r = self.record();
        let bytes = ready.and_then(|r| r.scheduler.adapter_bytes(&self.name));
        let state = match (&r.refused, bytes) {
            (Some(_), _) => AdapterState::Refused,
            (None, Some(_)) => AdapterState::Loaded,
            (None, None) if r.path.as_ref().is_some_and(|p| p.exists()) => AdapterState::Downloaded,
            (None, None) => AdapterState::Pending,
        };
        AdapterStatus {
            name: self.config.name.clone(),
            id: self.id.clone(),
            state,
            reason: r.refused.as_ref().map(|(reason, _)| reason.clone()),
            message: r.refused.as_ref().map(|(_, m)| m.clone()),
            bytes,
        }
    }
}

impl ServedModel {
    /// Its adapters now, in config order.
    pub fn adapters(&self) -> Arc<Vec<Arc<ServedAdapter>>> {
        self.adapters
            .read()
            .map(|a| a.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Its config as in force: the one it was made from, with the adapter list a reload may
    /// have swapped in since.
    pub fn live_config(&self) -> gantry_api::ModelConfig {
        let mut c = self.config.clone();
        c.adapters = self.adapters().iter().map(|a| a.config.clone()).collect();
        c
    }

    /// Take `list` (a new config's adapters) as the adapter list, keeping each adapter whose
    /// entry did not change (its files, load and leases carry on); returns the adapters that
    /// left the list.
    pub(crate) fn swap_adapters(&self, list: &[AdapterConfig]) -> Vec<Arc<ServedAdapter>> {
        let mut guard = self.adapters.write().unwrap_or_else(|p| p.into_inner());
        let old = guard.clone();
        let next: Vec<Arc<ServedAdapter>> = list
            .iter()
            .map(|c| {
                old.iter()
                    .find(|a| a.config == *c)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(ServedAdapter::new(c, &self.config.id)))
            })
            .collect();
        let gone = old
            .iter()
            .filter(|a| !next.iter().any(|n| Arc::ptr_eq(n, a)))
            .cloned()
            .collect();
        *guard = Arc::new(next);
        gone
    }

    /// Every adapter's state, in config order (`/v1/status`).
    pub fn adapter_statuses(&self) -> Vec<AdapterStatus> {
        let ready = match self.state() {
            ModelState::Ready(r) => Some(r),
            _ => None,
        };
        self.adapters()
            .iter()
            .map(|a| a.status(ready.as_deref()))
            .collect()
    }
}

/// The label of an engine's refusal of an adapter (`AdapterStatus::reason`).
fn refusal_reason(status: Status) -> Option<&'static str> {
    match status {
        Status::LoadFailed => Some("mismatch"),
        Status::ModelCorrupt => Some("corrupt"),
        Status::Unsupported => Some("unsupported"),
        _ => None,
    }
}

impl Node {
    /// What `vllm:lora_requests_info` says: the adapters with requests in flight (served
    /// ids), and how many adapters the node serves (all can be loaded at once, memory
    /// permitting; the endpoint picker reads it as the node's adapter capacity).
    pub fn lora_info(&self) -> crate::metrics::LoraInfo {
        let mut info = crate::metrics::LoraInfo::default();
        for a in self.models().values().flat_map(|m| m.adapters().to_vec()) {
            info.max_lora += 1;
            if a.in_flight.load(Ordering::SeqCst) > 0 {
                info.running.push(a.id.clone());
            }
        }
        info
    }

    /// The model and adapter a request's `model` names: a model id first (a `servedName` may
    /// itself contain `:`), then an adapter's id.
    pub fn resolve(&self, id: &str) -> Option<(Arc<ServedModel>, Option<Arc<ServedAdapter>>)> {
        let models = self.models();
        if let Some(m) = models.get(id) {
            return Some((m.clone(), None));
        }
        models.values().find_map(|m| {
            m.adapters()
                .iter()
                .find(|a| a.id == id)
                .map(|a| (m.clone(), Some(a.clone())))
        })
    }

    /// The adapter request `id` names on the ready model `m`, loaded into every replica and
    /// held for the request; `None` when `id` names the base model.
    pub async fn adapter_lease(
        &self,
        m: &ServedModel,
        ready: &ReadyModel,
        id: &str,
    ) -> Result<Option<AdapterLease>, ApiError> {
        let Some(a) = m.adapters().iter().find(|a| a.id == id).cloned() else {
            return Ok(None);
        };
        let lease = a.lease();
        self.load_adapter(m, ready, &a, true).await?;
        Ok(Some(lease))
    }

    /// Load `a` into the ready model unless it is there: make room by evicting idle adapters
    /// (least recently used first) when `evict`, else leave it for the first request.
    async fn load_adapter(
        &self,
        m: &ServedModel,
        ready: &ReadyModel,
        a: &Arc<ServedAdapter>,
        evict: bool,
    ) -> Result<(), ApiError> {
        let _one = a.load.lock().await;
        if let Some((reason, message)) = a.record().refused.clone() {
            return Err(refused(&a.id, &reason, &message));
        }
        if ready.scheduler.adapter_bytes(&a.name).is_some() {
            return Ok(());
        }
        let (path, downloading) = {
            let r = a.record();
            (r.path.clone(), r.downloading)
        };
        let Some(path) = path else {
            return Err(if downloading {
                ApiError::unavailable(
                    format!("adapter `{}` is downloading; retry shortly", a.id),
                    5,
                )
            } else {
                ApiError::unavailable(format!("adapter `{}` is not downloaded yet", a.id), 5)
            });
        };
        if !path.exists() {
            let why = format!("{} does not exist", path.display());
            a.refuse("download", why.clone());
            return Err(refused(&a.id, "download", &why));
        }
        let need = artifact_bytes(&path).saturating_mul(ready.scheduler.len() as u64);
        self.make_room_for_adapter(need, evict).await?;
        let desc = AdapterDescriptor {
            name: a.id.clone(),
            path,
            format: m.format,
            scale: a.config.scale(),
        };
        let started = Instant::now();
        match ready.scheduler.load_adapter(&a.name, &desc).await {
            Ok(bytes) => {
                tracing::info!(adapter = %a.id, bytes, ms = started.elapsed().as_millis() as u64, "adapter loaded");
                self.metrics
                    .adapter_events
                    .with_label_values(&[&a.id, "loaded"])
                    .inc();
                self.update_memory_gauges();
                Ok(())
            }
            Err(GenError::Engine(e)) => match refusal_reason(e.status) {
                Some(reason) => {
                    a.refuse(reason, e.message.clone());
                    self.metrics
                        .adapter_events
                        .with_label_values(&[&a.id, "refused"])
                        .inc();
                    Err(refused(&a.id, reason, &e.message))
                }
                None => Err(ApiError::from(e)),
            },
            Err(GenError::Crashed(c)) => Err(ApiError::unavailable(c.message(), 5)),
        }
    }

    /// Evict idle adapters, least recently used first, until `need` more bytes fit under the
    /// memory watermark; a 507 naming the pool when they cannot (or `!evict` and they do not
    /// fit as things are).
    async fn make_room_for_adapter(&self, need: u64, evict: bool) -> Result<(), ApiError> {
        loop {
            let limits = self.limits_now();
            let pool = self.pool();
            let Some(watermark) = limits.watermark(pool) else {
                return Ok(());
            };
            let used = self.held_now().get(pool);
            if used.saturating_add(need) <= watermark {
                return Ok(());
            }
            let victim = evict.then(|| self.idle_adapter_lru()).flatten();
            let Some((ready, a)) = victim else {
                let r = crate::memory::Refusal {
                    pool,
                    message: format!(
                        "an adapter of {} does not fit: {} of the {} {} watermark are in use and no idle adapter is left to evict",
                        crate::memory::human(need),
                        crate::memory::human(used),
                        crate::memory::human(watermark),
                        pool.name()
                    ),
                    never_fits: need > watermark,
                };
                return Err(ApiError::from(r.to_engine_error()));
            };
            if ready.scheduler.unload_adapter(&a.name).await {
                tracing::info!(adapter = %a.id, "adapter evicted (least recently used) to make room");
                self.metrics
                    .adapter_events
                    .with_label_values(&[&a.id, "evicted"])
                    .inc();
            } else {
                // It became busy in between: try the next one.
                tokio::task::yield_now().await;
            }
        }
    }

    /// The least recently used loaded adapter no request holds, with its model.
    fn idle_adapter_lru(&self) -> Option<(Arc<ReadyModel>, Arc<ServedAdapter>)> {
        let mut best: Option<(Option<Instant>, Arc<ReadyModel>, Arc<ServedAdapter>)> = None;
        for m in self.models().values() {
            let ModelState::Ready(ready) = m.state() else {
                continue;
            };
            for a in m.adapters().iter() {
                if a.in_flight.load(Ordering::SeqCst) > 0
                    || ready.scheduler.adapter_bytes(&a.name).is_none()
                {
                    continue;
                }
                let used = a.record().last_used;
                if best.as_ref().is_none_or(|(b, _, _)| used < *b) {
                    best = Some((used, ready.clone(), a.clone()));
                }
            }
        }
        best.map(|(_, r, a)| (r, a))
    }

    /// In the background: once no request holds each of `gone` (adapters a reload took off
    /// `m`'s list; bounded as a model's drain), unload it from `m`'s engines.
    pub(crate) fn spawn_adapter_drain(
        self: &Arc<Self>,
        rt: &tokio::runtime::Handle,
        m: &Arc<ServedModel>,
        gone: Vec<Arc<ServedAdapter>>,
    ) {
        if gone.is_empty() {
            return;
        }
        let bound = self.drain_bound(m);
        let (node, m) = (self.clone(), m.clone());
        rt.spawn(async move {
            let t0 = Instant::now();
            for a in gone {
                while a.in_flight.load(Ordering::SeqCst) > 0 && t0.elapsed() < bound {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                let ModelState::Ready(ready) = m.state() else {
                    continue; // not loaded: nothing holds the adapter
                };
                if ready.scheduler.unload_adapter(&a.name).await {
                    tracing::info!(adapter = %a.id, "adapter removed by a config reload: unloaded");
                    node.metrics
                        .adapter_events
                        .with_label_values(&[&a.id, "removed"])
                        .inc();
                }
            }
        });
    }

    /// Load a ready model's adapters in the background, as far as they fit without evicting
    /// anything, so their state (and any refusal) shows before the first request.
    pub(crate) fn warm_adapters(self: &Arc<Self>, m: &Arc<ServedModel>) {
        if m.adapters().is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (node, m) = (self.clone(), m.clone());
        rt.spawn(async move {
            let ModelState::Ready(ready) = m.state() else {
                return;
            };
            for a in m.adapters().iter() {
                if let Err(e) = node.load_adapter(&m, &ready, a, false).await {
                    tracing::info!(adapter = %a.id, "adapter not loaded at start: {}", e.message);
                }
            }
        });
    }

    /// Fetch the model's remote adapters in the background (the model store, as for the base).
    pub(crate) fn fetch_adapters(self: &Arc<Self>, m: &Arc<ServedModel>) {
        let remote: Vec<_> = m
            .adapters()
            .iter()
            .filter(|a| {
                let r = a.record();
                a.config.is_remote() && r.path.is_none() && !r.downloading
            })
            .cloned()
            .collect();
        if remote.is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(store) = self.store.get().cloned() else {
            for a in remote {
                a.refuse(
                    "download",
                    "this node has no model store configured for downloading sources".into(),
                );
            }
            return;
        };
        let format = m.format;
        rt.spawn(async move {
            for a in remote {
                let Some(source) = a.config.source.clone() else {
                    continue;
                };
                let files = match (a.config.files.is_empty(), format) {
                    (false, _) => a.config.files.clone(),
                    (true, Format::Safetensors) => vec![
                        "adapter_config.json".to_string(),
                        "adapter_model.safetensors".to_string(),
                    ],
                    (true, Format::Gguf | Format::Onnx) => Vec::new(),
                };
                a.record().downloading = true;
                let progress = Arc::new(crate::store::DownloadProgress::default());
                let req = FetchRequest {
                    model_id: &a.id,
                    source: &source,
                    format,
                    quantization: None,
                    files: &files,
                };
                let result = store.fetch(&req, &progress).await;
                let mut r = a.record();
                r.downloading = false;
                match result {
                    Ok(f) => {
                        r.path = Some(match format {
                            Format::Gguf | Format::Onnx => f.primary,
                            Format::Safetensors => f.dir,
                        })
                    }
                    Err(e) => {
                        drop(r);
                        a.refuse(
                            "download",
                            format!("cannot fetch the adapter's artifacts: {e}"),
                        );
                    }
                }
            }
        });
    }
}

/// The 400 for a request naming an adapter that cannot serve.
fn refused(id: &str, reason: &str, message: &str) -> ApiError {
    ApiError {
        code: Some("adapter_refused".into()),
        ..ApiError::invalid(
            "model",
            format!(
                "adapter `{id}` cannot serve ({reason}): {message}; its base model still serves"
            ),
        )
    }
}

/// Bytes of an adapter's artifact: the file, or the files of a directory.
fn artifact_bytes(path: &std::path::Path) -> u64 {
    if path.is_file() {
        return std::fs::metadata(path).map_or(0, |m| m.len());
    }
    std::fs::read_dir(path)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
