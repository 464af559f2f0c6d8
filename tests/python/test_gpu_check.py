"""The GPU check's CPU-side parts (scripts/gpu-check.sh, bench/gpu_check.py), without a GPU:
its comparisons against nvidia-smi on recorded readings, its honest refusal on a machine with
no GPU, and `gantry-node devices` reporting no GPU as a normal state."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from k8s import ROOT, binary

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

MIB = 1 << 20
SNAPSHOT = json.loads((ROOT / "node-pod/tests/fixtures/devices-2xh100.json").read_text())
# nvidia-smi's view of the same node, as `--query-gpu=...,memory.total,memory.used,memory.free
# --format=csv,noheader,nounits` prints it (MiB).
SMI = """0, GPU-2f8d6c3a-5b1e-7c44-9a0d-3e6f1b2c4d5e, NVIDIA H100 80GB HBM3, 9.0, 81559, 487, 81072
1, GPU-7a1b3c5d-9e2f-4a6b-8c0d-1e3f5a7b9c2d, NVIDIA H100 80GB HBM3, 9.0, 81559, 20967, 60592
"""


def test_nvidia_smi_rows_are_read_in_bytes():
    rows = gpu_check.parse_smi_gpus(SMI)
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[1]["free_bytes"] == 60592 * MIB
    assert rows[0]["compute_capability"] == "9.0"


def test_matching_readings_pass_and_every_device_is_compared():
    r = gpu_check.compare_devices(SNAPSHOT, gpu_check.parse_smi_gpus(SMI))
    assert r["ok"], r
    assert len(r["devices"]) == 2
    assert all(d["total_ok"] and d["free_ok"] for d in r["devices"])


def test_a_wrong_total_a_missing_device_or_a_stranger_fail():
    wrong = json.loads(json.dumps(SNAPSHOT))
    wrong["devices"][0]["totalBytes"] = 40960 * MIB
    r = gpu_check.compare_devices(wrong, gpu_check.parse_smi_gpus(SMI))
    assert not r["ok"] and not r["devices"][0]["total_ok"]
    one = gpu_check.parse_smi_gpus(SMI)[:1]
    assert not gpu_check.compare_devices(SNAPSHOT, one)["ok"]
    stranger = json.loads(json.dumps(SNAPSHOT))
    stranger["devices"][1]["uuid"] = "GPU-00000000-0000-0000-0000-000000000000"
    r = gpu_check.compare_devices(stranger, gpu_check.parse_smi_gpus(SMI))
    assert not r["ok"] and "UUID" in r["devices"][1]["why"]


def test_vram_figures_are_checked_against_the_process_memory():
    status = {"models": [{"id": "gemma", "devices": [0], "load": {
        "state": "loaded", "bytesUsed": 300 * MIB, "measuredVramBytes": 700 * MIB}}]}
    apps = gpu_check.parse_smi_apps("4242, 1210\n777, 20480\n")
    r = gpu_check.compare_vram(status, apps, 4242)
    assert r["ok"], r
    assert r["smi_process_bytes"] == 1210 * MIB
    # A model that claims more than the process holds is a lie.
    status["models"][0]["load"]["bytesUsed"] = 4096 * MIB
    assert not gpu_check.compare_vram(status, apps, 4242)["reported_ok"]
    # No process with our pid: say so.
    r = gpu_check.compare_vram(status, apps, 1)
    assert not r["ok"] and "pid 1" in r["why"]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU: run scripts/gpu-check.sh itself")
def test_the_check_refuses_to_pass_without_a_gpu(tmp_path):
    out = tmp_path / "gpu"
    p = subprocess.run([str(ROOT / "scripts/gpu-check.sh"), str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "no NVIDIA GPU" in p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"]["gpu"]["outcome"] == "not-run"


def test_the_node_reports_no_gpu_as_a_normal_state():
    p = subprocess.run([str(binary("gantry-node")), "devices", "--json"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GANTRY_LOG": "warn"})
    assert p.returncode == 0, p.stderr
    snap = json.loads(p.stdout)
    if shutil.which("nvidia-smi") is None:
        assert snap["devices"] == [] and snap["source"] == "none"
        assert snap["note"], "an empty answer says why"
    else:
        assert snap["devices"], snap
