//! Node state, plugin updates (beside the lifecycle; entered from a polling thread, never
//! from a request): a plugin library that changed on disk is put in force by shadow load,
//! with no downtime.
//!
//! For a plugin in `process` isolation: the new version is checked in a probe worker
//! (`EngineRegistry::refresh`), then every model it serves is loaded again on the new
//! version in new workers, beside the old ones, and checked with a short warm-up
//! generation. Only when every model passed are they switched: new requests go to the new
//! instances; requests in flight keep the old ready model (they hold it) and finish on the
//! old workers, which are stopped when the last of them ends. A version that fails its
//! checks, a load or a warm-up is refused with the reason, and the old one keeps serving.
//! An in-process plugin cannot be replaced in a running process: its change is reported as
//! needing a restart.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_api::PluginUpdate;
use gantry_engine_abi::Sampling;

use super::lifecycle::BuildError;
use super::{ModelState, Node, ReadyModel, ServedModel};
use crate::engine_host::{ChangeKind, Plugin};
use crate::scheduler::{FinishReason, GenEvent, GenerateJob, Job};

/// How long a warm-up generation may take.
pub const WARM_UP_LIMIT: Duration = Duration::from_secs(60);

impl Node {
    /// Check the plugin tree every `every` (a blocking thread; `None`: never).
    pub fn spawn_plugin_watch(self: &Arc<Self>, every: Option<Duration>) {
        let Some(every) = every else { return };
        let node = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("plugin-watch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(every);
                    let Some(n) = node.upgrade() else { return };
                    n.check_plugins();
                }
            });
    }

    /// Apply what changed in the plugin tree since the registry read it.
    pub fn check_plugins(self: &Arc<Self>) {
        let Some(old) = self.registry_now() else {
            return;
        };
        if !old.changed_on_disk() {
            return;
        }
        let _serial = self.reload_lock.lock().unwrap_or_else(|p| p.into_inner());
        let (mut new, changes) = old.refresh(&self.engine_config, &self.host_settings());
        for change in changes {
            let update = |state: &str, message: String, models: Vec<String>| PluginUpdate {
                version: change.version.clone(),
                state: state.into(),
                message,
                models,
                seconds_ago: 0,
            };
            let record = match &change.kind {
                ChangeKind::Added => continue,
                ChangeKind::RestartRequired => {
                    let msg = format!(
                        "plugin `{}` changed on disk; it runs in-process, so the new version loads at the next restart",
                        change.id
                    );
                    tracing::warn!(target: "gantry::alert", plugin = %change.id, "{msg}");
                    update("restartRequired", msg, Vec::new())
                }
                ChangeKind::Refused(why) => {
                    tracing::error!(target: "gantry::alert", plugin = %change.id, version = ?change.version, "plugin update refused; the old version keeps serving: {why}");
                    update(
                        "refused",
                        format!("the new version was refused: {why}"),
                        Vec::new(),
                    )
                }
                ChangeKind::Loaded => {
                    let Some(plugin) = new.plugin(&change.id).cloned() else {
                        continue;
                    };
                    match self.shadow_all(&change.id, &plugin) {
                        Ok(models) => {
                            tracing::info!(plugin = %change.id, version = ?change.version, models = ?models, "plugin updated by shadow load");
                            update(
                                "applied",
                                format!(
                                    "{} model(s) switched to the new version with no downtime",
                                    models.len()
                                ),
                                models,
                            )
                        }
                        Err(why) => {
                            tracing::error!(target: "gantry::alert", plugin = %change.id, version = ?change.version, "plugin update refused; the old version keeps serving: {why}");
                            new.keep_old(&change.id, &old);
                            update(
                                "refused",
                                format!("the new version was refused: {why}"),
                                Vec::new(),
                            )
                        }
                    }
                }
            };
            self.plugin_updates
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(change.id.clone(), (record, Instant::now()));
        }
        self.set_registry(Arc::new(new));
    }

    /// Load every ready model of plugin `id` again on `plugin`, warm each up, then switch
    /// them all. First, room for the second copies under the memory budget (or a refusal);
    /// on any failure none is switched (the new instances are dropped, which stops
    /// their workers). The ids of the models switched.
    fn shadow_all(&self, id: &str, plugin: &Plugin) -> Result<Vec<String>, String> {
        let targets: Vec<(Arc<ServedModel>, Arc<ReadyModel>)> = self
            .models()
            .values()
            .filter(|m| !m.is_retired())
            .filter_map(|m| m.ready().filter(|r| r.plugin == id).map(|r| (m.clone(), r)))
            .collect();
        self.make_room_for_shadow(id, &targets)?;
        let mut staged = Vec::with_capacity(targets.len());
        for (m, old) in targets {
            let fresh = self
                .shadow_one(&m, id, plugin)
                .map_err(|e| format!("model `{}`: {e}", m.config.id))?;
            staged.push((m, old, fresh));
        }
        let mut switched = Vec::new();
        for (m, old, fresh) in staged {
            let _serial = m.load_lock.lock().unwrap_or_else(|p| p.into_inner());
            // Switch only what is still the instance we shadowed (not unloaded or crashed).
            if m.ready().is_some_and(|r| Arc::ptr_eq(&r, &old)) {
                m.set(ModelState::Ready(fresh));
                switched.push(m.config.id.clone());
            }
        }
        Ok(switched)
    }

    /// A second instance of `m` on `plugin`, warmed up.
    fn shadow_one(
        &self,
        m: &ServedModel,
        id: &str,
        plugin: &Plugin,
    ) -> Result<Arc<ReadyModel>, String> {
        let primary = m
            .primary
            .read()
            .ok()
            .and_then(|p| p.clone())
            .ok_or("no artifact")?;
        let mut placement = m.placement.read().map(|p| p.clone()).unwrap_or_default();
        if placement.is_empty() {
            placement = vec![Vec::new(); m.replicas() as usize];
        }
        let ready = match self.build_ready(m, id, plugin, &primary, &placement) {
            Ok(r) => r,
            Err(BuildError::Refused(r)) => return Err(format!("load refused: {}", r.message)),
            Err(BuildError::Failed(why)) => return Err(why),
        };
        warm_up(&ready)?;
        Ok(ready)
    }
}

