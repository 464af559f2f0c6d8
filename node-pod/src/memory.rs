//! Node state, memory policy (before every model load and after it): which idle model to unload
//! and whether a load fits.
//!
//! The rules are the specification's (seeds 001): VRAM and RAM each have a
//! 90 % watermark; above it the least-recently-used idle model is unloaded; a
//! load that cannot fit is refused with `OOM_VRAM`/`OOM_RAM` before anything
//! is allocated; there is no CPU offload and no partial loading.
//!
//! The node accounts what its models hold — the engine's own report once a
//! model is loaded, and before that an estimate from the artifact size plus
//! the KV cache for the configured context (from the GGUF header). A model
//! counts against the pool its weights and KV live in: RAM on a CPU node,
//! VRAM on a CUDA node. The functions that decide are pure and take a
//! snapshot of the resident models, so they are tested without engines;
//! `Node` applies their decisions (memory/node.rs); `measure` finds the RAM
//! budget and sizes an artifact's files for the estimate.

use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use gantry_engine_abi::{Backend, EngineError, Status};

mod measure;
mod node;
#[cfg(test)]
mod tests;

pub use measure::{
    RamSource, load_copies, parse_cgroup_limit, parse_mem_total, ram_limit, weight_bytes,
};
pub(crate) use node::is_idle;

/// Unload above this share of a pool, in percent (seeds 001: 90 % for VRAM and RAM alike).
pub const WATERMARK_PERCENT: u64 = 90;

/// A memory pool the policy watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pool {
    Vram,
    Ram,
}

impl Pool {
    pub const ALL: [Pool; 2] = [Pool::Vram, Pool::Ram];

    pub fn name(self) -> &'static str {
        match self {
            Pool::Vram => "VRAM",
            Pool::Ram => "RAM",
        }
    }

    /// The status code a refused load carries.
    pub fn oom(self) -> Status {
        match self {
            Pool::Vram => Status::OomVram,
            Pool::Ram => Status::OomRam,
        }
    }

    /// Label value for `gantry_model_unloads_total{reason}` and the pool gauges.
    pub fn label(self) -> &'static str {
        match self {
            Pool::Vram => "vram",
            Pool::Ram => "ram",
        }
    }

    /// The pool a model's weights and KV live in on this backend.
    pub fn of(backend: Backend) -> Pool {
        match backend {
            Backend::Cpu => Pool::Ram,
            Backend::Cuda => Pool::Vram,
        }
    }
}

/// Bytes per pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bytes {
    pub vram: u64,
    pub ram: u64,
}

impl Bytes {
    pub fn get(&self, p: Pool) -> u64 {
        match p {
            Pool::Vram => self.vram,
            Pool::Ram => self.ram,
        }
    }

    fn get_mut(&mut self, p: Pool) -> &mut u64 {
        match p {
            Pool::Vram => &mut self.vram,
            Pool::Ram => &mut self.ram,
        }
    }

    /// `n` bytes in one pool.
    pub fn in_pool(p: Pool, n: u64) -> Bytes {
        let mut b = Bytes::default();
        *b.get_mut(p) = n;
        b
    }
}

/// The node's budgets (0 in a pool means no limit there), and the watermark in percent of
/// each ([`WATERMARK_PERCENT`] unless the config's `scheduler.memoryWatermarkPercent` says
/// otherwise).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits(pub Bytes, pub u64);

impl Limits {
    /// Budgets for a node: the VRAM limit handed to engines, and the RAM
    /// limit. On a CPU node the engines' limit is RAM too, so the smaller of
    /// the two binds and VRAM is not watched.
    pub fn for_backend(backend: Backend, vram_limit: u64, ram_limit: u64) -> Limits {
        match backend {
            Backend::Cuda => Limits(
                Bytes {
                    vram: vram_limit,
                    ram: ram_limit,
                },
                WATERMARK_PERCENT,
            ),
            Backend::Cpu => Limits(
                Bytes {
                    vram: 0,
                    ram: match (vram_limit, ram_limit) {
                        (0, r) => r,
                        (v, 0) => v,
                        (v, r) => v.min(r),
                    },
                },
                WATERMARK_PERCENT,
            ),
        }
    }

