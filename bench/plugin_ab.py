#!/usr/bin/env python3
"""One node binary, two builds or settings of an engine plugin: does a change cost throughput?

Starts `gantry-node serve` on the same GGUF model with each plugin directory in turn (A: the
build before a change, B: after), or with one directory and two environments (`--a-env`,
`--b-env`: a plugin's switch, e.g. GANTRY_LLAMA_BACKEND_SAMPLING=0 / 1), the response cache off, and measures streaming completions
at each concurrency, greedy and sampled (temperature 0.8, top_p 0.95, top_k 40 unless given),
alternating A and B every round so drift on a shared machine hits both. Reports aggregate
output tok/s and TTFT p50 per side, medians over the rounds, and B/A ratios. Writes JSON.

Usage: bench/plugin_ab.py --node target/release/gantry-node --model gemma.gguf \\
           --a /tmp/plugins-before --b target/release/engines/.. --out bench/results/x.json
       bench/plugin_ab.py ... --a target/release/engines/.. --a-env GANTRY_LLAMA_BACKEND_SAMPLING=0 \
           --b-env GANTRY_LLAMA_BACKEND_SAMPLING=1 --out ...   (B's directory defaults to A's)
(each plugin directory holds `llama_cpp/cpu/` as target/release/engines does).
"""
import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from native_vs_llama_cpp import one_request, run_load
from node_vs_llama_server import Server, free_port

SAMPLINGS = {"greedy": {"temperature": 0},
             "sampled": {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 7}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--a", required=True, help="plugin directory before the change")
    ap.add_argument("--b", help="plugin directory after the change (default: A's)")
    ap.add_argument("--a-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of A's node (repeatable)")
    ap.add_argument("--b-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of B's node (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests-per-slot", type=int, default=2)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    args.b = args.b or args.a
    envs = {side: dict(kv.split("=", 1) for kv in getattr(args, f"{side}_env")) for side in ("a", "b")}
    report = {"benchmark": "plugin_ab", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "model": args.model, "threads": args.threads, "max_tokens": args.max_tokens,
              "a": args.a, "b": args.b, "a_env": envs["a"], "b_env": envs["b"], "samplings": SAMPLINGS, "runs": []}
    samples = {}

    def write():
        report["runs"] = []
        for (conc, name), sides in sorted(samples.items()):
            if not sides["a"] or not sides["b"]:
                continue
            med = lambda side, k: statistics.median(r[k] for r in sides[side])
            row = {"concurrency": conc, "sampling": name, "a": sides["a"], "b": sides["b"],
                   "a_aggregate_tps": med("a", "aggregate_tps"), "b_aggregate_tps": med("b", "aggregate_tps"),
                   "a_ttft_p50_ms": med("a", "ttft_p50_ms"), "b_ttft_p50_ms": med("b", "ttft_p50_ms")}
            row["ratio_aggregate_tps"] = row["b_aggregate_tps"] / row["a_aggregate_tps"]
            report["runs"].append(row)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    for rnd in range(args.rounds):
        order = ("a", "b") if rnd % 2 == 0 else ("b", "a")
        for side in order:
            port = free_port()
            argv = [args.node, "serve", "--model", args.model, "--model-id", "m", "--listen", f"127.0.0.1:{port}",
                    "--threads", str(args.threads), "--max-batch-size", str(max(levels)), "--context-length", "2048",
                    "--request-timeout", "0", "--no-response-cache", "--plugins-dir", getattr(args, side)]
            os.environ.update(envs[side])
            with Server(side, argv, port, "/readyz"):
                one_request(port, "m", "warm", 8)
                for conc in levels:
                    for name, sampling in SAMPLINGS.items():
                        r = run_load(port, "m", conc, conc * args.requests_per_slot, args.max_tokens,
                                     f"{side}-{conc}-{name}-{rnd}-{time.time_ns()}", sampling)
                        samples.setdefault((conc, name), {"a": [], "b": []})[side].append(r)
                        print(f"round {rnd} {side} c={conc} {name}: {r['aggregate_tps']:.1f} tok/s, "
                              f"ttft p50 {r['ttft_p50_ms']:.0f} ms", flush=True)
            for key in envs[side]:
                os.environ.pop(key, None)
            write()
    for row in report["runs"]:
        print(f"c={row['concurrency']} {row['sampling']}: A {row['a_aggregate_tps']:.1f} B {row['b_aggregate_tps']:.1f} "
              f"tok/s, B/A {row['ratio_aggregate_tps']:.3f}")


if __name__ == "__main__":
    main()
