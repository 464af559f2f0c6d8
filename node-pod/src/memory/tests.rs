//! Tests of the memory policy's pure decisions and of the RAM and weight sizes they read.

use super::*;
use gantry_engine_abi::Format;

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
    let e =
        plan_load(&l, "huge", Bytes::in_pool(Pool::Vram, 200 * MIB), &[]).expect_err("never fits");
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
fn a_lower_watermark_unloads_sooner() {
    // 1000 MiB at 70 %: 700 MiB. 600 held plus 200 more is over it; at 90 % it was not.
    let resident = [res("a", 600, 1, true)];
    let at = |percent| {
        let limits = limits(1000).with_watermark(percent);
        plan_load(&limits, "new", ram(200 * MIB), &resident).expect("fits after unloading")
    };
    assert!(at(90).is_empty());
    assert_eq!(at(70).len(), 1);
    assert_eq!(
        Limits::for_backend(Backend::Cpu, 0, 1000)
            .with_watermark(70)
            .watermark(Pool::Ram),
        Some(700)
    );
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
fn the_copies_made_at_load_are_known_by_the_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let primary = dir.path().join("model.safetensors");
    std::fs::write(&primary, b"x").expect("write");
    assert_eq!(load_copies(&primary), None, "no config.json");
    let config = |text: &[u8]| {
        std::fs::write(dir.path().join("config.json"), text).expect("write");
        load_copies(&primary).map(|(_, times)| times)
    };
    assert_eq!(
        config(
            br#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}"#
        ),
        Some(2)
    );
    assert_eq!(
        config(br#"{"architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}"#),
        Some(4)
    );
    assert_eq!(
        config(br#"{"architectures": ["GptOssForCausalLM"]}"#),
        Some(1)
    );
    assert_eq!(
        config(br#"{"quantization_config": {"quant_method": "awq"}}"#),
        None
    );
    assert_eq!(config(br#"{"architectures": ["LlamaForCausalLM"]}"#), None);
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
