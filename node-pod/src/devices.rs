//! Node hardware (read at start, before every model load and on each metrics refresh): the
//! GPUs this process sees, their real free and total memory, and the decisions that follow
//! from them — the VRAM budget of the memory policy and where a model is placed.
//!
//! A [`DeviceSnapshot`] is filled from the CUDA driver (and NVML where present) by
//! `engine_host::cuda::probe` in production, and from a recorded JSON fixture of real
//! numbers in tests; every function here is pure over a snapshot, so the policy is tested
//! on machines without a GPU. No GPU is a normal state (`devices: []` with a note), never
//! an error.

use std::path::{Path, PathBuf};
use std::sync::RwLock;

// The snapshot is plain data the engine host's probe fills and `/v1/status` reports.
pub use gantry_api::DeviceSnapshot;
use gantry_api::DeviceStatus;

use crate::memory::human;

/// Device memory kept out of every budget by default: the CUDA context, cuBLAS workspaces
/// and allocator slack that no engine reports as its own (about 500 MiB on Hopper with
/// CUDA 12), with room to spare.
pub const DEFAULT_VRAM_RESERVE_BYTES: u64 = 1 << 30;

/// A measured load differs from the engine's own figure by more than this share: say so.
pub const MEASURE_TOLERANCE_PERCENT: u64 = 20;

/// Where a node's device figures come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSource {
    /// The CUDA driver (and NVML), read again on every refresh.
    Driver,
    /// A recorded snapshot (`--device-snapshot`): tests and replays of a GPU node's
    /// figures on a machine without one. Static: loads are not measured.
    Recorded(PathBuf),
}

/// The node's view of its devices: the last snapshot and the reserve kept out of budgets.
#[derive(Debug)]
pub struct NodeDevices {
    pub source: DeviceSource,
    /// Bytes per device never counted as free for models (`--vram-reserve`).
    pub reserve: u64,
    snapshot: RwLock<DeviceSnapshot>,
}

impl NodeDevices {
    /// Read the machine's GPUs now.
    pub fn from_driver(reserve: u64) -> Self {
        Self {
            source: DeviceSource::Driver,
            reserve,
            snapshot: RwLock::new(crate::engine_host::cuda::probe()),
        }
    }

    /// A recorded snapshot (JSON, as `gantry-node devices --json` prints it).
    pub fn recorded(path: &Path, reserve: u64) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("device snapshot {}: {e}", path.display()))?;
        let snap: DeviceSnapshot = serde_json::from_str(&text)
            .map_err(|e| format!("device snapshot {}: {e}", path.display()))?;
        Ok(Self {
            source: DeviceSource::Recorded(path.to_path_buf()),
            reserve,
            snapshot: RwLock::new(snap),
        })
    }

    /// The last snapshot taken.
    pub fn snapshot(&self) -> DeviceSnapshot {
        self.snapshot
            .read()
            .map(|s| s.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Read the devices again (a recorded snapshot stays as it is) and return the result.
    pub fn refresh(&self) -> DeviceSnapshot {
        if self.source != DeviceSource::Driver {
            return self.snapshot();
        }
        let fresh = crate::engine_host::cuda::probe();
        if let Ok(mut g) = self.snapshot.write() {
            *g = fresh.clone();
        }
        fresh
    }

    /// Loads are measured only against live figures.
    pub fn measures_loads(&self) -> bool {
        self.source == DeviceSource::Driver
    }
}

/// The VRAM the node's models may hold in all, from real device figures: every device's
/// total less the reserve, less what others hold (used memory that is not this node's
/// models: other processes, or a context nobody reports). `ours` is what the node's loaded
/// models hold by their engines' reports. `None` when there is no device to budget.
pub fn vram_budget(snap: &DeviceSnapshot, reserve: u64, ours: u64) -> Option<u64> {
    if snap.devices.is_empty() {
        return None;
    }
    let total: u64 = snap
        .devices
        .iter()
        .map(|d| d.total_bytes.saturating_sub(reserve))
        .sum();
    let used: u64 = snap
        .devices
        .iter()
        .map(|d| d.total_bytes.saturating_sub(d.free_bytes))
        .sum();
    let others = used.saturating_sub(ours);
    Some(total.saturating_sub(others))
}

/// The VRAM limit the memory policy works with: the configured limit (0 = none) and the
/// real budget, whichever is smaller.
pub fn vram_limit(configured: u64, budget: Option<u64>) -> u64 {
    match (configured, budget) {
        (0, Some(b)) => b.max(1),
        (c, Some(b)) => c.min(b).max(1),
        (c, None) => c,
    }
}

/// Where a model asks to go (`gpus`, `devices` in its config).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlacementRequest {
    /// Devices to spread the model over; 0 = 1.
    pub gpus: u32,
    /// Pinned device ordinals; empty = pick automatically.
    pub devices: Vec<u32>,
}

/// Why a model cannot be placed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementError(pub String);

