#!/usr/bin/env python3
"""Engine isolation: the node with its plugin in process vs in a worker process, one run.

Two `gantry-node serve` processes on the same machine serve the same model with the same
flags (threads, batch, context, response cache off, prompt cache on in both), the only
difference being `--isolation inProcess` vs `--isolation process`. Streaming chat requests
at temperature 0, each ending with its own tag (the bench of node_vs_llama_server.py, whose
request and load helpers this reuses), at concurrency 1, 4 and 8. The runs alternate
A-B-B-A per level so drift on a shared machine hits both modes alike; each mode's figure
is the mean of its two runs.

Reports per mode and level: aggregate output tokens/s, TTFT p50/p95, decode tokens/s p50;
the ratio process/inProcess for throughput (target >= 0.97) and the TTFT p50 difference
in ms (target < 1 ms); and each mode's model load seconds. Writes JSON.

Usage: bench/isolation.py --node target/release/gantry-node --model gemma.gguf \
           --out bench/results/isolation.json
"""
import argparse
import http.client
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_vs_llama_server import Server, free_port, one_request, run_load  # noqa: E402

MODES = ("inProcess", "process")


def load_seconds(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    m = re.search(r'^gantry_model_load_seconds\{model="gemma"\} ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else None


def worker_pids(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/v1/status")
    s = json.loads(c.getresponse().read())
    return [r.get("workerPid") for m in s["models"] for r in m.get("replicas", [])]


def mean(rows, key):
    xs = [r[key] for r in rows if r.get(key) is not None]
    return sum(xs) / len(xs) if xs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-slot", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]

    ports = {m: free_port() for m in MODES}

    def argv(mode):
        return [args.node, "serve", "--model", args.model, "--model-id", "gemma",
                "--listen", f"127.0.0.1:{ports[mode]}", "--threads", str(args.threads),
                "--context-length", "4096", "--max-batch-size", str(args.parallel),
                "--request-timeout", "0", "--no-response-cache", "--isolation", mode]

    report = {
        "benchmark": "isolation",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": Path(args.model).name,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "parallel": args.parallel,
        "caches": "response cache off in both; prompt (KV prefix) cache on in both",
        "order": "A-B-B-A per level (A = inProcess)",
        "levels": [],
    }
    with Server("gantry-inprocess", argv("inProcess"), ports["inProcess"], "/readyz"), \
            Server("gantry-process", argv("process"), ports["process"], "/readyz"):
        pids = worker_pids(ports["process"])
        if not pids or pids[0] is None:
            raise SystemExit(f"the process-mode node reports no worker: {pids}")
        if any(p is not None for p in worker_pids(ports["inProcess"])):
            raise SystemExit("the in-process node reports a worker")
        report["load_seconds"] = {m: load_seconds(ports[m]) for m in MODES}
        report["worker_pid"] = pids[0]
        for m in MODES:
            one_request(ports[m], "gemma", f"warm-{m}", None, 8)
        for conc in levels:
            n = conc * args.requests_per_slot
            runs = {m: [] for m in MODES}
            for i, mode in enumerate(("inProcess", "process", "process", "inProcess")):
                tag = f"c{conc}-{mode}-{i}-{time.time_ns()}"
                runs[mode].append(run_load(ports[mode], "gemma", conc, n, None, args.max_tokens, tag))
            agg = {m: {k: mean(runs[m], k) for k in ("aggregate_tps", "ttft_p50_ms", "ttft_p95_ms", "decode_tps_p50")}
                   for m in MODES}
            row = {
                "concurrency": conc,
                "requests_per_run": n,
                "runs": runs,
                "mean": agg,
                "ratio_aggregate_tps": agg["process"]["aggregate_tps"] / agg["inProcess"]["aggregate_tps"],
                "ratio_decode_tps_p50": agg["process"]["decode_tps_p50"] / agg["inProcess"]["decode_tps_p50"],
                "ttft_p50_delta_ms": agg["process"]["ttft_p50_ms"] - agg["inProcess"]["ttft_p50_ms"],
            }
            report["levels"].append(row)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
            print(f"c={conc}: inProcess {agg['inProcess']['aggregate_tps']:.1f} tok/s ttft50 "
                  f"{agg['inProcess']['ttft_p50_ms']:.1f} ms | process {agg['process']['aggregate_tps']:.1f} tok/s "
                  f"ttft50 {agg['process']['ttft_p50_ms']:.1f} ms | ratio tps {row['ratio_aggregate_tps']:.3f} "
                  f"ttft +{row['ttft_p50_delta_ms']:.2f} ms", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"load seconds: {report['load_seconds']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
