//! Device policy tests (no GPU needed): budgets, placement and load checks over a recorded
//! snapshot of a two-H100 node, and the no-GPU state.

use std::collections::BTreeMap;

use super::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn req(gpus: u32, devices: &[u32]) -> PlacementRequest {
    PlacementRequest {
        gpus,
        devices: devices.to_vec(),
    }
}

fn h100s() -> DeviceSnapshot {
    serde_json::from_str(include_str!("../../tests/fixtures/devices-2xh100.json"))
        .expect("fixture parses as a DeviceSnapshot")
}

#[test]
fn the_fixture_is_a_two_h100_node_with_one_shared_device() {
    let s = h100s();
    assert_eq!(s.devices.len(), 2);
    assert_eq!(s.devices[0].total_bytes, 81559 * MIB);
    assert_eq!(s.devices[0].compute_capability, "9.0");
    assert_eq!(
        s.devices[0].total_bytes - s.devices[1].free_bytes,
        (487 + 20480) * MIB
    );
}

#[test]
fn no_gpu_is_a_normal_state_with_no_budget_and_cpu_placement() {
    let s = DeviceSnapshot::none("libcuda.so.1 not found");
    assert_eq!(vram_budget(&s, DEFAULT_VRAM_RESERVE_BYTES, 0), None);
    assert_eq!(vram_limit(0, None), 0, "no limit without a device");
    assert_eq!(vram_limit(8 * GIB, None), 8 * GIB);
    assert_eq!(place(&s, "m", &PlacementRequest::default()), Ok(Vec::new()));
    let json = serde_json::to_value(&s).expect("serialize");
    assert_eq!(json["devices"], serde_json::json!([]));
    assert_eq!(json["note"], "libcuda.so.1 not found");
}

#[test]
fn a_model_that_asks_for_a_gpu_on_a_node_without_one_is_refused_with_why() {
    let s = DeviceSnapshot::none("no CUDA driver (libcuda.so.1 not found)");
    let e = place(&s, "big", &req(2, &[])).expect_err("refused");
    assert!(e.0.contains("asks for 2 GPU(s)"), "{e}");
    assert!(e.0.contains("libcuda.so.1 not found"), "{e}");
}

#[test]
fn the_budget_is_every_device_less_the_reserve_less_what_others_hold() {
    let s = h100s();
    // Nothing of ours loaded: the 487 MiB + 487 MiB + 20 GiB in use belong to others.
    let b = vram_budget(&s, GIB, 0).expect("devices");
    assert_eq!(b, 2 * (81559 * MIB - GIB) - (2 * 487 + 20480) * MIB);
    // 10 GiB of that use is ours (our models' reports): it stays in the budget.
    let b2 = vram_budget(&s, GIB, 10 * GIB).expect("devices");
    assert_eq!(b2, b + 10 * GIB);
    // The configured limit binds when smaller, the real budget when the limit is larger.
    assert_eq!(vram_limit(40 * GIB, Some(b)), 40 * GIB);
    assert_eq!(vram_limit(500 * GIB, Some(b)), b);
    assert_eq!(vram_limit(0, Some(b)), b);
}

#[test]
fn the_budget_feeds_the_watermark_policy_and_refuses_before_allocation() {
    use crate::memory::{Bytes, Limits, Pool, Resident, plan_load};
    let s = h100s();
    let budget = vram_budget(&s, GIB, 0);
    let limits = Limits(
        Bytes {
            vram: vram_limit(0, budget),
            ram: 0,
        },
        crate::memory::WATERMARK_PERCENT,
    );
    // 150 GiB of weights do not fit 2 x 80 GB less the reserve and the other process.
    let r = plan_load(&limits, "huge", Bytes::in_pool(Pool::Vram, 150 * GIB), &[])
        .expect_err("refused before allocating");
    assert!(r.never_fits);
    assert!(r.message.starts_with("OOM_VRAM"), "{}", r.message);
    // 130 GiB next to a 20 GiB idle lazy model: together they pass the 90 % watermark of the
    // ~156 GiB budget, so that model goes first (LRU); then it fits.
    let resident = [Resident {
        id: "old".into(),
        held: Bytes::in_pool(Pool::Vram, 20 * GIB),
        last_used: 1,
        evictable: true,
    }];
    let ours = vram_budget(&s, GIB, 20 * GIB);
    let limits = Limits(
        Bytes {
            vram: vram_limit(0, ours),
            ram: 0,
        },
        crate::memory::WATERMARK_PERCENT,
    );
    let unloads = plan_load(
        &limits,
        "new",
        Bytes::in_pool(Pool::Vram, 130 * GIB),
        &resident,
    )
    .expect("fits after the unload");
    assert_eq!(unloads.len(), 1);
    assert_eq!(unloads[0].id, "old");
}

#[test]
fn placement_picks_the_devices_with_the_most_free_memory() {
    let s = h100s();
    let one = place(&s, "m", &PlacementRequest::default()).expect("placed");
    assert_eq!(one, vec![0], "device 0 is idle, device 1 is shared");
    let two = place(&s, "m", &req(2, &[])).expect("placed");
    assert_eq!(two, vec![0, 1], "main device first");
    let e = place(&s, "m", &req(4, &[])).expect_err("only two");
    assert!(e.0.contains("asks for 4 GPUs but this node sees 2"), "{e}");
}

