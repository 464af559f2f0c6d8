//! Node state, config reload (beside the request path; it replaces the model map that
//! `ready_model` reads): a new node config → the models it lists, without a restart.
//!
//! [`Node::reload`] validates the new config, diffs its models with the running ones by id
//! ([`ModelDiff`]) and swaps in the new map at once:
//! - an unchanged model keeps running untouched (the same `ServedModel`);
//! - an added model is made as at start and started like one (inspect, fetch, eager load);
//! - a removed model is unknown from then on (404 `model_not_found`, gone from `/v1/models`
//!   and `/v1/status`) but keeps its engine until no request holds it, so the streams it is
//!   running finish; then it is unloaded through the memory policy's unload, and its
//!   response-cache answers and gauges are dropped;
//! - a changed model is a removal and an addition: the new one is in the map at once (503
//!   while it comes up) and starts once the old one is unloaded, so the two never hold
//!   memory together;
//! - a model whose adapter list alone changed, by adapters added or removed (none of the same
//!   name edited), keeps running: the new adapters are fetched and loaded beside it, a removed
//!   one answers 404 at once and leaves the engine once no request holds it.
//!
//! "No request holds it" is the memory policy's idle test: no reference to the ready model
//! but the state's (a request holds one from admission to its last event) and nothing queued
//! or running in its schedulers. A drain waits at most [`Node::drain_bound`]; past it the
//! model is unloaded anyway — its running streams still finish, since a scheduler ends only
//! after its running sequences, but the policy stops counting its memory.
//!
//! Node-wide settings (`scheduler`, `cacheDir`) cannot change under running schedulers: a
//! change is logged, listed in `/v1/status` `restartRequired`, and the old values stay.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gantry_api::config::{ConfigError, ModelConfig, NodeConfig};

use super::{ModelMap, ModelState, Node, ServedModel};

/// How often a drain checks whether its model is idle.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// How the models of a new config differ from the running ones, by id (each list sorted).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelDiff {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Same id, another `ModelConfig`: retired and made again.
    pub changed: Vec<String>,
    /// Same id, only adapters added or removed: the model keeps running ([`adapters_in_place`]).
    pub adapters_changed: Vec<String>,
    pub unchanged: Vec<String>,
}

/// Whether `new` differs from `old` only by adapters added to or removed from its list, which a
/// reload applies without touching the loaded model. An adapter whose entry changed under the
/// same name is not: the engines know adapters by name, so the model is made again.
pub fn adapters_in_place(old: &ModelConfig, new: &ModelConfig) -> bool {
    let bare = |c: &ModelConfig| ModelConfig {
        adapters: Vec::new(),
        ..c.clone()
    };
    old != new
        && bare(old) == bare(new)
        && new.adapters.iter().all(|a| {
            old.adapters
                .iter()
                .find(|o| o.name == a.name)
                .is_none_or(|o| o == a)
        })
}

impl ModelDiff {
    pub fn between<'a>(
        old: impl IntoIterator<Item = &'a ModelConfig>,
        new: &[ModelConfig],
    ) -> Self {
        let old: BTreeMap<&str, &ModelConfig> =
            old.into_iter().map(|m| (m.id.as_str(), m)).collect();
        let mut d = ModelDiff::default();
        for m in new {
            match old.get(m.id.as_str()) {
                None => d.added.push(m.id.clone()),
                Some(o) if *o == m => d.unchanged.push(m.id.clone()),
                Some(o) if adapters_in_place(o, m) => d.adapters_changed.push(m.id.clone()),
                Some(_) => d.changed.push(m.id.clone()),
            }
        }
        d.removed = old
            .keys()
            .filter(|id| !new.iter().any(|m| m.id == **id))
            .map(|id| id.to_string())
            .collect();
        for l in [
            &mut d.added,
            &mut d.changed,
            &mut d.adapters_changed,
            &mut d.unchanged,
        ] {
            l.sort();
        }
        d
    }

    /// Whether the model list is the same.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
            && self.adapters_changed.is_empty()
    }
}

/// The node-wide settings (everything but `models`) that differ between `old` and `new`, as
/// dotted camelCase paths (`cacheDir`, `scheduler.requestTimeoutSeconds`).
pub fn node_wide_changes(old: &NodeConfig, new: &NodeConfig) -> Vec<String> {
    // Destructured so that a new node-wide field does not compile until it is compared here.
    let NodeConfig {
        models: _,
        cache_dir,
        scheduler,
        isolation,
    } = new;
    let mut out = Vec::new();
    if *cache_dir != old.cache_dir {
        out.push("cacheDir".to_string());
    }
    // Plugins are opened once, in the mode they start in.
    if *isolation != old.isolation {
        out.push("isolation".to_string());
    }
    // Every scheduler field by its YAML name; the struct always serializes all of them.
    let fields = |s| match serde_json::to_value(s) {
        Ok(serde_json::Value::Object(o)) => o,
        _ => serde_json::Map::new(),
    };
    let (was, now) = (fields(&old.scheduler), fields(scheduler));
    for (k, v) in &now {
        if was.get(k) != Some(v) {
            out.push(format!("scheduler.{k}"));
        }
    }
    out
}

