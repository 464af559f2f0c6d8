//! Node state, model lifecycle (the step after validation): the model a request names, ready
//! to serve — loaded first when it is lazy — or why it is not.
//!
//! `ready_model` answers for every request; its refusals are [`Unavailable`],
//! which `error.rs` maps to HTTP (404, or 503 with `Retry-After`, or 507 when
//! the memory policy refused the load). `load` brings a model up: memory
//! room (memory/node.rs), the engine's `load_model`, the chat template, the
//! tokenizer and the model's scheduler.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gantry_api::{ArtifactState, ArtifactStatus, EngineVerdict};
use gantry_engine_abi::{ModelDescriptor, Status};

use super::{DEFAULT_MAX_BATCH, ModelState, Node, ReadyModel, ServedModel};
use crate::engine_host::Plugin;
use crate::memory::{Pool, Refusal};
use crate::replicas::{EngineReplica, EngineReplicas, PluginEngine};
use crate::scheduler::{ModelFigures, SchedulerSettings};
use crate::template::{ChatTemplate, TemplateSource};
use crate::tokenizer::Tokenizer;
use gantry_api::config::ModelConfig;

/// Why a model cannot take a request now.
#[derive(Clone, Debug, PartialEq)]
pub enum Unavailable {
    /// The node is shutting down.
    Draining,
    /// No model by that id on this node (never configured, or removed by a reload).
    Unknown(String),
    /// Its artifacts are still being fetched; how far it got, when known.
    Downloading {
        id: String,
        progress: Option<ArtifactStatus>,
    },
    /// Being inspected or loaded by another request or at start-up.
    Loading(String),
    /// Being loaded; the caller should retry shortly.
    LoadingNow(String),
    /// The memory policy or the engine refused to load it.
    Refused(Refusal),
    /// This request's load failed.
    LoadFailed { id: String, message: String },
    /// It failed before this request (artifacts or an earlier load).
    Failed { id: String, message: String },
    /// No engine supports it; why, per plugin.
    Unsupported { id: String, why: String },
    /// The blocking load task could not be joined.
    LoadTask(String),
    /// Its engine worker crashed and the restart waits out its backoff (node/crash.rs).
    Restarting {
        id: String,
        wait: std::time::Duration,
        why: String,
    },
}

