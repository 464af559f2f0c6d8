//! Engine host, hardware probe (node start, each metrics refresh, before and after every model
//! load): reads the GPUs this process sees through the CUDA driver API (`cudarc`, loaded at
//! run time) and, where the NVIDIA management library is present, their utilisation and
//! this process's share of their memory.
//!
//! The node builds and runs without CUDA: a missing `libcuda.so`, a driver without a device,
//! or a driver error give [`DeviceSnapshot::none`] with the reason. cudarc panics when a
//! symbol is missing from an old driver; the probe catches that and reports it the same way.
//! `CUDA_VISIBLE_DEVICES` is applied by the driver itself, so ordinals are this process's.
//! NVML numbers devices its own way and ignores `CUDA_VISIBLE_DEVICES`, so its figures are
//! matched to CUDA devices by UUID.

use std::sync::OnceLock;

use cudarc::driver::CudaContext;
use gantry_api::DeviceStatus;

use gantry_api::DeviceSnapshot;

/// Read every visible GPU now. Never fails: no GPU is a snapshot with a note.
///
/// Each device's free memory comes from NVML when it is present (no CUDA context needed);
/// otherwise from `cuMemGetInfo` in the device's primary context, retained for the call
/// (free when an engine already holds it, a context creation otherwise).
pub fn probe() -> DeviceSnapshot {
    match std::panic::catch_unwind(probe_inner) {
        Ok(s) => s,
        Err(p) => {
            let why = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            DeviceSnapshot::none(format!("the CUDA driver could not be used: {why}"))
        }
    }
}

fn probe_inner() -> DeviceSnapshot {
    // SAFETY: only tries to dlopen the driver library by its usual names and drops the
    // handles; loading libcuda runs no code of ours.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return DeviceSnapshot::none("no CUDA driver (libcuda.so not found)");
    }
    if let Err(e) = cudarc::driver::result::init() {
        return DeviceSnapshot::none(format!("the CUDA driver did not initialise: {e:?}"));
    }
    let count = match CudaContext::device_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) => return DeviceSnapshot::none(format!("cuDeviceGetCount failed: {e:?}")),
    };
    if count == 0 {
        return DeviceSnapshot::none("the CUDA driver sees no device");
    }
    let nvml = nvml();
    let mut devices = Vec::with_capacity(count);
    for i in 0..count {
        match read_device(i, nvml) {
            Ok(d) => devices.push(d),
            Err(e) => tracing::warn!(device = i, error = %e, "could not read a CUDA device"),
        }
    }
    if devices.is_empty() {
        return DeviceSnapshot::none("no CUDA device could be read (see the log)");
    }
    DeviceSnapshot {
        source: if nvml.is_some() {
            "cuda+nvml".into()
        } else {
            "cuda".into()
        },
        driver_version: driver_version(),
        devices,
        note: None,
    }
}

fn read_device(ordinal: usize, nvml: Option<&nvml_wrapper::Nvml>) -> Result<DeviceStatus, String> {
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("{e:?}"))?;
    let name = ctx.name().map_err(|e| format!("{e:?}"))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| format!("{e:?}"))?;
    let uuid = ctx.uuid().ok().map(|u| format_uuid(&u.bytes));
    let on_nvml = nvml.and_then(|n| {
        uuid.as_ref()
            .and_then(|u| n.device_by_uuid(u.as_str()).ok())
    });
    let (free, total) = match on_nvml.as_ref().and_then(|d| d.memory_info().ok()) {
        Some(m) => (m.free, m.total),
        None => {
            let (f, t) = ctx.mem_get_info().map_err(|e| format!("{e:?}"))?;
            (f as u64, t as u64)
        }
    };
    let utilization_percent = on_nvml
        .as_ref()
        .and_then(|d| d.utilization_rates().ok())
        .map(|u| u.gpu);
    let me = std::process::id();
    let process_used_bytes = on_nvml
        .as_ref()
        .and_then(|d| d.running_compute_processes().ok())
        .and_then(|ps| {
            ps.into_iter()
                .find(|p| p.pid == me)
                .map(|p| match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                })
        });
    Ok(DeviceStatus {
        index: ordinal as u32,
        uuid,
        name,
        compute_capability: format!("{major}.{minor}"),
        total_bytes: total,
        free_bytes: free,
        utilization_percent,
        process_used_bytes,
        models: Vec::new(),
    })
}

/// NVML, initialised once; `None` when the library is absent or refuses.
fn nvml() -> Option<&'static nvml_wrapper::Nvml> {
    static NVML: OnceLock<Option<nvml_wrapper::Nvml>> = OnceLock::new();
    NVML.get_or_init(|| match nvml_wrapper::Nvml::init() {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::info!(error = %e, "NVML is not available: no GPU utilisation or per-process memory figures");
            None
        }
    })
    .as_ref()
}

fn driver_version() -> Option<String> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: `cuDriverGetVersion` writes one int through a valid pointer; the driver
    // library is loaded (the probe checked it before calling here).
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    Some(format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, the form `nvidia-smi -L` and NVML use.
fn format_uuid(b: &[std::ffi::c_char; 16]) -> String {
    let h: Vec<String> = b.iter().map(|x| format!("{:02x}", *x as u8)).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_print_as_nvidia_smi_prints_them() {
        let mut b = [0 as std::ffi::c_char; 16];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8 * 17) as std::ffi::c_char;
        }
        assert_eq!(format_uuid(&b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

    #[test]
    fn the_probe_never_fails_and_explains_an_empty_answer() {
        // On a machine without a GPU (CI) this is the no-GPU path; on a GPU machine it
        // reads real devices. Either way: devices, or a note saying why there are none.
        let s = probe();
        if s.devices.is_empty() {
            let note = s.note.as_deref().unwrap_or("");
            assert!(!note.is_empty(), "an empty snapshot must say why");
            assert_eq!(s.source, "none");
        } else {
            assert!(s.note.is_none());
            for d in &s.devices {
                assert!(d.total_bytes > 0 && d.free_bytes <= d.total_bytes, "{d:?}");
                assert!(d.compute_capability.contains('.'), "{d:?}");
            }
        }
    }
}
