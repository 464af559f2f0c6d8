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
//! `Node` (node.rs) applies their decisions. `weight_bytes` sizes an
//! artifact's files for the estimate.

use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use std::path::Path;

use gantry_engine_abi::{Backend, EngineError, Format, Status};

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

/// The node's budgets; 0 in a pool means no limit there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits(pub Bytes);

impl Limits {
    /// Budgets for a node: the VRAM limit handed to engines, and the RAM
    /// limit. On a CPU node the engines' limit is RAM too, so the smaller of
    /// the two binds and VRAM is not watched.
    pub fn for_backend(backend: Backend, vram_limit: u64, ram_limit: u64) -> Limits {
        match backend {
            Backend::Cuda => Limits(Bytes {
                vram: vram_limit,
                ram: ram_limit,
            }),
            Backend::Cpu => Limits(Bytes {
                vram: 0,
                ram: match (vram_limit, ram_limit) {
                    (0, r) => r,
                    (v, 0) => v,
                    (v, r) => v.min(r),
                },
            }),
        }
    }

    pub fn get(&self, p: Pool) -> u64 {
        self.0.get(p)
    }

    /// The watermark in bytes; `None` when the pool has no limit.
    pub fn watermark(&self, p: Pool) -> Option<u64> {
        match self.get(p) {
            0 => None,
            // Integer arithmetic: exact, and no overflow near u64::MAX.
            l => Some(l / 100 * WATERMARK_PERCENT + l % 100 * WATERMARK_PERCENT / 100),
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
    pub fn new(backend: Backend, vram_limit: u64, ram_flag: u64) -> Self {
        let (ram, ram_source) = ram_limit(ram_flag);
        Self {
            limits: Limits::for_backend(backend, vram_limit, ram),
            ram_source,
            lock: std::sync::Mutex::new(()),
        }
    }
}

/// Where the RAM limit came from when none was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RamSource {
    Flag,
    CgroupV2,
    CgroupV1,
    MemTotal,
    Unknown,
}

impl RamSource {
    pub fn as_str(self) -> &'static str {
        match self {
            RamSource::Flag => "--ram-limit",
            RamSource::CgroupV2 => "cgroup memory.max",
            RamSource::CgroupV1 => "cgroup memory.limit_in_bytes",
            RamSource::MemTotal => "MemTotal",
            RamSource::Unknown => "unknown (no limit)",
        }
    }
}

/// The RAM this node may use: the flag when given (non-zero), else the
/// container's cgroup limit when one is set, else the machine's MemTotal.
pub fn ram_limit(flag: u64) -> (u64, RamSource) {
    if flag > 0 {
        return (flag, RamSource::Flag);
    }
    let read = |p: &str| std::fs::read_to_string(p).ok();
    if let Some(n) = read("/sys/fs/cgroup/memory.max").and_then(|s| parse_cgroup_limit(&s)) {
        return (n, RamSource::CgroupV2);
    }
    if let Some(n) =
        read("/sys/fs/cgroup/memory/memory.limit_in_bytes").and_then(|s| parse_cgroup_limit(&s))
    {
        return (n, RamSource::CgroupV1);
    }
    match read("/proc/meminfo").and_then(|s| parse_mem_total(&s)) {
        Some(n) => (n, RamSource::MemTotal),
        None => (0, RamSource::Unknown),
    }
}

/// A cgroup limit file: `max` (v2) or a page-rounded `i64::MAX` (v1) mean none.
pub fn parse_cgroup_limit(s: &str) -> Option<u64> {
    let n: u64 = s.trim().parse().ok()?;
    // cgroup v1 reports "no limit" as i64::MAX rounded down to a page.
    (n > 0 && n < (1 << 62)).then_some(n)
}