impl Node {
    /// The model `id` ready to serve, loading it first when it is idle
    /// (`load: lazy`, or unloaded by the memory policy). A model a reload removed is unknown
    /// from the moment the new map is in place, also to a request that found it just before.
    pub async fn ready_model(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<(Arc<ServedModel>, Arc<ReadyModel>), Unavailable> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(Unavailable::Draining);
        }
        // A model id, or one of its adapters' ids (the adapter itself: `adapter_lease`).
        let m = self
            .resolve(id)
            .map(|(m, _)| m)
            .filter(|m| !m.is_retired())
            .ok_or_else(|| Unavailable::Unknown(id.to_string()))?;
        let id = id.to_string();
        match m.state() {
            ModelState::Ready(r) => {
                self.touch(&m); // the memory policy's "last used"
                Ok((m, r))
            }
            ModelState::Idle => {
                let restart = m
                    .crashes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .waiting_restart(Instant::now());
                if let Some((wait, why)) = restart {
                    return Err(Unavailable::Restarting { id, wait, why });
                }
                // This request loads the model.
                self.touch(&m);
                let (n, mm) = (self.clone(), m.clone());
                tokio::task::spawn_blocking(move || n.load(&mm))
                    .await
                    .map_err(|e| Unavailable::LoadTask(e.to_string()))?;
                if m.is_retired() {
                    return Err(Unavailable::Unknown(id));
                }
                match m.state() {
                    ModelState::Ready(r) => {
                        self.warm_adapters(&m);
                        Ok((m, r))
                    }
                    // Refused by the memory policy or the engine: 507 with OOM_RAM/OOM_VRAM.
                    ModelState::Idle => Err(match m.memory.refusal() {
                        Some(r) => Unavailable::Refused(r),
                        None => Unavailable::LoadingNow(id),
                    }),
                    ModelState::Failed(message) => Err(Unavailable::LoadFailed { id, message }),
                    _ => Err(Unavailable::LoadingNow(id)),
                }
            }
            ModelState::Pending
                if m.download
                    .as_ref()
                    .is_some_and(|d| d.state() != ArtifactState::Ready) =>
            {
                Err(Unavailable::Downloading {
                    id,
                    progress: m.download.as_ref().map(|p| p.snapshot()),
                })
            }
            ModelState::Pending | ModelState::Loading => Err(Unavailable::Loading(id)),
            ModelState::Failed(message) => Err(Unavailable::Failed { id, message }),
            ModelState::Unsupported => {
                let why = m
                    .verdict
                    .read()
                    .ok()
                    .and_then(|v| v.clone())
                    .map(|v| match v {
                        EngineVerdict::Unsupported { rejections } => rejections
                            .iter()
                            .map(|r| format!("{}: {}", r.plugin, r.reason))
                            .collect::<Vec<_>>()
                            .join("; "),
                        EngineVerdict::Supported { .. } => String::new(),
                    })
                    .unwrap_or_default();
                Err(Unavailable::Unsupported { id, why })
            }
        }
    }

    /// The devices each replica of `m` goes on: none on a CPU node (where asking for GPUs is
    /// an error; the replicas share the cores), else by `devices::place_replicas`.
    fn placement_for(
        &self,
        m: &ServedModel,
        snap: &crate::devices::DeviceSnapshot,
    ) -> Result<Vec<Vec<u32>>, crate::devices::PlacementError> {
        let want = m.placement_request();
        if self.engine_config.backend == gantry_engine_abi::Backend::Cuda {
            return crate::devices::place_replicas(snap, &m.config.id, &want, m.replicas());
        }
        if want.gpus > 0 || !want.devices.is_empty() {
            return Err(crate::devices::PlacementError(format!(
                "model `{}` asks for GPUs (gpus/devices) but this node runs the cpu backend",
                m.config.id
            )));
        }
        Ok(vec![Vec::new(); m.replicas() as usize])
    }

    /// Load a supported model and start its scheduler. Blocking. A retired model is not
    /// loaded (checked under the load lock, which the reload's drain takes too).
    pub fn load(&self, m: &ServedModel) {
        let _serial = m.load_lock.lock().unwrap_or_else(|p| p.into_inner());
        if m.is_retired() || !matches!(m.state(), ModelState::Idle) {
            return;
        }
        let Some(reg) = self.registry_now() else {
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
        // A draft model still downloading: wait for it outside the memory lock.
        self.wait_for_draft(m);
        // Plan, unload and load as one step: no other load counts the same free bytes.
        let _room = self.memory.lock.lock().unwrap_or_else(|p| p.into_inner());
        // Real device figures for the budget, the placement and the measurement after.
        let mut before = self.devices.refresh();
        self.metrics.set_devices(&before);
        let placement = match self.placement_for(m, &before) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(target: "gantry::alert", model = %m.config.id, "model placement refused: {e}");
                m.set(ModelState::Failed(format!("placement: {e}")));
                return;
            }
        };
        // Several engines support the model and none is pinned: measure them (or take the
        // cached figures) and let the best serve it.
        let (plugin_id, plugin) = self
            .choose_engine(m, &reg, &primary, &placement, &mut before)
            .and_then(|id| reg.plugin(&id).map(|p| (id, p)))
            .unwrap_or((plugin_id, plugin));
        if let Err(r) = self.make_room(m, &primary) {
            self.refuse_load(m, r);
            return;
        }
        m.set(ModelState::Loading);
        let ready = match self.build_ready(m, &plugin_id, plugin, &primary, &placement) {
            Ok(r) => r,
            Err(BuildError::Refused(r)) => {
                self.refuse_load(m, r);
                return;
            }
            Err(BuildError::Failed(why)) => {
                m.set(ModelState::Failed(why));
                return;
            }
        };
        let reported = ready.scheduler.bytes_used();
        // What the load really took on its devices, checked against the engine's figure.
        let after = self.devices.refresh();
        self.metrics.set_devices(&after);
        let all_devices: Vec<u32> = placement.iter().flatten().copied().collect();
        let measured = if self.devices.measures_loads()
            && self.engine_config.backend == gantry_engine_abi::Backend::Cuda
        {
            crate::devices::measured_use(&before, &after, &all_devices)
        } else {
            None
        };
        m.measured_vram
            .store(measured.unwrap_or(0), Ordering::Relaxed);
        if let Some(w) =
            measured.and_then(|x| crate::devices::check_report(&m.config.id, reported, x))
        {
            tracing::warn!(target: "gantry::alert", model = %m.config.id, "{w}");
        }
        if let Ok(mut p) = m.placement.write() {
            *p = placement;
        }
        self.metrics
            .model_memory_bytes
            .with_label_values(&[&m.config.id])
            .set(reported.max(measured.unwrap_or(0)) as f64);
        m.set(ModelState::Ready(ready));
        m.memory.set_note(None);
        self.after_load(m);
    }

    /// When several loaded plugins support `m` and its config pins none, benchmark each
    /// (node/engine_choice.rs; cached figures where the cache has them), record the choice
    /// in `m` and its verdict, and return the winner. `None`: one candidate, a pin, or no
    /// candidate passed (the verdict's plugin then loads as before and fails or serves on its
    /// own). Runs under the memory lock, one candidate loaded at a time. `devices` is the
    /// load's reading from before; after a benchmark it is read again, so the load's own
    /// measurement starts from where the candidates left the devices.
    fn choose_engine(
        &self,
        m: &ServedModel,
        reg: &crate::engine_host::EngineRegistry,
        primary: &Path,
        placement: &[Vec<u32>],
        devices: &mut crate::devices::DeviceSnapshot,
    ) -> Option<String> {
        use super::engine_choice as ec;
        if m.config.engine.is_some() {
            return None;
        }
        let arch = m.architecture.read().ok().and_then(|a| a.clone())?;
        let ids = reg.alternatives(m.format, &arch, &m.config.modalities);
        if ids.len() < 2 {
            return None;
        }
        let on = placement.first().cloned().unwrap_or_default();
        let cuda = self.engine_config.backend == gantry_engine_abi::Backend::Cuda;
        let mine = || devices.devices.iter().filter(|d| on.contains(&d.index));
        let device = if cuda {
            let names: Vec<String> = mine().map(|d| d.name.clone()).collect();
            format!("cuda/{}", names.join("+"))
        } else {
            let threads = m.config.threads.unwrap_or(self.engine_config.n_threads);
            format!("cpu/{threads}t")
        };
        let limit = self
            .limits_now()
            .get(crate::memory::Pool::of(self.engine_config.backend));
        let budget = if limit > 0 {
            limit
        } else if cuda {
            mine().map(|d| d.total_bytes).sum()
        } else {
            ec::machine_ram_bytes().unwrap_or(0)
        };
        let read = || self.devices.refresh();
        let probe = ec::Probe {
            budget_bytes: budget,
            devices: cuda.then_some((
                &read as &dyn Fn() -> crate::devices::DeviceSnapshot,
                &on[..],
            )),
        };
        let fingerprint = ec::fingerprint(primary).ok();
        let cache = ec::ChoiceCache::new(crate::store::cache_dir(
            self.store_setup.as_ref(),
            &self.config,
        ));
        let desc = descriptor(m, primary, &on);
        let mut results = Vec::with_capacity(ids.len());
        let mut measured = false;
        for id in &ids {
            let plugin = reg.plugin(id)?;
            let version = plugin.info().engine_version.clone();
            let key = fingerprint
                .as_deref()
                .map(|f| ec::ChoiceCache::key(f, id, &version, &device));
            if let Some(hit) = key.as_deref().and_then(|k| cache.get(k)) {
                results.push(hit);
                continue;
            }
            tracing::info!(model = %m.config.id, plugin = %id, "benchmarking a candidate engine");
            let r = ec::bench(id, plugin, &desc, &probe);
            measured = true;
            if let Some(k) = &key {
                cache.put(k, &r);
            }
            results.push(r);
        }
        if measured {
            *devices = self.devices.refresh();
        }
        let Some(winner) = ec::decide(&mut results) else {
            tracing::error!(target: "gantry::alert", model = %m.config.id, "no candidate engine passed its benchmark: {}", results.iter().map(|r| format!("{}: {}", r.plugin, r.message.as_deref().unwrap_or(&r.outcome))).collect::<Vec<_>>().join("; "));
            *m.engine_choice.write().unwrap_or_else(|p| p.into_inner()) =
                Some(gantry_api::EngineChoice {
                    chosen: String::new(),
                    rule: ec::RULE.into(),
                    candidates: results,
                });
            return None;
        };
        let chosen = results[winner].plugin.clone();
        let version = results[winner].version.clone();
        tracing::info!(model = %m.config.id, plugin = %chosen, "engine chosen by measurement: {}", results.iter().map(|r| format!("{} {} ({:.1} tok/s, TTFT {:.0} ms{})", r.plugin, r.outcome, r.tokens_per_second.unwrap_or(0.0), r.ttft_ms.unwrap_or(0.0), if r.cached { ", cached" } else { "" })).collect::<Vec<_>>().join(", "));
        *m.engine_choice.write().unwrap_or_else(|p| p.into_inner()) =
            Some(ec::status(results, winner));
        *m.verdict.write().unwrap_or_else(|p| p.into_inner()) = Some(EngineVerdict::Supported {
            plugin: chosen.clone(),
            version,
        });
        Some(chosen)
    }

    /// Load every replica of `m` with `plugin` and start their schedulers: a ready model, not
    /// yet installed in `m` (a load installs it; a plugin update installs it only once its
    /// warm-up passed). Blocking.
    pub(crate) fn build_ready(
        &self,
        m: &ServedModel,
        plugin_id: &str,
        plugin: &Plugin,
        primary: &Path,
        placement: &[Vec<u32>],
    ) -> Result<Arc<ReadyModel>, BuildError> {
        let t0 = Instant::now();
        // One engine instance per replica; a replica that fails takes the others down with it
        // (dropping them unloads them), so a model is either fully loaded or not at all.
        let mut loaded = Vec::with_capacity(placement.len());
        for (i, devices) in placement.iter().enumerate() {
            let which = if placement.len() > 1 {
                format!(" (replica {i} of {})", placement.len())
            } else {
                String::new()
            };
            let desc = descriptor(m, primary, devices);
            match plugin.load_model(&desc) {
                Ok(x) => loaded.push(x),
                Err(e) if matches!(e.status, Status::OomRam | Status::OomVram) => {
                    // The engine refused and freed what it had (no partial loads).
                    let pool = if e.status == Status::OomVram {
                        Pool::Vram
                    } else {
                        Pool::Ram
                    };
                    let message = format!(
                        "{}: the engine refused model `{}`{which}: {}",
                        e.status, m.config.id, e.message
                    );
                    return Err(BuildError::Refused(Refusal {
                        pool,
                        message,
                        never_fits: false,
                    }));
                }
                Err(e) => {
                    tracing::error!(model = %m.config.id, error = %e, "model load failed{which}");
                    return Err(BuildError::Failed(format!("load failed{which}: {e}")));
                }
            }
        }
        let load_s = t0.elapsed().as_secs_f64();
        self.metrics
            .model_load_seconds
            .with_label_values(&[&m.config.id])
            .set(load_s);
        let Some((shared, _)) = loaded.first() else {
            return Err(BuildError::Failed("load failed: no replica".into()));
        };
        let shared = shared.clone();
        let info = shared.info().clone();
        let model_dir = primary.parent().unwrap_or(Path::new("."));
        let template = choose_template(&m.config, &info, model_dir)
            .map_err(|e| BuildError::Failed(format!("chat template: {e}")))?;
        if template.source() == TemplateSource::DefaultChatml && info.supports_completion() {
            tracing::warn!(model = %m.config.id, "the model has no chat template; using the default ChatML template");
        }
        let tokenizer = Tokenizer::for_model(model_dir, shared.clone())
            .map_err(|e| BuildError::Failed(format!("tokenizer: {e}")))?;
        let mut drafts = self.load_drafts(m, &shared, placement);
        let sched = &self.config.scheduler;
        let drafting = drafts.as_ref().is_none_or(|d| !d.instances.is_empty());
        let settings = SchedulerSettings {
            prefill_chunk_tokens: sched.prefill_chunk_tokens as usize,
            step_timeout: std::time::Duration::from_secs(sched.step_timeout_seconds.max(1)),
            speculation: match drafting {
                true => speculation(&m.config.speculation),
                false => crate::scheduler::draft::Speculation::OFF,
            },
        };
        let draft_status = drafts.as_ref().map(|d| d.status());
        let mut draft_instances = drafts
            .as_mut()
            .map(|d| std::mem::take(&mut d.instances))
            .unwrap_or_default()
            .into_iter();
        let capacities: Vec<u64> = loaded
            .iter()
            .map(|(s, _)| s.info().kv_capacity_tokens)
            .collect();
        let figures = ModelFigures::new(&capacities);
        // Requests a worker crash interrupts before their first token go back to the node.
        let requeue: Option<crate::scheduler::Requeue> = self.me.get().cloned().map(|node| {
            let f: crate::scheduler::Requeue = Arc::new(move |jobs, crash| {
                if let Some(n) = node.upgrade() {
                    n.requeue(jobs, crash);
                }
            });
            f
        });
        let watch = crate::scheduler::Watch {
            hung: self.hung.clone(),
            requeue,
        };
        let mut replicas = Vec::with_capacity(loaded.len());
        for (i, (rep_shared, exec)) in loaded.into_iter().enumerate() {
            let (draft_shared, draft) = match draft_instances.next() {
                Some((s, e)) => (
                    Some(s),
                    Some(crate::scheduler::DraftModel::new(Box::new(PluginEngine(e)))),
                ),
                None => (None, None),
            };
            let scheduler = crate::scheduler::spawn(
                PluginEngine(exec),
                draft,
                self.metrics.for_model(&m.config.id),
                settings.clone(),
                watch.clone(),
                figures.clone(),
                i,
            )
            .map_err(|e| BuildError::Failed(format!("cannot start the scheduler: {e}")))?;
            replicas.push(EngineReplica {
                scheduler,
                shared: rep_shared,
                draft: draft_shared,
            });
        }
        let scheduler = EngineReplicas::new(replicas, figures)
            .map_err(|e| BuildError::Failed(format!("load failed: {e}")))?;
        tracing::info!(model = %m.config.id, plugin = %plugin_id, version = %plugin.info().engine_version, load_s, replicas = scheduler.len(), ctx = info.context_length, kv = scheduler.figures.kv_capacity, template = template.source().as_str(), "model ready");
        let vocabulary = Arc::new(crate::constraint::Vocabulary::new(shared.clone()));
        if shared.supports_token_mask() && info.supports_completion() {
            // Build the constrained-decoding vocabulary now, off the request path, so the
            // first structured-output request does not wait for it.
            let v = vocabulary.clone();
            let _ = std::thread::Builder::new()
                .name(format!("vocab-{}", m.config.id))
                .spawn(move || v.compiler().map(drop));
        }
        Ok(Arc::new(ReadyModel {
            shared,
            scheduler,
            template,
            tokenizer,
            plugin: plugin_id.to_string(),
            vocabulary,
            draft: draft_status,
        }))
    }
}

