#!/usr/bin/env python3
"""Density: how many small models one node process serves in a fixed memory budget, and the
latency a request sees when its model was evicted, against one llama-server per model (the
one-model-per-pod layout), in one run.

Gantry: one `gantry-node` with `--ram-limit LIMIT` and a config of N lazily loaded models
(ids m0..m{N-1}, each its own copy of the GGUF file, so that no two models share a page, as
different models would not; the peer gets the same copies). Each model gets one
streaming request in turn (its first token = a cold load), then the first model again (evicted
by then when N models do not fit: a re-load) and the last model again (warm). `/v1/status`
says how many are resident, what they hold and how many were evicted; the process RSS is read
from /proc.

Peer: N llama-server processes started one after the other on the same file with the same
context, threads and batch (what a cluster runs with one pod per model). Each is timed from
exec to the first token of its first request (its cold start, without the container and
scheduling time a pod adds), and all N are kept running to sum their RSS.

Ratios: models served per GiB of RSS (all N answer on both sides; Gantry / peer), models
resident per GiB, and Gantry's re-load first-token latency over the peer's cold start.
Bounded: N ≤ 16, every request 60 s at most. Writes JSON.

Usage: bench/density.py --node target/release/gantry-node --peer "$(bench/build-llama-server.sh)" \
           --model ~/.cache/gantry/models/gemma-3-270m-q4_k_m.gguf --out bench/results/density.json
"""
import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from common import free_port, wait_http

PROMPT = "Name three rivers in Europe and one fact about each."