    /// The same budgets with the watermark at `percent`.
    pub fn with_watermark(self, percent: u64) -> Limits {
        Limits(self.0, percent)
    }

    /// The watermark in percent of each budget.
    pub fn watermark_percent(&self) -> u64 {
        self.1
    }

    pub fn get(&self, p: Pool) -> u64 {
        self.0.get(p)
    }

    /// The watermark in bytes; `None` when the pool has no limit.
    pub fn watermark(&self, p: Pool) -> Option<u64> {
        match self.get(p) {
            0 => None,
            // Integer arithmetic: exact, and no overflow near u64::MAX.
            l => Some(l / 100 * self.1 + l % 100 * self.1 / 100),
        }
    }
}

/// A loaded model as the policy sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resident {
    pub id: String,
    pub held: Bytes,
    /// Milliseconds since node start of the last admitted request (0 = none yet).
    pub last_used: u64,
    /// Idle (no request holds it) and allowed to be unloaded (`load: lazy`).
    pub evictable: bool,
}

/// An unload the policy asks for, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unload {
    pub id: String,
    /// The pool over its watermark that this unload relieves.
    pub pool: Pool,
    /// Bytes in use in that pool before the unload.
    pub used: u64,
}

/// A refused load: the status (`OOM_VRAM`/`OOM_RAM`) and a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub pool: Pool,
    pub message: String,
    /// The model needs more than the whole pool: no wait or unload can help.
    pub never_fits: bool,
}

impl Refusal {
    pub fn to_engine_error(&self) -> EngineError {
        EngineError::new(self.pool.oom(), self.message.clone())
    }
}

/// `1.5 MiB`-style sizes for messages.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn used(resident: &[Resident]) -> Bytes {
    let mut b = Bytes::default();
    for r in resident {
        for p in Pool::ALL {
            *b.get_mut(p) = b.get(p).saturating_add(r.held.get(p));
        }
    }
    b
}

/// Unload least-recently-used evictable models (never `keep`) until every
/// pool's use plus `extra` is at or under its watermark, or nothing more can
/// go. Returns the unloads in order and the use left after them.
fn relieve(
    limits: &Limits,
    resident: &[Resident],
    extra: Bytes,
    keep: Option<&str>,
) -> (Vec<Unload>, Bytes) {
    let mut now = used(resident);
    let mut candidates: Vec<&Resident> = resident
        .iter()
        .filter(|r| r.evictable && Some(r.id.as_str()) != keep)
        .collect();
    // Oldest first; the id breaks ties so the choice is deterministic.
    candidates.sort_by(|a, b| a.last_used.cmp(&b.last_used).then(a.id.cmp(&b.id)));
    let mut unloads = Vec::new();
    loop {
        let over: Vec<Pool> = Pool::ALL
            .into_iter()
            .filter(|p| {
                limits
                    .watermark(*p)
                    .is_some_and(|w| now.get(*p).saturating_add(extra.get(*p)) > w)
            })
            .collect();
        if over.is_empty() {
            break;
        }
        // The oldest model that frees something in a pool that is over.
        let Some(pos) = candidates
            .iter()
            .position(|c| over.iter().any(|p| c.held.get(*p) > 0))
        else {
            break;
        };
        let c = candidates.remove(pos);
        let pool = over
            .into_iter()
            .find(|p| c.held.get(*p) > 0)
            .unwrap_or(Pool::Ram);
        unloads.push(Unload {
            id: c.id.clone(),
            pool,
            used: now.get(pool),
        });
        for p in Pool::ALL {
            *now.get_mut(p) = now.get(p).saturating_sub(c.held.get(p));
        }
    }
    (unloads, now)
}

