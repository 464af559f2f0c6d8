//! Node state, memory policy applied (before and after every model load): last use,
//! estimates, unloads and refusals.
//!
//! The decisions are memory.rs's pure functions over a snapshot of the
//! resident models; this is the node's side, which takes the snapshot and
//! carries the decisions out.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gantry_engine_abi::Format;

use super::{Bytes, Limits, NodeMemory, Note, Pool, Refusal, Resident, Unload};
use crate::node::{DEFAULT_MAX_BATCH, ModelState, Node, ReadyModel, ServedModel};
use gantry_api::config::LoadPolicy;

/// The memory policy's side of the node (the decisions are memory.rs's pure
/// functions): last use, estimates, unloads and refusals.
impl Node {
    /// Replace the RAM budget: `bytes`, or when 0 the cgroup limit, else MemTotal.
    pub fn with_ram_limit(mut self, bytes: u64) -> Self {
        self.memory = NodeMemory::new(
            self.engine_config.backend,
            self.engine_config.vram_limit_bytes,
            bytes,
            self.config.scheduler.memory_watermark_percent,
        );
        self
    }

    /// A request was admitted for `m`: it is now the most recently used.
    pub fn touch(&self, m: &ServedModel) {
        m.memory.touch(self.started.elapsed().as_millis() as u64);
    }

    /// The pool a model's weights and KV live in on this node.
    pub(crate) fn pool(&self) -> Pool {
        Pool::of(self.engine_config.backend)
    }

    /// Bytes `m` will hold once loaded, before loading it: its weight files
    /// plus the KV cache for its context (per-sequence context x sequences,
    /// at f16, from the GGUF header), and the same for its draft model's private instance
    /// (speculation `draftModel`, sized to `m`'s context and sequences), once per replica (on
    /// CPU the replicas map the same weight files, so this overcounts them: the safe side).
    /// Returns the total and how it was made.
    fn estimate(&self, m: &ServedModel, primary: &Path) -> (u64, String) {
        let ctx = m
            .config
            .context_length
            .filter(|c| *c > 0)
            .unwrap_or(self.engine_config.context_length);
        let seqs = m.config.max_batch_size.unwrap_or(DEFAULT_MAX_BATCH).max(1);
        let (mut one, mut how) = footprint(primary, m.format, ctx, seqs);
        if let Some((id, d, draft_primary)) = self.draft_files(m) {
            let (bytes, draft_how) = footprint(&draft_primary, d.format, ctx, seqs);
            one = one.saturating_add(bytes);
            how.push_str(&format!(", draft model `{id}`: {draft_how}"));
        }
        let replicas = m.replicas();
        if replicas > 1 {
            how.push_str(&format!(", x {replicas} replicas"));
        }
        (one.saturating_mul(u64::from(replicas)), how)
    }

    /// `m`'s draft model and its primary file, when it drafts with one that was inspected.
    fn draft_files(&self, m: &ServedModel) -> Option<(String, Arc<ServedModel>, PathBuf)> {
        let (id, d) = self.draft_of(m)?;
        let d = d?;
        let primary = d.primary.read().ok()?.clone()?;
        Some((id, d, primary))
    }

    /// What a loaded model holds: the engine's report, else the estimate; on a GPU node
    /// the measured fall in free device memory when that is larger (devices.rs).
    fn held(&self, m: &ServedModel, r: &ReadyModel) -> Bytes {
        let reported = r.scheduler.bytes_used();
        let n = if reported > 0 {
            reported
        } else {
            m.memory.estimate.load(Ordering::Relaxed)
        };
        let n = n.max(m.measured_vram.load(Ordering::Relaxed));
        Bytes::in_pool(self.pool(), n)
    }

    /// The budgets the policy decides with now: the configured ones, and on a CUDA node
    /// the VRAM the devices really have (total less the reserve less what other
    /// processes hold), from the last device snapshot.
    pub(crate) fn limits_now(&self) -> Limits {
        let mut limits = self.memory.limits;
        if self.pool() == Pool::Vram {
            let ours: u64 = self.residents().iter().map(|r| r.held.vram).sum();
            let snap = self.devices.snapshot();
            let budget = crate::devices::vram_budget(&snap, self.devices.reserve, ours);
            limits.0.vram = crate::devices::vram_limit(limits.0.vram, budget);
        }
        limits
    }

    /// Every loaded model as the policy sees it, the ones a reload retired and that still
    /// hold their engine included. Idle means nothing holds the model but its state (no
    /// request between admission and its last token) and nothing is queued; only `load: lazy`
    /// models may go, since an eager model's absence would make the node unready, and never
    /// a retired one (its drain unloads it: node/reload.rs).
    fn residents(&self) -> Vec<Resident> {
        let retiring = self.retiring.lock().map(|r| r.clone()).unwrap_or_default();
        let mut out = Vec::new();
        for m in self.models().values().chain(retiring.iter()) {
            let Ok(state) = m.state.read() else { continue };
            if let ModelState::Ready(r) = &*state {
                out.push(Resident {
                    id: m.config.id.clone(),
                    held: self.held(m, r),
                    last_used: m.memory.last_used(),
                    evictable: m.config.load == LoadPolicy::Lazy && !m.is_retired() && is_idle(r),
                });
            }
        }
        out
    }