/// Why a reload was refused; the old config keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// Unreadable, not YAML, or against the config rules.
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("no async runtime to start and drain models on")]
    NoRuntime,
}

/// What an applied reload did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReloadReport {
    pub diff: ModelDiff,
    /// Node-wide settings the new config changes that wait for a restart.
    pub restart_required: Vec<String>,
}

impl Node {
    /// Serve the models of `new` (a whole node config, flags applied) from now on; `hash`
    /// names the file it came from (`/v1/status` `configHash`). Refused, with the reason
    /// logged and counted, when `new` is invalid: nothing changes then. Call it from the async
    /// runtime: added models start and removed ones drain in its background tasks.
    pub fn reload(
        self: &Arc<Self>,
        new: NodeConfig,
        hash: Option<String>,
    ) -> Result<ReloadReport, ReloadError> {
        let _serial = self.reload_lock.lock().unwrap_or_else(|p| p.into_inner());
        let checked = new.validate().map_err(ReloadError::from).and_then(|()| {
            tokio::runtime::Handle::try_current().map_err(|_| ReloadError::NoRuntime)
        });
        let rt = match checked {
            Ok(rt) => rt,
            Err(e) => {
                self.refuse_reload(&e);
                return Err(e);
            }
        };
        let old = self.models();
        // What each model runs now: its adapter list may have changed in place since.
        let live: BTreeMap<String, ModelConfig> = old
            .iter()
            .map(|(id, m)| (id.clone(), m.live_config()))
            .collect();
        let diff = ModelDiff::between(live.values(), &new.models);
        let mut restart_required = node_wide_changes(&self.config, &new);
        if new.models.iter().any(|m| m.downloads())
            && self.store.get().is_none()
            && let Some(setup) = &self.store_setup
        {
            match setup.store_for(&new) {
                Ok(store) => {
                    let _ = self.store.set(store);
                    // The first store is made from this file's `cacheDir`: it is in force.
                    restart_required.retain(|f| f != "cacheDir");
                }
                // The remote models then fail with "no model store" in their status.
                Err(e) => {
                    tracing::error!(target: "gantry::alert", "cannot make the model store for the config's remote models: {e}")
                }
            }
        }

        // The new map: unchanged models as they are, the others made afresh.
        let mut next = ModelMap::new();
        let mut fresh = Vec::new();
        let mut retargeted = Vec::new();
        // The diff's lists are sorted.
        let listed = |l: &[String], id: &String| l.binary_search(id).is_ok();
        for cfg in &new.models {
            match old.get(&cfg.id) {
                Some(m) if listed(&diff.unchanged, &cfg.id) => {
                    next.insert(cfg.id.clone(), m.clone());
                }
                Some(m) if listed(&diff.adapters_changed, &cfg.id) => {
                    next.insert(cfg.id.clone(), m.clone());
                    retargeted.push((m.clone(), cfg.adapters.clone()));
                }
                replaced => {
                    let m = Arc::new(ServedModel::new(cfg, false));
                    next.insert(cfg.id.clone(), m.clone());
                    fresh.push((m, replaced.cloned()));
                }
            }
        }
        let removed: Vec<Arc<ServedModel>> = old
            .values()
            .filter(|m| !next.contains_key(&m.config.id))
            .cloned()
            .collect();
        // Retire before the swap, so the memory policy counts them throughout.
        for m in removed
            .iter()
            .chain(fresh.iter().filter_map(|(_, r)| r.as_ref()))
        {
            m.retired.store(true, Ordering::SeqCst);
            if let Ok(mut r) = self.retiring.lock() {
                r.push(m.clone());
            }
        }
        *self.models.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
        *self.config_hash.write().unwrap_or_else(|p| p.into_inner()) = hash.clone();
        *self
            .restart_required
            .write()
            .unwrap_or_else(|p| p.into_inner()) = restart_required.clone();

        for (m, replaced) in fresh {
            match replaced {
                Some(old) => self.spawn_drain(&rt, old, Some(m)),
                None => {
                    let node = self.clone();
                    rt.spawn_blocking(move || node.start_model(&m));
                }
            }
        }
        for m in removed {
            self.spawn_drain(&rt, m, None);
        }
        for (m, adapters) in retargeted {
            let gone = m.swap_adapters(&adapters);
            self.fetch_adapters(&m);
            self.warm_adapters(&m);
            self.spawn_adapter_drain(&rt, &m, gone);
        }
        if !restart_required.is_empty() {
            tracing::warn!(target: "gantry::alert", fields = ?restart_required, "the config changes node-wide settings that apply only at the next start; the node keeps the values it started with");
        }
        tracing::info!(hash = hash.as_deref().unwrap_or("-"), added = ?diff.added, removed = ?diff.removed, changed = ?diff.changed, adapters_changed = ?diff.adapters_changed, unchanged = diff.unchanged.len(), "config reloaded");
        self.metrics
            .config_reloads
            .with_label_values(&["applied"])
            .inc();
        Ok(ReloadReport {
            diff,
            restart_required,
        })
    }