/// A short greedy generation on every replica of `ready`: the new version must produce
/// tokens before it takes traffic (a speech recognition model: of a second of silence, from
/// its start token).
pub fn warm_up(ready: &ReadyModel) -> Result<(), String> {
    let info = ready.shared.info();
    let (prompt, audio) = if info.supports_transcription() {
        let sot = ready
            .shared
            .tokenize("<|startoftranscript|>", false, true)
            .map_err(|e| format!("warm-up tokenize: {e}"))?;
        let second = vec![0.0f32; info.audio_sample_rate as usize];
        (sot, Some(std::sync::Arc::new(second)))
    } else {
        let prompt = ready
            .tokenizer
            .encode_prompt("Hello", info)
            .map_err(|e| format!("warm-up tokenize: {e:?}"))?;
        (prompt, None)
    };
    let mut waiting = Vec::new();
    for _ in 0..ready.scheduler.len() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = GenerateJob {
            prompt: prompt.clone(),
            max_tokens: 4,
            sampling: Sampling::greedy(),
            stop: Vec::new(),
            logprobs: None,
            deadline: Some(Instant::now() + WARM_UP_LIMIT),
            fresh: true,
            grammar: None,
            arrived: Instant::now(),
            events: tx,
            retried: true,
            forks: Vec::new(),
            speculate: true,
            adapter: None,
            audio: audio.clone(),
            align: false,
            probe: None,
        };
        ready
            .scheduler
            .submit(Job::Generate(job))
            .map_err(|e| format!("warm-up: {e}"))?;
        waiting.push(rx);
    }
    let deadline = Instant::now() + WARM_UP_LIMIT;
    for mut rx in waiting {
        loop {
            match rx.try_recv() {
                Ok(GenEvent::Done {
                    reason,
                    completion_tokens,
                    ..
                }) => {
                    if completion_tokens == 0
                        || matches!(reason, FinishReason::Deadline | FinishReason::QueueTimeout)
                    {
                        return Err(format!(
                            "warm-up generated {completion_tokens} token(s) ({})",
                            reason.label()
                        ));
                    }
                    break;
                }
                Ok(GenEvent::Error(e)) => return Err(format!("warm-up failed: {e}")),
                Ok(
                    GenEvent::Token { .. }
                    | GenEvent::Times(_)
                    | GenEvent::Probe(_)
                    | GenEvent::StopLogprob(_),
                ) => {}
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    return Err("warm-up: the scheduler stopped".into());
                }
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                    if Instant::now() > deadline {
                        return Err(format!(
                            "warm-up took longer than {} s",
                            WARM_UP_LIMIT.as_secs()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
    }
    Ok(())
}