    /// Unload `m` when it is idle, or also when busy with `force`: its state goes back to
    /// `Idle`, which drops the state's reference to the ready model. Once no request holds
    /// another, its schedulers stop (each only after its running sequences have ended) and
    /// the engine frees the model. `note` makes the status message from what the model held;
    /// the unload is counted under `reason`. Returns whether it unloaded. The memory policy's
    /// unloads and a reload's (node/reload.rs) both come through here.
    pub(crate) fn unload(
        &self,
        m: &ServedModel,
        reason: &str,
        force: bool,
        note: impl FnOnce(Bytes) -> String,
    ) -> bool {
        let Ok(mut state) = m.state.write() else {
            return false;
        };
        let held = match &*state {
            ModelState::Ready(r) if force || is_idle(r) => self.held(m, r),
            _ => return false,
        };
        let message = note(held);
        *state = ModelState::Idle;
        drop(state);
        m.memory.set_note(Some(Note::Unloaded(message)));
        let id = m.config.id.as_str();
        self.metrics
            .model_unloads
            .with_label_values(&[id, reason])
            .inc();
        self.metrics
            .model_memory_bytes
            .with_label_values(&[id])
            .set(0.0);
        true
    }

    /// Unload `u` if it is still idle (a request may have taken it since the
    /// plan was made).
    fn unload_for_memory(&self, u: &Unload, why: &str) -> bool {
        let Some(m) = self.model(&u.id) else {
            return false;
        };
        // Before the state lock: the limit reads every model's state.
        let limit = self.limits_now().get(u.pool);
        let pool = u.pool;
        let reason = format!("{}_watermark", pool.label());
        self.unload(&m, &reason, false, |held| {
            let message = format!(
                "unloaded as the least recently used idle model: {} use was {} of {} (watermark {} %) {why}; it reloads on its next request",
                pool.name(),
                super::human(u.used),
                super::human(limit),
                self.memory.limits.watermark_percent(),
            );
            tracing::warn!(target: "gantry::alert", model = %u.id, pool = pool.label(), used = u.used, limit, freed = held.get(pool), "{message}");
            message
        })
    }

