#!/usr/bin/env python3
"""The summary of scripts/gpu-decode.sh: one JSON from the phases' outputs.

    bench/gpu_decode.py OUT_DIR SUMMARY.json

Reads native-gemma.json and the native engine's variants (native-gemma-nographs.json,
-nogemv, -gemvsplit; native-llama8b-nogemv.json, -gemvsplit) (engines/native/examples/decode_bench.rs),
torch-gemma.json and the llama8b pair (bench/torch_decode.py) where they exist, and writes a
row per concurrency with each side's figures under the key that names it: `native`, `torch`
(`graph`, `compiled`, and the better of the two), `llama_cpp` (null: not part of this check),
and the ratio of native to the better PyTorch loop. For the 8B shape, native's fraction of the
bandwidth roofline that bench/torch_decode.py computes for the same batch. Where the ncu phase
ran (ncu-*.csv, Nsight Compute's CSV), each kernel's launches over the last two decode steps
(a step ends with its `sample` launch): count, microseconds per step and DRAM bytes per step.
"""
import csv
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


def rows_for(native, torch, variants=None):
    """variants: {key: report} of the native engine run otherwise (graphs off, products on
    cuBLAS, gemv unsplit), each put in the row of its concurrency under its key."""
    nat, tor = by_batch(native), torch_rows(torch)
    var = {k: by_batch(v) for k, v in (variants or {}).items()}
    out = []
    for c in sorted(set(nat) | set(tor) | {c for rows in var.values() for c in rows}):
        t = {m: side(r) for m, r in tor.get(c, {}).items()}
        figures = [v["aggregate_tps"] for v in t.values() if v and "aggregate_tps" in v]
        best = max(figures) if figures else None
        if best is not None:
            t["best_aggregate_tps"] = best
        n = side(nat.get(c))
        row = {"concurrency": c, "native": n, "torch": t or None, "llama_cpp": None}
        for key, rows in var.items():
            if rows.get(c):
                row[key] = side(rows[c])
        if n and "aggregate_tps" in n and best:
            row["ratio_native_to_best_torch"] = n["aggregate_tps"] / best
        roof = next((r.get("roofline_tps") for r in tor.get(c, {}).values() if r.get("roofline_tps")), None)
        if roof and n and "aggregate_tps" in n:
            row["roofline_tps"] = roof
            row["native_roofline_fraction"] = n["aggregate_tps"] / roof
        out.append(row)
    return out


# Nsight Compute's units, both spellings (2025 versions write "ns", older ones "nsecond").
UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "s": 1e6, "second": 1e6, "byte": 1.0, "B": 1.0, "Kbyte": 1e3, "KB": 1e3,
         "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}


def ncu_summary(path):
    """Per kernel, over the last two decode steps of an ncu CSV: launches, us and bytes per step."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.startswith('"')]
    except OSError:
        return None
    launches = {}
    for row in csv.DictReader(lines):
        try:
            value = float(row["Metric Value"].replace(",", "")) * UNITS[row["Metric Unit"]]
        except (KeyError, ValueError):
            continue
        k = launches.setdefault(int(row["ID"]), {"kernel": row["Kernel Name"].split("(")[0]})
        k[row["Metric Name"]] = value
    order = [launches[i] for i in sorted(launches)]
    ends = [i for i, k in enumerate(order) if k["kernel"] == "sample"]
    if len(ends) < 3:
        return {"error": f"{len(ends)} sampler launches: fewer than two whole steps"}
    steps = order[ends[-3] + 1:ends[-1] + 1]
    out = {}
    for k in steps:
        name = k["kernel"] if len(k["kernel"]) <= 60 else k["kernel"][:60] + "..."
        s = out.setdefault(name, {"launches_per_step": 0, "us_per_step": 0.0, "dram_bytes_per_step": 0.0})
        s["launches_per_step"] += 0.5
        s["us_per_step"] += k.get("gpu__time_duration.sum", 0.0) / 2
        s["dram_bytes_per_step"] += (k.get("dram__bytes_read.sum", 0.0) + k.get("dram__bytes_write.sum", 0.0)) / 2
    total = sum(v["us_per_step"] for v in out.values())
    return {"kernels_per_step": len(steps) / 2, "us_per_step": total,
            "by_kernel": dict(sorted(out.items(), key=lambda kv: -kv[1]["us_per_step"]))}


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
        "ncu": {label: ncu_summary(out_dir / f"ncu-{label}.csv")
                for label in ("gemma-c1", "gemma-c64", "llama8b-c1")
                if (out_dir / f"ncu-{label}.csv").exists()},
        "llama_cpp": "not part of this check (the llama.cpp CUDA plugin's figures are bench/results/gpu-check-h100.json)",
        "gemma3_270m": rows_for(load(out_dir / "native-gemma.json"), tg, {
            "native_no_graphs": load(out_dir / "native-gemma-nographs.json"),
            "native_products_on_cublas": load(out_dir / "native-gemma-nogemv.json"),
            "native_gemv_unsplit": load(out_dir / "native-gemma-gemvsplit.json")}),
        "llama3_8b": rows_for(load(out_dir / "native-llama8b.json"), load(out_dir / "torch-llama8b.json"), {
            "native_products_on_cublas": load(out_dir / "native-llama8b-nogemv.json"),
            "native_gemv_unsplit": load(out_dir / "native-llama8b-gemvsplit.json")}),
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
