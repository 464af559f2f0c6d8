#!/usr/bin/env python3
"""The summary of scripts/gpu-decode.sh: one JSON from the phases' outputs.

    bench/gpu_decode.py OUT_DIR SUMMARY.json

Reads native-gemma.json, native-gemma-nographs.json (engines/native/examples/decode_bench.rs),
torch-gemma.json and the llama8b pair (bench/torch_decode.py) where they exist, and writes a
row per concurrency with each side's figures under the key that names it: `native`, `torch`
(`graph`, `compiled`, and the better of the two), `llama_cpp` (null: not part of this check),
and the ratio of native to the better PyTorch loop. For the 8B shape, native's fraction of the
bandwidth roofline that bench/torch_decode.py computes for the same batch.
"""
import json
import sys
from pathlib import Path

KEYS = ("aggregate_tps", "ms_per_step", "step_ms_p50", "step_ms_p99", "ttft_ms_p50", "ttft_ms_p99")


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def by_batch(report):
    return {r["batch"]: r for r in (report or {}).get("rows", []) if r.get("batch") is not None}


def torch_rows(report):
    rows = {}
    for r in (report or {}).get("rows", []):
        rows.setdefault(r["batch"], {})[r["mode"]] = r
    return rows


def side(row):
    if not row:
        return None
    if row.get("error") or row.get("aggregate_tps") is None:
        return {"error": row.get("error") or row.get("skipped") or "no figure"}
    return {k: row.get(k) for k in KEYS if row.get(k) is not None}


def rows_for(native, torch, nographs=None):
    nat, tor, nog = by_batch(native), torch_rows(torch), by_batch(nographs)
    out = []
    for c in sorted(set(nat) | set(tor)):
        t = {m: side(r) for m, r in tor.get(c, {}).items()}
        figures = [v["aggregate_tps"] for v in t.values() if v and "aggregate_tps" in v]
        best = max(figures) if figures else None
        if best is not None:
            t["best_aggregate_tps"] = best
        n = side(nat.get(c))
        row = {"concurrency": c, "native": n, "torch": t or None, "llama_cpp": None}
        if nog.get(c):
            row["native_no_graphs"] = side(nog[c])
        if n and "aggregate_tps" in n and best:
            row["ratio_native_to_best_torch"] = n["aggregate_tps"] / best
        roof = next((r.get("roofline_tps") for r in tor.get(c, {}).values() if r.get("roofline_tps")), None)
        if roof and n and "aggregate_tps" in n:
            row["roofline_tps"] = roof
            row["native_roofline_fraction"] = n["aggregate_tps"] / roof
        out.append(row)
    return out


def main():
    out_dir, summary = Path(sys.argv[1]), Path(sys.argv[2])
    smi = (out_dir / "nvidia-smi.txt").read_text().strip() if (out_dir / "nvidia-smi.txt").exists() else None
    phases = (out_dir / "phases.txt").read_text().split("\n") if (out_dir / "phases.txt").exists() else []
    tg = load(out_dir / "torch-gemma.json")
    text = lambda name: (out_dir / name).read_text() if (out_dir / name).exists() else ""
    profile = [line.split("gantry-engine-native: ", 1)[1] for line in text("bench.log").splitlines()
               if "gantry-engine-native: step profile" in line]
    tests = [line for line in text("tests.txt").splitlines() if line.startswith("test ") or "chi-square" in line
             or "test result" in line]
    report = {
        "check": "scripts/gpu-decode.sh",
        "device": smi,
        "torch": (tg or {}).get("torch"),
        "bundle": text("bundle.txt").strip().splitlines(),
        "phases": dict(p.split(" ", 1) for p in phases if " " in p),
        "tests": tests,
        "native_step_profile": profile,
        "llama_cpp": "not part of this check (the llama.cpp CUDA plugin's figures are bench/results/gpu-check-h100.json)",
        "gemma3_270m": rows_for(load(out_dir / "native-gemma.json"), tg,
                                load(out_dir / "native-gemma-nographs.json")),
        "llama3_8b": rows_for(load(out_dir / "native-llama8b.json"), load(out_dir / "torch-llama8b.json")),
    }
    summary.write_text(json.dumps(report, indent=2) + "\n")
    for shape in ("gemma3_270m", "llama3_8b"):
        for r in report[shape]:
            n = (r["native"] or {}).get("aggregate_tps")
            b = (r["torch"] or {}).get("best_aggregate_tps")
            print(f"{shape} c={r['concurrency']}: native {n} tok/s, best torch {b} tok/s, "
                  f"ratio {r.get('ratio_native_to_best_torch')}")


if __name__ == "__main__":
    main()
