//! Node state, memory sizes (at start-up and before a model load): the RAM budget from the
//! flag, the cgroup or `/proc/meminfo`, and the bytes of a model's weight files.

use std::path::Path;

use gantry_engine_abi::Format;

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

/// The copies the native engine makes of a safetensors model's weights at load, from the
/// `config.json` beside `primary`: what they are and how many times the files' bytes they take
/// at most. FP8 weights dequantized to bf16 (2×), gpt-oss's MXFP4 experts dequantized to bf16
/// (4×: 4.25 bits a value become 16), an unquantized gpt-oss's fused experts rearranged (1×);
/// `None` for a model read in place.
pub fn load_copies(primary: &Path) -> Option<(&'static str, u64)> {
    let dir = if primary.is_dir() {
        primary
    } else {
        primary.parent().unwrap_or(Path::new("."))
    };
    let config = std::fs::read(dir.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())?;
    match config["quantization_config"]["quant_method"].as_str() {
        Some("fp8") => Some(("FP8 dequantized to bf16", 2)),
        Some("mxfp4") => Some(("MXFP4 experts dequantized to bf16", 4)),
        _ if config["architectures"][0] == "GptOssForCausalLM" => {
            Some(("gpt-oss experts rearranged", 1))
        }
        _ => None,
    }
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
        Format::Onnx => size(primary),
    }
}