/// What a plugin is asked to load for `m` on `devices`.
pub(super) fn descriptor(m: &ServedModel, primary: &Path, devices: &[u32]) -> ModelDescriptor {
    ModelDescriptor {
        model_id: m.config.id.clone(),
        model_dir: primary.parent().unwrap_or(Path::new(".")).to_path_buf(),
        primary_file: primary.to_path_buf(),
        format: m.format,
        quantization: m
            .fetched
            .get()
            .and_then(|f| f.quantization.clone())
            .or_else(|| m.config.quantization.clone()),
        mmproj: m.fetched.get().and_then(|f| f.mmproj.clone()),
        context_length: m.config.context_length.unwrap_or(0),
        max_sequences: m.config.max_batch_size.unwrap_or(DEFAULT_MAX_BATCH),
        device_ids: devices.iter().map(|d| *d as i32).collect(),
        n_threads: m.config.threads.unwrap_or(0),
    }
}

/// Why [`Node::build_ready`] gave no ready model.
#[derive(Debug)]
pub(crate) enum BuildError {
    /// The engine refused it for memory (507 with the pool's code).
    Refused(Refusal),
    Failed(String),
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

/// A model's speculation settings as its scheduler takes them.
fn speculation(c: &gantry_api::config::SpeculationConfig) -> crate::scheduler::draft::Speculation {
    use gantry_api::config::SpeculationMethod;
    match c.method {
        SpeculationMethod::Off => crate::scheduler::draft::Speculation::OFF,
        SpeculationMethod::PromptLookup | SpeculationMethod::DraftModel => {
            crate::scheduler::draft::Speculation {
                draft_tokens: c.draft_tokens() as usize,
                ngram_min: c.ngram_min as usize,
                ngram_max: c.ngram_max as usize,
                max_batch: c.max_batch as usize,
                adaptive: c.adaptive && c.method == SpeculationMethod::PromptLookup,
            }
        }
    }
}
