#!/usr/bin/env python3
"""The native engine vs the llama.cpp plugin: the same node binary, the same bf16 values.

Two `gantry-node serve` processes, one at a time on the CPU: one serves the bf16 safetensors
directory of Gemma 3 270M through the native engine, the other the BF16 GGUF holding exactly
the same values (both made by scripts/setup.sh) through the llama.cpp plugin. 2 threads each,
8 sequences of 2048 tokens, the response cache off. Streaming completions at temperature 0 of
a ~100-token prompt (identical token ids in both engines, tests/python/test_native.py and
engines/native/tests/engine.rs check the tokenizers agree), each ending with its own tag so
only the shared prefix can come from a cache; both engines keep their prefix reuse on (the
native one: GANTRY_NATIVE_PREFIX_CACHE, default on). Concurrency 1, 4, 8; the two nodes
alternate per level so drift on a shared machine hits both alike. Every loop is bounded by a
request count.

Reports aggregate output tokens/s, TTFT p50/p95 and per-request decode tokens/s for each, and
native/llama.cpp ratios. Writes JSON.

Usage: bench/native_vs_llama_cpp.py --node target/release/gantry-node \
           --st "$GANTRY_GEMMA_ST_DIR" --gguf "$GANTRY_GEMMA_BF16_GGUF" --out bench/results/native.json
"""
import argparse
import http.client
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

from node_vs_llama_server import PROMPT, Server, free_port


def one_request(port, model, tag, max_tokens, sampling=None):
    body = {"model": model, "prompt": f"{PROMPT} [request {tag}]\nSummary:", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(sampling or {})}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first = last = None
    usage, buf, chunks = None, b"", 0
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            line = ev.strip()
            if not line.startswith(b"data: ") or line[6:] == b"[DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                if ch.get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    end = time.perf_counter()
    n = (usage or {}).get("completion_tokens", chunks)
    decode = (n - 1) / (last - first) if first and last and last > first and n > 1 else None
    return {"ttft": (first or end) - t0, "tokens": n, "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "decode_tps": decode}


def run_load(port, model, concurrency, requests, max_tokens, tag_base, sampling=None):
    results, lock, counter = [], threading.Lock(), iter(range(requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            res = one_request(port, model, f"{tag_base}-{i}", max_tokens, sampling)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in results)
    decodes = [r["decode_tps"] for r in results if r["decode_tps"]]
    pct = lambda xs, p: xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "wall_s": wall, "output_tokens": tokens, "aggregate_tps": tokens / wall,
            "ttft_p50_ms": pct(ttfts, 50) * 1000, "ttft_p95_ms": pct(ttfts, 95) * 1000,
            "decode_tps_p50": statistics.median(decodes) if decodes else None,
            "prompt_tokens": results[0]["prompt_tokens"] if results else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", required=True)
    ap.add_argument("--st", required=True, help="bf16 safetensors directory")
    ap.add_argument("--gguf", required=True, help="GGUF with the same bf16 values")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2, help="repeat every level; medians are reported")
    ap.add_argument("--node-arg", action="append", default=[],
                    help="extra gantry-node serve argument for both nodes (repeat), e.g. --backend cuda")
    ap.add_argument("--parallel", type=int, default=8, help="sequences open at once per node")
    ap.add_argument("--machine-note", default="other builds and tests ran on the same 2 cores")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    ctx, parallel = 2048, args.parallel

    def argv(model, port):
        return [args.node, "serve", "--model", model, "--model-id", "gemma", "--listen", f"127.0.0.1:{port}",
                "--threads", str(args.threads), "--context-length", str(ctx), "--max-batch-size", str(parallel),
                "--request-timeout", "0", "--no-response-cache", *args.node_arg]

    report = {"benchmark": "native_vs_llama_cpp", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
              "note": args.machine_note},
              "node_args": args.node_arg,
              "model": "Gemma 3 270M, bf16 (dequantized from Q4_K_M)", "threads": args.threads,
              "max_tokens": args.max_tokens, "parallel": parallel, "ctx_per_seq": ctx, "runs": []}
    samples = {c: {"native": [], "llama_cpp": []} for c in levels}

    def write_report(final):
        # Written after every measurement, so a run stopped by a time limit keeps what it measured.
        med = lambda rs, k: statistics.median(r[k] for r in rs)
        report["runs"] = []
        for conc in levels:
            n, l = samples[conc]["native"], samples[conc]["llama_cpp"]
            if not n or not l:
                continue
            row = {"concurrency": conc, "native": n, "llama_cpp": l,
                   "native_aggregate_tps": med(n, "aggregate_tps"), "llama_cpp_aggregate_tps": med(l, "aggregate_tps"),
                   "native_ttft_p50_ms": med(n, "ttft_p50_ms"), "llama_cpp_ttft_p50_ms": med(l, "ttft_p50_ms")}
            row["ratio_aggregate_tps"] = row["native_aggregate_tps"] / row["llama_cpp_aggregate_tps"]
            row["ratio_ttft_p50"] = row["native_ttft_p50_ms"] / row["llama_cpp_ttft_p50_ms"]
            report["runs"].append(row)
            if final:
                print(f"c={conc}: native {row['native_aggregate_tps']:.1f} tok/s ttft {row['native_ttft_p50_ms']:.0f} ms | "
                      f"llama.cpp {row['llama_cpp_aggregate_tps']:.1f} tok/s ttft {row['llama_cpp_ttft_p50_ms']:.0f} ms | "
                      f"ratio tps {row['ratio_aggregate_tps']:.3f} ttft {row['ratio_ttft_p50']:.3f}", flush=True)
        report["complete"] = final
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    for rnd in range(args.rounds):
        for conc in levels:
            for name, model in (("native", args.st), ("llama_cpp", args.gguf)) if rnd % 2 == 0 else \
                    (("llama_cpp", args.gguf), ("native", args.st)):
                port = free_port()
                with Server(f"{name}", argv(model, port), port, "/readyz") as srv:
                    one_request(port, "gemma", "warm", 8)
                    r = run_load(port, "gemma", conc, conc * args.requests_per_slot, args.max_tokens,
                                 f"{name}-{conc}-{rnd}-{time.time_ns()}")
                    r["ready_s"] = srv.ready_s
                    samples[conc][name].append(r)
                    print(f"round {rnd} c={conc} {name}: {r['aggregate_tps']:.1f} tok/s, ttft p50 "
                          f"{r['ttft_p50_ms']:.0f} ms, decode p50 {r['decode_tps_p50'] or 0:.1f} tok/s, "
                          f"ready in {srv.ready_s:.1f} s", flush=True)
            write_report(False)
    write_report(True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
