//! Node state, status (beside the request path): what `/readyz`, `/healthz` and `/v1/status`
//! report about the node, its plugins and every model.

use std::sync::atomic::Ordering;

use gantry_api::{
    ArtifactState, ArtifactStatus, LoadState, LoadStatus, ModelStatus, NodeStatus, PluginStatus,
    QueueStatus, ReplicaStatus,
};

use super::{ModelState, Node, ServedModel};
use crate::engine_host::PluginState;
use crate::memory::Note;
use gantry_api::config::LoadPolicy;

impl Node {
    /// `/readyz`: every model has a supporting engine and its artifacts, and
    /// eager models are loaded; never while draining. Models a reload added do not count
    /// (their state is in `/v1/status`): a new model does not take readiness from a node
    /// that serves the others.
    pub fn is_ready(&self) -> bool {
        if self.draining.load(Ordering::SeqCst) || self.registry_now().is_none() {
            return false;
        }
        let models = self.models();
        models
            .values()
            .filter(|m| m.gates_readiness)
            .all(|m| match m.state() {
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
        let updates = self
            .plugin_updates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let now = std::time::Instant::now();
        let plugins = self
            .registry_now()
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
                            id: s.id.clone(),
                            version: s.version,
                            abi_version: s.abi_version,
                            gpu_backend: s.gpu_backend,
                            build_info: s.build_info,
                            loaded: r.plugin().is_some(),
                            isolation: s.isolation.to_string(),
                            reason,
                            message,
                            update: updates.get(&s.id).map(|(u, at)| gantry_api::PluginUpdate {
                                seconds_ago: now.duration_since(*at).as_secs(),
                                ..u.clone()
                            }),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let served = self.models();
        let models = served.values().map(|m| self.model_status(m)).collect();
        let placed: std::collections::BTreeMap<String, Vec<u32>> = served
            .values()
            .filter(|m| m.ready().is_some())
            .filter_map(|m| {
                let p = m.devices();
                (!p.is_empty()).then(|| (m.config.id.clone(), p))
            })
            .collect();
        let snap = self.devices.snapshot().with_models(&placed);
        NodeStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            backend: self.engine_config.backend.as_str().to_string(),
            ready: self.is_ready(),
            draining: self.draining.load(Ordering::SeqCst),
            plugins,
            models,
            devices: snap.devices,
            devices_note: snap.note,
            memory: Some(self.memory_status()),
            config_hash: self.config_hash(),
            restart_required: self.restart_required(),
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
        let (plugin, bytes_used, queue, replicas, per_sequence) = match &state {
            ModelState::Ready(r) => {
                let f = &r.scheduler.figures;
                // Recurrent state per sequence (ABI 1.7), the same in every replica.
                let per_sequence = r
                    .scheduler
                    .iter()
                    .next()
                    .map(|rep| rep.shared.info().recurrent_state_bytes)
                    .filter(|&b| b > 0);
                let held = |running: u64| per_sequence.map(|b| b * running);
                let placement = m.placement.read().map(|p| p.clone()).unwrap_or_default();
                let replicas = r
                    .scheduler
                    .iter()
                    .enumerate()
                    .map(|(i, rep)| {
                        let g = &rep.scheduler.figures;
                        let running = g.running.load(Ordering::Relaxed);
                        ReplicaStatus {
                            index: i as u32,
                            devices: placement.get(i).cloned().unwrap_or_default(),
                            bytes_used: rep.shared.info().bytes_used,
                            worker_pid: rep.shared.worker_pid(),
                            queue: QueueStatus {
                                waiting: g.waiting.load(Ordering::Relaxed),
                                running,
                                kv_capacity_tokens: rep.scheduler.kv_capacity,
                                kv_used_tokens: g.kv_used.load(Ordering::Relaxed),
                                recurrent_state_bytes: held(running),
                            },
                        }
                    })
                    .collect();
                (
                    Some(r.plugin.clone()),
                    r.scheduler.bytes_used(),
                    QueueStatus {
                        waiting: f.waiting(),
                        running: f.running(),
                        kv_capacity_tokens: f.kv_capacity,
                        kv_used_tokens: f.kv_used(),
                        recurrent_state_bytes: held(f.running()),
                    },
                    replicas,
                    per_sequence,
                )
            }
            _ => (None, 0, QueueStatus::default(), Vec::new(), None),
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
                // Why the artifact cannot be used (a corrupt or unreadable file), for
                // `/v1/status` readers such as the operator, not only the log.
                message: match &state {
                    ModelState::Failed(why) => Some(why.clone()),
                    _ => None,
                },
            }),
            load: LoadStatus {
                state: load_state,
                plugin,
                message,
                bytes_used,
                measured_vram_bytes: match m.measured_vram.load(Ordering::Relaxed) {
                    0 => None,
                    b => Some(b),
                },
                recurrent_state_bytes_per_sequence: per_sequence,
            },
            queue,
            devices: if matches!(state, ModelState::Ready(_)) {
                m.devices()
            } else {
                Vec::new()
            },
            replicas,
            crashes: m
                .crashes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .status(std::time::Instant::now()),
            engine_choice: m.engine_choice.read().ok().and_then(|c| c.clone()),
            adapters: m.adapter_statuses(),
            draft: match &state {
                ModelState::Ready(r) => r.draft.clone(),
                _ => None,
            },
        }
    }
}