/// Before loading `id`, which needs `need`: the unloads that make room (LRU
/// first, down to the watermark where possible), or a refusal. A model that
/// needs more than a whole pool is refused without touching anything; one
/// that does not fit next to busy or pinned models is refused without
/// unloading any of them.
pub fn plan_load(
    limits: &Limits,
    id: &str,
    need: Bytes,
    resident: &[Resident],
) -> Result<Vec<Unload>, Refusal> {
    for p in Pool::ALL {
        let limit = limits.get(p);
        if limit > 0 && need.get(p) > limit {
            return Err(Refusal {
                pool: p,
                message: format!(
                    "{}: model `{id}` needs {} of {} but the node's whole {} limit is {}; it can never be loaded here (no CPU offload, no partial loading)",
                    p.oom(),
                    human(need.get(p)),
                    p.name(),
                    p.name(),
                    human(limit)
                ),
                never_fits: true,
            });
        }
    }
    let (unloads, left) = relieve(limits, resident, need, Some(id));
    for p in Pool::ALL {
        let limit = limits.get(p);
        if limit > 0 && left.get(p).saturating_add(need.get(p)) > limit {
            let holders: Vec<String> = resident
                .iter()
                .filter(|r| r.held.get(p) > 0 && !unloads.iter().any(|u| u.id == r.id))
                .map(|r| format!("{} ({})", r.id, human(r.held.get(p))))
                .collect();
            return Err(Refusal {
                pool: p,
                message: format!(
                    "{}: model `{id}` needs {} of {}; {} of the {} limit is held by models that are busy or pinned: {}",
                    p.oom(),
                    human(need.get(p)),
                    p.name(),
                    human(left.get(p)),
                    human(limit),
                    holders.join(", ")
                ),
                never_fits: false,
            });
        }
    }
    Ok(unloads)
}

/// After `loaded` came up (its real footprint now in `resident`): the unloads
/// that bring every pool back under its watermark, and the pool still over
/// its whole limit if there is one (then `loaded` itself must go).
pub fn plan_after_load(
    limits: &Limits,
    loaded: &str,
    resident: &[Resident],
) -> (Vec<Unload>, Option<Pool>) {
    let (unloads, left) = relieve(limits, resident, Bytes::default(), Some(loaded));
    let over = Pool::ALL.into_iter().find(|p| {
        let limit = limits.get(*p);
        limit > 0 && left.get(*p) > limit
    });
    (unloads, over)
}

/// Per-model memory bookkeeping: when it was last used and the policy's last
/// word on it (shown in `/v1/status`).
#[derive(Debug, Default)]
pub struct ModelMemory {
    /// Milliseconds since node start of the last admitted request, plus one (0 = never).
    last_used: AtomicU64,
    /// The estimate made before the last load (bytes in its pool).
    pub estimate: AtomicU64,
    note: RwLock<Option<Note>>,
}

/// The last memory decision about a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// Unloaded to relieve a pool; reloads on its next request.
    Unloaded(String),
    /// A load was refused; the next request tries again.
    Refused(Refusal),
}

impl ModelMemory {
    pub fn touch(&self, since_start_ms: u64) {
        self.last_used
            .fetch_max(since_start_ms.saturating_add(1), Ordering::Relaxed);
    }

    pub fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }

    pub fn note(&self) -> Option<Note> {
        self.note.read().ok().and_then(|n| n.clone())
    }

    pub fn set_note(&self, note: Option<Note>) {
        if let Ok(mut g) = self.note.write() {
            *g = note;
        }
    }

    /// The refusal of the last load, if it was refused.
    pub fn refusal(&self) -> Option<Refusal> {
        match self.note() {
            Some(Note::Refused(r)) => Some(r),
            _ => None,
        }
    }
}

/// The node-wide side of the policy: its budgets, and the lock that makes
/// "plan, unload, load" one step so two loads never count the same free bytes.
#[derive(Debug)]
pub struct NodeMemory {
    pub limits: Limits,
    pub ram_source: RamSource,
    pub(crate) lock: std::sync::Mutex<()>,
}

impl NodeMemory {
    pub fn new(backend: Backend, vram_limit: u64, ram_flag: u64, watermark_percent: u64) -> Self {
        let (ram, ram_source) = ram_limit(ram_flag);
        Self {
            limits: Limits::for_backend(backend, vram_limit, ram).with_watermark(watermark_percent),
            ram_source,
            lock: std::sync::Mutex::new(()),
        }
    }
}