#[test]
fn pinned_devices_are_honoured_or_refused_by_name() {
    let s = h100s();
    let pinned = place(&s, "m", &req(1, &[1])).expect("pinned");
    assert_eq!(pinned, vec![1]);
    let e = place(&s, "m", &req(1, &[3])).expect_err("no device 3");
    assert!(e.0.contains("device(s) 3"), "{e}");
    assert!(e.0.contains("CUDA_VISIBLE_DEVICES"), "{e}");
    let e = place(&s, "m", &req(2, &[1])).expect_err("too few pinned");
    assert!(e.0.contains("asks for 2 GPUs but pins only"), "{e}");
}

#[test]
fn replicas_go_on_distinct_devices_or_are_refused_with_the_count() {
    let s = h100s();
    let two = place_replicas(&s, "m", &PlacementRequest::default(), 2).expect("placed");
    assert_eq!(
        two,
        vec![vec![0], vec![1]],
        "one replica per GPU, most free first"
    );
    let e = place_replicas(&s, "m", &req(2, &[]), 2).expect_err("needs four");
    assert!(
        e.0.contains("asks for 2 replicas of 2 GPU(s), 4 in all, but this node sees 2"),
        "{e}"
    );
    let pinned = place_replicas(&s, "m", &req(1, &[1, 0]), 2).expect("pinned");
    assert_eq!(
        pinned,
        vec![vec![1], vec![0]],
        "pinned devices split in order"
    );
    let e = place_replicas(&s, "m", &req(1, &[0, 1]), 3).expect_err("uneven");
    assert!(
        e.0.contains("cannot be split evenly among 3 replicas"),
        "{e}"
    );
    let cpu = DeviceSnapshot::none("no CUDA driver");
    assert_eq!(
        place_replicas(&cpu, "m", &PlacementRequest::default(), 3),
        Ok(vec![Vec::new(), Vec::new(), Vec::new()]),
        "CPU replicas share the cores"
    );
    assert_eq!(
        place_replicas(&s, "m", &req(1, &[1]), 1),
        place(&s, "m", &req(1, &[1])).map(|p| vec![p]),
        "one replica is the plain placement"
    );
}

#[test]
fn a_load_is_measured_on_its_devices_and_checked_against_the_engine() {
    let before = h100s();
    let mut after = before.clone();
    after.devices[0].free_bytes -= 6 * GIB;
    after.devices[1].free_bytes -= GIB; // someone else, on another device
    assert_eq!(measured_use(&before, &after, &[0]), Some(6 * GIB));
    assert_eq!(measured_use(&before, &after, &[]), Some(7 * GIB));
    assert_eq!(measured_use(&DeviceSnapshot::none("x"), &after, &[0]), None);
    // Within 20 %: quiet. Beyond: a message naming both figures.
    assert_eq!(check_report("m", 5500 * MIB, 6 * GIB), None);
    let w = check_report("m", 3 * GIB, 6 * GIB).expect("disagreement");
    assert!(w.contains("3.0 GiB") && w.contains("6.0 GiB"), "{w}");
}

#[test]
fn devices_list_the_models_placed_on_them() {
    let mut placed = BTreeMap::new();
    placed.insert("a".to_string(), vec![0]);
    placed.insert("b".to_string(), vec![0, 1]);
    let s = h100s().with_models(&placed);
    assert_eq!(s.devices[0].models, vec!["a", "b"]);
    assert_eq!(s.devices[1].models, vec!["b"]);
}

fn node_on(backend: gantry_engine_abi::Backend, vram_limit: u64) -> crate::node::Node {
    // The fixture is compiled in and written out, so the test binary runs away from the
    // source tree too (scripts/gpu-bundle.sh carries it to a GPU machine without cargo).
    let dir = tempfile::tempdir().expect("temp dir");
    let fixture = dir.path().join("devices-2xh100.json");
    std::fs::write(
        &fixture,
        include_str!("../../tests/fixtures/devices-2xh100.json"),
    )
    .expect("writing the fixture");
    let devices = NodeDevices::recorded(&fixture, GIB).expect("fixture");
    let engine = gantry_engine_abi::EngineConfig {
        backend,
        vram_limit_bytes: vram_limit,
        ..Default::default()
    };
    crate::node::Node::new(
        gantry_api::config::NodeConfig::default(),
        "/nonexistent".into(),
        engine,
    )
    .with_devices(devices)
}

#[test]
fn a_cuda_node_budgets_vram_from_its_devices_and_reports_them() {
    let node = node_on(gantry_engine_abi::Backend::Cuda, 0);
    let want = vram_budget(&h100s(), GIB, 0).expect("devices");
    assert_eq!(
        node.limits_now().get(crate::memory::Pool::Vram),
        want,
        "no configured limit: the devices' real budget"
    );
    let capped = node_on(gantry_engine_abi::Backend::Cuda, 16 * GIB);
    assert_eq!(capped.limits_now().get(crate::memory::Pool::Vram), 16 * GIB);
    let status = node.status();
    assert_eq!(status.devices.len(), 2);
    assert_eq!(status.devices[1].free_bytes, 60592 * MIB);
    assert_eq!(status.devices_note, None);
    // The per-device gauges carry the same figures.
    node.metrics.set_devices(&node.devices.snapshot());
    let text = node.metrics.render();
    assert!(
        text.contains(&format!(
            "gantry_vram_total_bytes{{device=\"1\"}} {}",
            81559 * MIB
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "gantry_vram_used_bytes{{device=\"1\"}} {}",
            (487 + 20480) * MIB
        )),
        "{text}"
    );
    assert!(text.contains("gantry_gpu_utilization_percent{device=\"1\"} 37"));
}

#[test]
fn a_cpu_node_does_not_budget_vram_even_beside_a_gpu() {
    let node = node_on(gantry_engine_abi::Backend::Cpu, 0);
    assert_eq!(node.limits_now().get(crate::memory::Pool::Vram), 0);
}