    /// Log and count a refused reload (the caller could not read or parse the file, or
    /// `reload` found it invalid); the running config stays.
    pub fn refuse_reload(&self, e: &ReloadError) {
        tracing::error!(target: "gantry::alert", "config reload refused, the running config stays: {e}");
        self.metrics
            .config_reloads
            .with_label_values(&["refused"])
            .inc();
    }

    /// The hash of the config file in force (`/v1/status` `configHash`).
    pub fn config_hash(&self) -> Option<String> {
        self.config_hash.read().ok().and_then(|h| h.clone())
    }

    /// Name the config file the node starts with.
    pub fn with_config_hash(self, hash: Option<String>) -> Self {
        *self.config_hash.write().unwrap_or_else(|p| p.into_inner()) = hash;
        self
    }

    /// Node-wide settings the running config file changed that wait for a restart.
    /// Also each in-process plugin whose library changed on disk (`plugin <id>`).
    pub fn restart_required(&self) -> Vec<String> {
        let mut out = self
            .restart_required
            .read()
            .map(|r| r.clone())
            .unwrap_or_default();
        let updates = self
            .plugin_updates
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        out.extend(
            updates
                .iter()
                .filter(|(_, (u, _))| u.state == "restartRequired")
                .map(|(id, _)| format!("plugin {id}")),
        );
        out
    }

    /// The longest a drain waits for `m`'s requests: the longer of its default request
    /// deadline and the node's SIGTERM grace, the same patience a stopping node has.
    pub fn drain_bound(&self, m: &ServedModel) -> Duration {
        let sched = &self.config.scheduler;
        m.config
            .request_timeout(sched)
            .unwrap_or_default()
            .max(Duration::from_secs(sched.shutdown_grace_seconds))
    }

    /// In the background: wait until no request holds the retired `old` (bounded), unload it,
    /// stop counting it, then start `next`, the model that replaces it, if any.
    fn spawn_drain(
        self: &Arc<Self>,
        rt: &tokio::runtime::Handle,
        old: Arc<ServedModel>,
        next: Option<Arc<ServedModel>>,
    ) {
        let node = self.clone();
        let bound = self.drain_bound(&old);
        let reason = if next.is_some() {
            "config_changed"
        } else {
            "config_removed"
        };
        rt.spawn(async move {
            let t0 = Instant::now();
            loop {
                let forced = t0.elapsed() >= bound;
                if forced || node.drained(&old) {
                    let (n, m) = (node.clone(), old.clone());
                    let done =
                        tokio::task::spawn_blocking(move || n.unload_retired(&m, reason, forced))
                            .await
                            .unwrap_or(true);
                    if done {
                        break;
                    }
                }
                tokio::time::sleep(DRAIN_POLL).await;
            }
            let id = old.config.id.clone();
            if let Ok(mut r) = node.retiring.lock() {
                r.retain(|m| !Arc::ptr_eq(m, &old));
            }
            // No request of the old model can store an answer any more (unless the drain was
            // forced), and the replacement takes none before it starts below.
            node.cache.forget_model(&id);
            {
                // Under the reload lock: no reload can bring the id back in between.
                let _serial = node.reload_lock.lock().unwrap_or_else(|p| p.into_inner());
                if node.model(&id).is_none() {
                    node.metrics.forget_model(&id);
                }
            }
            node.update_memory_gauges();
            if let Some(m) = next {
                let _ = tokio::task::spawn_blocking(move || node.start_model(&m)).await;
            }
        });
    }

    /// No load of the retired `m` is under way and, when loaded, no request holds it.
    fn drained(&self, m: &ServedModel) -> bool {
        let Ok(state) = m.state.read() else {
            return false;
        };
        match &*state {
            ModelState::Loading => false,
            ModelState::Ready(r) => crate::memory::is_idle(r),
            _ => true,
        }
    }