/// `MemTotal:  16318412 kB` from /proc/meminfo, in bytes.
pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line
        .trim_start_matches("MemTotal:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// Bytes of a model's weight files: the GGUF (every shard of a split one),
/// or the `.safetensors` files beside the primary artifact.
pub fn weight_bytes(primary: &Path, format: Format) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let dir = primary.parent().unwrap_or(Path::new("."));
    let name = primary
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let siblings = |keep: &dyn Fn(&str) -> bool| -> u64 {
        std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .filter(|e| keep(&e.file_name().to_string_lossy()))
                    .map(|e| size(&e.path()))
                    .sum()
            })
            .unwrap_or(0)
    };
    match format {
        // `name-00001-of-00003.gguf`: the shards share everything before `-00001-of-`.
        Format::Gguf => match name.find("-00001-of-") {
            Some(at) => {
                let stem = &name[..at];
                siblings(&|n: &str| {
                    n.starts_with(stem) && n.ends_with(".gguf") && n[stem.len()..].contains("-of-")
                })
            }
            None => size(primary),
        },
        Format::Safetensors => siblings(&|n: &str| n.ends_with(".safetensors")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn ram(n: u64) -> Bytes {
        Bytes::in_pool(Pool::Ram, n)
    }

    fn res(id: &str, mib: u64, last_used: u64, evictable: bool) -> Resident {
        Resident {
            id: id.into(),
            held: ram(mib * MIB),
            last_used,
            evictable,
        }
    }

    fn limits(ram_mib: u64) -> Limits {
        Limits::for_backend(Backend::Cpu, 0, ram_mib * MIB)
    }

    fn ids(u: &[Unload]) -> Vec<&str> {
        u.iter().map(|u| u.id.as_str()).collect()
    }

    #[test]
    fn a_load_that_fits_under_the_watermark_unloads_nothing() {
        let r = [res("a", 30, 5, true)];
        assert_eq!(plan_load(&limits(100), "b", ram(50 * MIB), &r), Ok(vec![]));
        // Exactly at the watermark is not over it.
        assert_eq!(
            plan_load(&limits(100), "b", ram(60 * MIB), &r).map(|u| u.len()),
            Ok(0)
        );
    }

    #[test]
    fn the_least_recently_used_idle_model_goes_first_and_only_as_many_as_needed() {
        let r = [
            res("new", 30, 9, true),
            res("old", 30, 1, true),
            res("mid", 30, 5, true),
        ];
        // 90 + 30 > 90: one unload brings it to 90, the watermark.
        let u = plan_load(&limits(100), "x", ram(30 * MIB), &r).expect("fits");
        assert_eq!(ids(&u), ["old"]);
        assert_eq!((u[0].pool, u[0].used), (Pool::Ram, 90 * MIB));
        let u = plan_load(&limits(100), "x", ram(50 * MIB), &r).expect("fits");
        assert_eq!(ids(&u), ["old", "mid"]);
    }

    #[test]
    fn busy_and_pinned_models_stay_and_a_load_that_cannot_fit_beside_them_is_refused() {
        let r = [
            res("busy", 40, 1, false),
            res("idle", 20, 2, true),
            res("eager", 30, 0, false),
        ];
        // Unloading `idle` leaves 70 MiB held; 25 more fits under the limit
        // though above the watermark, so it loads.
        let u = plan_load(&limits(100), "x", ram(25 * MIB), &r).expect("fits");
        assert_eq!(ids(&u), ["idle"]);
        let e = plan_load(&limits(100), "x", ram(40 * MIB), &r).expect_err("no room");
        assert_eq!((e.pool, e.never_fits), (Pool::Ram, false));
        assert_eq!(e.to_engine_error().status, Status::OomRam);
        assert!(
            e.message
                .starts_with("OOM_RAM: model `x` needs 40.0 MiB of RAM"),
            "{}",
            e.message
        );
        assert!(
            e.message.contains("busy (40.0 MiB), eager (30.0 MiB)"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_model_larger_than_the_whole_pool_is_refused_without_unloading_anything() {
        let r = [res("a", 10, 1, true)];
        let e = plan_load(&limits(100), "huge", ram(101 * MIB), &r).expect_err("never fits");
        assert!(e.never_fits, "{e:?}");
        assert!(
            e.message.contains("can never be loaded here"),
            "{}",
            e.message
        );
        // On a CUDA node the same need in VRAM is OOM_VRAM.
        let l = Limits::for_backend(Backend::Cuda, 100 * MIB, 0);
        let e = plan_load(&l, "huge", Bytes::in_pool(Pool::Vram, 200 * MIB), &[])
            .expect_err("never fits");
        assert_eq!(e.to_engine_error().status, Status::OomVram);
        assert!(e.message.starts_with("OOM_VRAM:"), "{}", e.message);
    }

    #[test]
    fn no_limit_means_no_unloads_and_no_refusals() {
        let r = [res("a", 1 << 20, 1, true)];
        assert_eq!(
            plan_load(&Limits::default(), "b", ram(u64::MAX), &r),
            Ok(vec![])
        );
        assert_eq!(plan_after_load(&Limits::default(), "a", &r), (vec![], None));
    }

    #[test]
    fn after_a_load_the_watermark_is_restored_and_an_overflow_names_the_pool() {
        let r = [
            res("a", 40, 1, true),
            res("b", 40, 2, true),
            res("new", 15, 3, true),
        ];
        let (u, over) = plan_after_load(&limits(100), "new", &r);
        assert_eq!((ids(&u), over), (vec!["a"], None));
        // The engine reported more than estimated and nothing can make room.
        let r = [res("busy", 60, 1, false), res("new", 50, 3, true)];
        assert_eq!(
            plan_after_load(&limits(100), "new", &r),
            (vec![], Some(Pool::Ram))
        );
    }

    #[test]
    fn a_cpu_node_binds_on_the_smaller_of_its_engine_and_ram_limits() {
        let l = Limits::for_backend(Backend::Cpu, 50, 80);
        assert_eq!((l.get(Pool::Ram), l.get(Pool::Vram)), (50, 0));
        let l = Limits::for_backend(Backend::Cpu, 0, 80);
        assert_eq!(l.get(Pool::Ram), 80);
        let l = Limits::for_backend(Backend::Cuda, 50, 80);
        assert_eq!((l.get(Pool::Vram), l.get(Pool::Ram)), (50, 80));
        assert_eq!(l.watermark(Pool::Vram), Some(45));
    }

    #[test]
    fn ram_limits_come_from_cgroup_files_and_meminfo() {
        assert_eq!(parse_cgroup_limit("max\n"), None);
        assert_eq!(parse_cgroup_limit("1073741824\n"), Some(1 << 30));
        assert_eq!(parse_cgroup_limit("9223372036854771712\n"), None);
        assert_eq!(parse_cgroup_limit("0"), None);
        let meminfo = "MemTotal:       16318412 kB\nMemFree:         1000 kB\n";
        assert_eq!(parse_mem_total(meminfo), Some(16318412 * 1024));
        assert_eq!(parse_mem_total("garbage"), None);
        assert_eq!(ram_limit(123), (123, RamSource::Flag));
        let (n, src) = ram_limit(0);
        assert!(n > 0 && src != RamSource::Flag, "{n} {src:?}");
    }

    #[test]
    fn weights_are_every_shard_of_a_split_gguf_or_every_safetensors_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let put = |name: &str, n: usize| {
            let p = dir.path().join(name);
            std::fs::write(&p, vec![0u8; n]).expect("write");
            p
        };
        let first = put("m-Q4_K_M-00001-of-00002.gguf", 10);
        put("m-Q4_K_M-00002-of-00002.gguf", 20);
        let single = put("other.gguf", 5);
        put("mmproj-m.gguf", 7);
        put("model-00001-of-00002.safetensors", 100);
        put("model-00002-of-00002.safetensors", 200);
        let index = put("model.safetensors.index.json", 3);
        assert_eq!(weight_bytes(&first, Format::Gguf), 30);
        assert_eq!(weight_bytes(&single, Format::Gguf), 5);
        assert_eq!(weight_bytes(&index, Format::Safetensors), 300);
        assert_eq!(weight_bytes(&dir.path().join("gone.gguf"), Format::Gguf), 0);
    }

    #[test]
    fn sizes_read_like_people_write_them() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 * MIB / 2), "1.5 MiB");
        assert_eq!(human(5 << 30), "5.0 GiB");
    }

    #[test]
    fn last_use_only_moves_forward_and_notes_carry_the_refusal() {
        let m = ModelMemory::default();
        assert_eq!(m.last_used(), 0);
        m.touch(10);
        m.touch(5);
        assert_eq!(m.last_used(), 11);
        let r = Refusal {
            pool: Pool::Ram,
            message: "OOM_RAM: x".into(),
            never_fits: false,
        };
        m.set_note(Some(Note::Refused(r.clone())));
        assert_eq!(m.refusal(), Some(r));
        m.set_note(Some(Note::Unloaded("lru".into())));
        assert_eq!(m.refusal(), None);
    }
}