def first_token_ms(port: int, model: str, max_tokens: int = 8) -> float:
    """Send one streaming chat request; milliseconds until the first content chunk."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"{model}: HTTP {r.status}: {r.read()[:300]!r}")
    first = None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0].get("delta", {})
        if first is None and delta.get("content"):
            first = (time.perf_counter() - t0) * 1000
    if first is None:
        raise SystemExit(f"{model}: no content in the stream")
    return first


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def get_json(port: int, path: str) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    return json.load(c.getresponse())


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_gantry(args, files, log) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "models.yaml"
        lines = ["models:"]
        for i in range(args.models):
            lines += [f"  - id: m{i}", f"    path: {files[i]}", "    format: gguf", "    load: lazy",
                      f"    contextLength: {args.context}", f"    maxBatchSize: {args.batch}",
                      f"    threads: {args.threads}"]
        config.write_text("\n".join(lines) + "\n")
        argv = [args.node, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}",
                "--ram-limit", str(args.ram_limit), "--threads", str(args.threads),
                "--no-response-cache", "--config-reload-seconds", "0"]
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # Ready once every model is inspected (lazy ones wait for their first request).
            wait_http(f"http://127.0.0.1:{port}/readyz", 120)
            rss_start = rss_bytes(p.pid)
            cold, rss_each, used_each = [], [], []
            for i in range(args.models):
                cold.append(first_token_ms(port, f"m{i}"))
                rss_each.append(rss_bytes(p.pid))
                used_each.append(get_json(port, "/v1/status")["memory"]["usedBytes"])
            status = get_json(port, "/v1/status")
            loaded = [m["id"] for m in status["models"] if m["load"]["state"] == "loaded"]
            held = [m["load"]["bytesUsed"] for m in status["models"] if m["load"]["state"] == "loaded"]
            rss = rss_bytes(p.pid)
            reload_ms = first_token_ms(port, "m0")
            warm_ms = first_token_ms(port, f"m{args.models - 1}")
            after = get_json(port, "/v1/status")["memory"]
        finally:
            stop(p)
    return {
        "first_token_ms_cold": [round(x, 1) for x in cold],
        "resident_models": len(loaded),
        "resident": loaded,
        "bytes_per_model_engine_report": max(held) if held else 0,
        "memory": after,
        "rss_bytes": rss,
        "rss_bytes_before_any_load": rss_start,
        "rss_bytes_after_each_first_request": rss_each,
        "accounted_bytes_after_each_first_request": used_each,
        "m0_first_token_ms_again": round(reload_ms, 1),
        "m0_was_evicted": "m0" not in loaded,
        "warm_first_token_ms": round(warm_ms, 1),
    }


def run_peer(args, files, log) -> dict:
    procs, cold, rss = [], [], []
    try:
        for i in range(args.models):
            port = free_port()
            argv = [args.peer, "-m", str(files[i]), "--host", "127.0.0.1", "--port", str(port),
                    "-t", str(args.threads), "-c", str(args.context * args.batch), "-np", str(args.batch)]
            t0 = time.perf_counter()
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            wait_http(f"http://127.0.0.1:{port}/health", 120)
            ready_ms = (time.perf_counter() - t0) * 1000
            cold.append(ready_ms + first_token_ms(port, "m"))
            rss.append(rss_bytes(p.pid))
    finally:
        for p in procs:
            stop(p)
    return {"cold_start_first_token_ms": [round(x, 1) for x in cold], "rss_bytes": rss,
            "rss_bytes_total": sum(rss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--ram-limit", type=int, default=1_500_000_000, help="the node's RAM budget in bytes")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not 1 <= args.models <= 16:
        raise SystemExit("--models must be between 1 and 16")
    log_path = Path(args.out).with_suffix(".log")
    with open(log_path, "w") as log, tempfile.TemporaryDirectory() as copies:
        files = []
        for i in range(args.models):
            f = Path(copies) / f"m{i}.gguf"
            shutil.copyfile(args.model, f)
            files.append(f)
        gantry = run_gantry(args, files, log)
        peer = run_peer(args, files, log)
    gib = 1024 ** 3
    gantry_density = args.models / (gantry["rss_bytes"] / gib)
    gantry_resident = gantry["resident_models"] / (gantry["rss_bytes"] / gib)
    peer_density = args.models / (peer["rss_bytes_total"] / gib)
    peer_cold = sorted(peer["cold_start_first_token_ms"])[len(peer["cold_start_first_token_ms"]) // 2]
    result = {
        "benchmark": "density",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": Path(args.model).name,
        "models": args.models,
        "ram_limit_bytes": args.ram_limit,
        "context_per_sequence": args.context,
        "batch": args.batch,
        "threads": args.threads,
        "gantry": gantry,
        "peer_one_llama_server_per_model": peer,
        "models_served_per_gib_rss": {"gantry": round(gantry_density, 2),
                                      "peer": round(peer_density, 2),
                                      "ratio": round(gantry_density / peer_density, 2)},
        "models_resident_per_gib_rss": {"gantry": round(gantry_resident, 2),
                                        "peer": round(peer_density, 2),
                                        "ratio": round(gantry_resident / peer_density, 2)},
        "evicted_model_first_token_vs_peer_cold_start": {
            "gantry_ms": gantry["m0_first_token_ms_again"], "peer_median_ms": peer_cold,
            "ratio": round(gantry["m0_first_token_ms_again"] / peer_cold, 2)},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"gantry: {gantry['resident_models']} of {args.models} models resident in a "
          f"{args.ram_limit / 1e9:.2f} GB budget, RSS {gantry['rss_bytes'] / 1e6:.0f} MB, "
          f"{gantry['memory'].get('evictionsTotal', 0)} evictions")
    print(f"peer: {args.models} llama-servers, RSS {peer['rss_bytes_total'] / 1e6:.0f} MB in all")
    print(f"models served per GiB of RSS: gantry {gantry_density:.2f}, peer {peer_density:.2f}, "
          f"ratio {gantry_density / peer_density:.2f}; resident per GiB: gantry {gantry_resident:.2f}")
    print(f"first token after eviction: {gantry['m0_first_token_ms_again']:.0f} ms (re-load); "
          f"warm {gantry['warm_first_token_ms']:.0f} ms; peer cold start median {peer_cold:.0f} ms")


if __name__ == "__main__":
    main()
