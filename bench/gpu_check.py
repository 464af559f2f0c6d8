#!/usr/bin/env python3
"""The checks of scripts/gpu-check.sh that compare Gantry's device figures with nvidia-smi's.

  compare-devices SNAPSHOT.json SMI.csv OUT.json
      `gantry-node devices --json` against
      `nvidia-smi --query-gpu=index,uuid,name,compute_cap,memory.total,memory.used,memory.free
       --format=csv,noheader,nounits`: same devices (by UUID), same name and compute
      capability, total within 1 %, free within 5 % or 512 MiB (the two reads are moments
      apart and the probe itself may hold a context).
  compare-vram STATUS.json APPS.csv PID OUT.json
      `/v1/status` of a node that loaded models against
      `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`: what
      the node process holds on the GPU versus the sum of its models' `bytesUsed` (engine
      report) and `measuredVramBytes` (the node's own measurement across each load).

Each writes JSON with the figures and an `ok` per check, prints a summary and exits 1 when a
check fails. Pure functions, tested without a GPU (tests/python/test_gpu_check.py).
"""
import json
import sys
from pathlib import Path

MIB = 1 << 20


def parse_smi_gpus(text: str) -> list[dict]:
    """Rows of `nvidia-smi --query-gpu=index,uuid,name,compute_cap,memory.total,memory.used,memory.free`."""
    rows = []
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        index, uuid, name, cc, total, used, free = [c.strip() for c in line.split(",")]
        rows.append({
            "index": int(index),
            "uuid": uuid,
            "name": name,
            "compute_capability": cc,
            "total_bytes": int(float(total)) * MIB,
            "used_bytes": int(float(used)) * MIB,
            "free_bytes": int(float(free)) * MIB,
        })
    return rows


def parse_smi_apps(text: str) -> dict[int, int]:
    """`pid -> bytes` from `nvidia-smi --query-compute-apps=pid,used_memory` (summed over GPUs)."""
    out: dict[int, int] = {}
    for line in text.strip().splitlines():
        if not line.strip() or "No running" in line:
            continue
        pid, used = [c.strip() for c in line.split(",")]
        out[int(pid)] = out.get(int(pid), 0) + int(float(used)) * MIB
    return out


def within(a: int, b: int, rel: float, floor: int = 0) -> bool:
    return abs(a - b) <= max(rel * max(a, b), floor)


def compare_devices(snapshot: dict, smi: list[dict]) -> dict:
    by_uuid = {r["uuid"]: r for r in smi}
    devices, ok = [], len(snapshot.get("devices", [])) == len(smi)
    for d in snapshot.get("devices", []):
        r = by_uuid.get(d.get("uuid"))
        row = {"index": d["index"], "uuid": d.get("uuid"), "name": d["name"]}
        if r is None:
            row["ok"] = False
            row["why"] = "nvidia-smi does not list this UUID"
        else:
            row.update({
                "gantry_total_bytes": d["totalBytes"],
                "smi_total_bytes": r["total_bytes"],
                "gantry_free_bytes": d["freeBytes"],
                "smi_free_bytes": r["free_bytes"],
                "name_ok": d["name"] == r["name"],
                "compute_capability_ok": d["computeCapability"] == r["compute_capability"],
                "total_ok": within(d["totalBytes"], r["total_bytes"], 0.01),
                "free_ok": within(d["freeBytes"], r["free_bytes"], 0.05, 512 * MIB),
            })
            row["ok"] = all(row[k] for k in ("name_ok", "compute_capability_ok", "total_ok", "free_ok"))
        ok &= row["ok"]
        devices.append(row)
    return {"check": "devices", "ok": ok, "gantry_devices": len(snapshot.get("devices", [])),
            "smi_devices": len(smi), "devices": devices}


def compare_vram(status: dict, apps: dict[int, int], pid: int) -> dict:
    models = [m for m in status.get("models", []) if m.get("load", {}).get("state") == "loaded"]
    reported = sum(m["load"].get("bytesUsed", 0) for m in models)
    measured = sum(m["load"].get("measuredVramBytes", 0) or 0 for m in models)
    held = apps.get(pid)
    out = {
        "check": "vram",
        "models": [{"id": m["id"], "devices": m.get("devices", []), "bytes_used": m["load"].get("bytesUsed", 0),
                    "measured_vram_bytes": m["load"].get("measuredVramBytes")} for m in models],
        "engine_reported_bytes": reported,
        "node_measured_bytes": measured,
        "smi_process_bytes": held,
    }
    if held is None:
        out.update(ok=False, why=f"nvidia-smi lists no compute process with pid {pid}")
        return out
    # The process also holds its CUDA context and cuBLAS workspaces (the reserve), so it
    # holds more than its models; the models' figures must not exceed it, and the measured
    # one must come within the reserve of it.
    out["reported_ok"] = reported <= held
    out["measured_ok"] = measured <= held and held - measured <= 1536 * MIB
    out["ok"] = out["reported_ok"] and out["measured_ok"] and bool(models)
    return out


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "compare-devices":
        snap = json.loads(Path(argv[1]).read_text())
        result = compare_devices(snap, parse_smi_gpus(Path(argv[2]).read_text()))
        out = argv[3]
    elif len(argv) >= 5 and argv[0] == "compare-vram":
        status = json.loads(Path(argv[1]).read_text())
        result = compare_vram(status, parse_smi_apps(Path(argv[2]).read_text()), int(argv[3]))
        out = argv[4]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['check']}: {'ok' if result['ok'] else 'FAILED'} ({out})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