impl std::fmt::Display for PlacementError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The devices a model goes on, main device first. Pinned devices must exist and number
/// at least `gpus`; otherwise the `gpus` devices with the most free memory (ties: the
/// lower ordinal) are picked. A node without devices places nothing (CPU engines).
pub fn place(
    snap: &DeviceSnapshot,
    model: &str,
    want: &PlacementRequest,
) -> Result<Vec<u32>, PlacementError> {
    let n = want.gpus.max(1) as usize;
    if snap.devices.is_empty() {
        if want.devices.is_empty() && want.gpus <= 1 {
            return Ok(Vec::new());
        }
        return Err(PlacementError(format!(
            "model `{model}` asks for {} GPU(s){} but this node sees none ({})",
            n,
            pinned_text(&want.devices),
            snap.note.as_deref().unwrap_or("no CUDA device")
        )));
    }
    if !want.devices.is_empty() {
        let missing: Vec<String> = want
            .devices
            .iter()
            .filter(|i| snap.device(**i).is_none())
            .map(u32::to_string)
            .collect();
        if !missing.is_empty() {
            return Err(PlacementError(format!(
                "model `{model}` is pinned to device(s) {} that this node does not see (it sees {}; CUDA_VISIBLE_DEVICES renumbers from 0)",
                missing.join(","),
                seen(snap)
            )));
        }
        if want.devices.len() < n {
            return Err(PlacementError(format!(
                "model `{model}` asks for {n} GPUs but pins only {}",
                pinned_text(&want.devices).trim_start_matches(" on ")
            )));
        }
        return Ok(want.devices.clone());
    }
    if snap.devices.len() < n {
        return Err(PlacementError(format!(
            "model `{model}` asks for {n} GPUs but this node sees {} ({})",
            snap.devices.len(),
            seen(snap)
        )));
    }
    let mut by_free: Vec<&DeviceStatus> = snap.devices.iter().collect();
    by_free.sort_by(|a, b| b.free_bytes.cmp(&a.free_bytes).then(a.index.cmp(&b.index)));
    Ok(by_free.iter().take(n).map(|d| d.index).collect())
}

/// The devices of each of `replicas` engine instances of one model (seed 001: replicas on
/// several GPUs, requests in turn). Pinned devices are split among the replicas in order;
/// otherwise each replica is placed by [`place`] on the devices the replicas before it left,
/// so no two replicas share a device. A node without devices places every replica nowhere
/// (CPU engines: the replicas share the cores).
pub fn place_replicas(
    snap: &DeviceSnapshot,
    model: &str,
    want: &PlacementRequest,
    replicas: u32,
) -> Result<Vec<Vec<u32>>, PlacementError> {
    let r = replicas.max(1) as usize;
    if r == 1 {
        return place(snap, model, want).map(|p| vec![p]);
    }
    if snap.devices.is_empty() && want.devices.is_empty() && want.gpus <= 1 {
        return Ok(vec![Vec::new(); r]);
    }
    if !want.devices.is_empty() {
        if !want.devices.len().is_multiple_of(r) {
            return Err(PlacementError(format!(
                "model `{model}` pins {} device(s), which cannot be split evenly among {r} replicas",
                want.devices.len()
            )));
        }
        let per = want.devices.len() / r;
        return want
            .devices
            .chunks(per)
            .map(|chunk| {
                let one = PlacementRequest {
                    gpus: want.gpus,
                    devices: chunk.to_vec(),
                };
                place(snap, model, &one)
            })
            .collect();
    }
    let n = want.gpus.max(1) as usize;
    if snap.devices.len() < n * r {
        return Err(PlacementError(format!(
            "model `{model}` asks for {r} replicas of {n} GPU(s), {} in all, but this node sees {} ({})",
            n * r,
            snap.devices.len(),
            seen(snap)
        )));
    }
    let mut left = snap.clone();
    let mut out = Vec::with_capacity(r);
    for _ in 0..r {
        let p = place(&left, model, want)?;
        left.devices.retain(|d| !p.contains(&d.index));
        out.push(p);
    }
    Ok(out)
}

fn pinned_text(devices: &[u32]) -> String {
    if devices.is_empty() {
        String::new()
    } else {
        let ids: Vec<String> = devices.iter().map(u32::to_string).collect();
        format!(" on device(s) {}", ids.join(","))
    }
}

fn seen(snap: &DeviceSnapshot) -> String {
    let ids: Vec<String> = snap
        .devices
        .iter()
        .map(|d| format!("{} ({})", d.index, d.name))
        .collect();
    ids.join(", ")
}

/// The fall in free memory on `on` between two snapshots: what a load really took.
pub fn measured_use(before: &DeviceSnapshot, after: &DeviceSnapshot, on: &[u32]) -> Option<u64> {
    if before.devices.is_empty() || after.devices.is_empty() {
        return None;
    }
    Some(before.free_on(on).saturating_sub(after.free_on(on)))
}

/// A warning when the engine's figure and the measured one disagree by more than
/// [`MEASURE_TOLERANCE_PERCENT`] of the larger.
pub fn check_report(model: &str, reported: u64, measured: u64) -> Option<String> {
    let (lo, hi) = (reported.min(measured), reported.max(measured));
    if hi == 0 || (hi - lo) * 100 <= hi * MEASURE_TOLERANCE_PERCENT {
        return None;
    }
    Some(format!(
        "model `{model}`: the engine reports {} of VRAM but the devices' free memory fell by {}; the memory policy counts the larger",
        human(reported),
        human(measured)
    ))
}

#[cfg(test)]
mod tests;