    /// Unload the retired `m` if it is loaded and idle (or `forced`); `true` once nothing
    /// is left to wait for. Blocking: it waits out nothing, but dropping the engine may take
    /// a while.
    fn unload_retired(&self, m: &ServedModel, reason: &str, forced: bool) -> bool {
        // A load under way finishes first (it holds this lock; `load` checks `retired` under
        // it, so none starts after).
        let _serial = match m.load_lock.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        if !matches!(m.state(), ModelState::Ready(_)) {
            return true;
        }
        let id = m.config.id.as_str();
        let why = if reason == "config_changed" {
            "its config changed"
        } else {
            "it left the config"
        };
        self.unload(m, reason, forced, |held| {
            let freed = crate::memory::human(held.vram.max(held.ram));
            if forced {
                tracing::warn!(target: "gantry::alert", model = %id, "model unloaded: {why}; requests still held it after the drain bound, so their streams finish on the engine while the memory policy no longer counts its {freed}");
            } else {
                tracing::info!(model = %id, "model unloaded: {why} and its last request finished ({freed} freed)");
            }
            format!("unloaded: {why}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_api::config::LoadPolicy;

    fn model(id: &str, ctx: u32) -> ModelConfig {
        ModelConfig {
            id: id.into(),
            path: Some(format!("/m/{id}.gguf").into()),
            format: "gguf".into(),
            context_length: Some(ctx),
            ..ModelConfig::default()
        }
    }

    #[test]
    fn models_are_added_removed_changed_or_unchanged_by_id() {
        let old = [model("a", 512), model("b", 512), model("c", 512)];
        let mut lazy_c = model("c", 512);
        lazy_c.load = LoadPolicy::Lazy;
        let new = [model("d", 512), model("a", 512), lazy_c, model("e", 1024)];
        let d = ModelDiff::between(&old, &new);
        assert_eq!(
            d,
            ModelDiff {
                added: vec!["d".into(), "e".into()],
                removed: vec!["b".into()],
                changed: vec!["c".into()],
                adapters_changed: Vec::new(),
                unchanged: vec!["a".into()],
            }
        );
        assert!(!d.is_empty());
        let same = ModelDiff::between(&old, &old);
        assert!(same.is_empty());
        assert_eq!(same.unchanged, ["a", "b", "c"]);
        let none = ModelDiff::between(&old, &[]);
        assert_eq!(none.removed, ["a", "b", "c"]);
    }

    #[test]
    fn adapters_added_or_removed_change_a_model_in_place_and_an_edited_one_remakes_it() {
        let adapter = |name: &str, scale: f32| gantry_api::config::AdapterConfig {
            name: name.into(),
            path: Some(format!("/a/{name}.gguf").into()),
            source: None,
            files: Vec::new(),
            scale: Some(scale),
            served_name: None,
        };
        let with = |adapters: Vec<gantry_api::config::AdapterConfig>| ModelConfig {
            adapters,
            ..model("m", 512)
        };
        let old = with(vec![adapter("p", 1.0), adapter("f", 1.0)]);
        let added = with(vec![
            adapter("p", 1.0),
            adapter("f", 1.0),
            adapter("n", 1.0),
        ]);
        let removed = with(vec![adapter("f", 1.0)]);
        let edited = with(vec![adapter("p", 0.5), adapter("f", 1.0)]);
        let mut other_base = removed.clone();
        other_base.context_length = Some(1024);
        assert!(adapters_in_place(&old, &added));
        assert!(adapters_in_place(&old, &removed));
        assert!(!adapters_in_place(&old, &old), "nothing changed");
        assert!(
            !adapters_in_place(&old, &edited),
            "`p` changed under its name"
        );
        assert!(
            !adapters_in_place(&old, &other_base),
            "the base changed too"
        );
        let d = ModelDiff::between(&[old], &[added]);
        assert_eq!(
            (d.adapters_changed, d.changed),
            (vec!["m".to_string()], vec![])
        );
    }

    #[test]
    fn node_wide_changes_are_named_by_their_yaml_paths() {
        let old = NodeConfig {
            models: vec![model("a", 512)],
            ..NodeConfig::default()
        };
        let mut new = NodeConfig {
            models: vec![model("b", 512)],
            ..NodeConfig::default()
        };
        assert!(
            node_wide_changes(&old, &new).is_empty(),
            "models are not node-wide"
        );
        new.cache_dir = Some("/cache".into());
        new.scheduler.request_timeout_seconds = 5;
        new.scheduler.response_cache_ram_fraction = 0.0;
        assert_eq!(
            node_wide_changes(&old, &new),
            [
                "cacheDir",
                "scheduler.requestTimeoutSeconds",
                "scheduler.responseCacheRamFraction"
            ]
        );
    }
}