    /// Before loading `m`: estimate its need and unload least-recently-used
    /// idle models until it fits under the watermark, or refuse. A model
    /// whose last request is still finishing (its response sent, its
    /// scheduler not yet idle) gets a short, bounded moment to settle before
    /// the load is refused; so does a model that became busy after the plan.
    pub(crate) fn make_room(&self, m: &ServedModel, primary: &Path) -> Result<(), Refusal> {
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
            match super::plan_load(&self.limits_now(), id, need, &self.residents()) {
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

    /// Before a plugin update shadow-loads `targets` (each model with the instance it runs):
    /// room for a second copy of each beside everything resident, while both versions run.
    /// Idle lazy models other than the targets are unloaded, least recently used first, where
    /// that makes room; otherwise the update is refused with the budget's words, rather than
    /// risk the kernel's OOM killer picking a serving worker.
    pub(crate) fn make_room_for_shadow(
        &self,
        plugin: &str,
        targets: &[(Arc<ServedModel>, Arc<ReadyModel>)],
    ) -> Result<(), String> {
        let mut need = Bytes::default();
        for (m, r) in targets {
            let held = self.held(m, r);
            need.ram = need.ram.saturating_add(held.ram);
            need.vram = need.vram.saturating_add(held.vram);
        }
        let residents: Vec<Resident> = self
            .residents()
            .into_iter()
            .map(|r| {
                let target = targets.iter().any(|(m, _)| m.config.id == r.id);
                Resident {
                    evictable: r.evictable && !target,
                    ..r
                }
            })
            .collect();
        let what = format!("the new version of plugin `{plugin}`");
        let unloads =
            super::plan_load(&self.limits_now(), &what, need, &residents).map_err(|r| {
                format!(
                    "no room for a second copy while both versions run: {}",
                    r.message
                )
            })?;
        let why = format!("before {what} loads beside the old one");
        for u in &unloads {
            if !self.unload_for_memory(u, &why) {
                return Err(format!(
                    "no room for a second copy while both versions run: model `{}` was to make room and became busy",
                    u.id
                ));
            }
        }
        self.update_memory_gauges();
        Ok(())
    }

    /// A loaded `load: lazy` model other than `except` is serving a request.
    fn lazy_model_busy(&self, except: &str) -> bool {
        self.models().values().any(|m| {
            m.config.id != except
                && m.config.load == LoadPolicy::Lazy
                && m.state
                    .read()
                    .is_ok_and(|s| matches!(&*s, ModelState::Ready(r) if !is_idle(r)))
        })
    }

    /// `m` came up: bring the pools back under their watermarks, and if the
    /// engine's real footprint does not fit at all, unload `m` itself.
    pub(crate) fn after_load(&self, m: &ServedModel) {
        let id = m.config.id.as_str();
        let (unloads, over) = super::plan_after_load(&self.limits_now(), id, &self.residents());
        let why = format!("after model `{id}` loaded");
        for u in &unloads {
            self.unload_for_memory(u, &why);
        }
        if let Some(pool) = over {
            let held = m.ready().map_or(0, |r| self.held(m, &r).get(pool));
            let message = format!(
                "{}: model `{id}` holds {} of {} once loaded (the engine's report), more than fits beside the models in use; unloaded again",
                pool.oom(),
                super::human(held),
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
    pub(crate) fn refuse_load(&self, m: &ServedModel, r: Refusal) {
        tracing::error!(target: "gantry::alert", model = %m.config.id, code = %r.pool.oom(), "model load refused: {}", r.message);
        self.metrics
            .model_load_refusals
            .with_label_values(&[m.config.id.as_str(), r.pool.oom().name()])
            .inc();
        m.memory.set_note(Some(Note::Refused(r)));
        m.set(ModelState::Idle);
        self.update_memory_gauges();
    }

    /// The policy's pool as `/v1/status` reports it: its budget, its watermark and what the
    /// loaded models hold (the figures of the `gantry_memory_*` gauges).
    pub(crate) fn memory_status(&self) -> gantry_api::MemoryStatus {
        let pool = self.pool();
        let limits = self.limits_now();
        gantry_api::MemoryStatus {
            pool: pool.label().to_string(),
            limit_bytes: limits.get(pool),
            watermark_bytes: limits.watermark(pool),
            used_bytes: self.held_now().get(pool),
            evictions_total: counted(&self.metrics.model_unloads, |labels| {
                labels
                    .iter()
                    .any(|l| l.name() == "reason" && l.value().ends_with("_watermark"))
            }),
            refusals_total: counted(&self.metrics.model_load_refusals, |_| true),
        }
    }

    /// What the loaded models hold, per pool.
    pub(crate) fn held_now(&self) -> Bytes {
        let mut used = Bytes::default();
        for r in self.residents() {
            used.vram = used.vram.saturating_add(r.held.vram);
            used.ram = used.ram.saturating_add(r.held.ram);
        }
        used
    }

    pub(crate) fn update_memory_gauges(&self) {
        let limits = self.limits_now();
        let used = self.held_now();
        for pool in Pool::ALL {
            let l = [pool.label()];
            self.metrics
                .memory_used_bytes
                .with_label_values(&l)
                .set(used.get(pool) as f64);
            self.metrics
                .memory_limit_bytes
                .with_label_values(&l)
                .set(limits.get(pool) as f64);
        }
    }
}

/// No request holds the model (the state's reference is the only one: call it with that
/// one, under the state lock) and nothing is queued or running in its scheduler.
pub(crate) fn is_idle(r: &Arc<ReadyModel>) -> bool {
    Arc::strong_count(r) == 1 && r.scheduler.idle()
}

/// The sum of a counter vector's series whose labels pass `keep`.
fn counted(
    counters: &prometheus::IntCounterVec,
    keep: impl Fn(&[prometheus::proto::LabelPair]) -> bool,
) -> u64 {
    use prometheus::core::Collector;
    counters
        .collect()
        .iter()
        .flat_map(|family| family.get_metric())
        .filter(|m| keep(m.get_label()))
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

/// The bytes one engine instance of the model in `primary` holds: its weight files plus, for a
/// GGUF, its KV cache for `ctx` tokens (capped at the trained context) x `seqs` sequences at
/// f16, from the header; and how it was made.
fn footprint(primary: &Path, format: Format, ctx: u32, seqs: u32) -> (u64, String) {
    let mut weights = super::weight_bytes(primary, format);
    let mut how = format!("weights {}", super::human(weights));
    if format == Format::Safetensors
        && let Some((what, times)) = super::load_copies(primary)
    {
        // The engine's own copies of the weights, made at load (an upper bound: not every
        // tensor of the files is copied).
        let copies = weights.saturating_mul(times);
        weights = weights.saturating_add(copies);
        how.push_str(&format!(" + {what} {}", super::human(copies)));
    }
    let mut kv = 0u64;
    if format == Format::Gguf {
        match gantry_formats::gguf::read_header(primary) {
            Ok(h) => {
                let trained = h
                    .context_length()
                    .and_then(|c| u32::try_from(c).ok())
                    .unwrap_or(u32::MAX)
                    .max(1);
                let per_seq = if ctx == 0 { trained } else { ctx.min(trained) };
                let cells = u64::from(per_seq) * u64::from(seqs);
                match h.kv_bytes_per_token() {
                    Some(per_cell) => {
                        kv = per_cell.saturating_mul(cells);
                        how.push_str(&format!(
                            " + KV {} ({per_seq} tokens x {seqs} sequences)",
                            super::human(kv)
                        ));
                    }
                    None => how.push_str(" (the header gives no attention shape; KV not counted)"),
                }
            }
            Err(e) => how.push_str(&format!(" (header unreadable: {e}; KV not counted)")),
        }
    }
    (weights.saturating_add(kv), how)
}
