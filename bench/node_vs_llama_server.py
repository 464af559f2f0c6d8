#!/usr/bin/env python3
"""Gantry node vs llama.cpp's llama-server: same model, same machine, same load, one run.

Both servers get Gemma 3 270M Q4_K_M, 2 threads, 8 parallel sequences with a
4096-token context each, and streaming chat requests at temperature 0 with a
~110-token prompt and max_tokens 128. Every request ends with its own tag
(` [request 17]`), so Gantry's response cache can never answer from memory and
the comparison measures the engine path. Concurrency 1, 4 and 8, each with the
peer's prompt cache on and off (`cache_prompt`). The runs alternate between
the servers so drift on a shared machine hits both alike.

Reports per server and setting: aggregate output tokens/s, TTFT p50/p95 and
per-request decode tokens/s; and Gantry/peer ratios. Writes JSON.

Usage: bench/node_vs_llama_server.py --node target/release/gantry-node \
           --peer "$(bench/build-llama-server.sh)" --model gemma.gguf --out bench/results/node.json
"""
import argparse
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path
from common import free_port, wait_http

PROMPT = (
    "Read these notes and summarise them in three sentences. The city council met on Tuesday "
    "to discuss the new library, the repair of the old bridge over the river, and a plan to "
    "plant two hundred trees along the main street before winter. Residents asked about the "
    "cost of the library and about parking near the market square. The engineer said the "
    "bridge can stay open if traffic is limited to one lane."
)


def one_request(port, model, tag, cache_prompt, max_tokens):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{PROMPT} [request {tag}]"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cache_prompt is not None:
        body["cache_prompt"] = cache_prompt
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first = None
    last = None
    tokens = 0
    usage = None
    buf = b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            line = ev.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                continue
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                content = ch.get("delta", {}).get("content")
                if content:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    last = now
                    tokens += 1
    end = time.perf_counter()
    completion = (usage or {}).get("completion_tokens", tokens)
    prompt = (usage or {}).get("prompt_tokens")
    ttft = (first or end) - t0
    decode = (completion - 1) / (last - first) if first and last and last > first and completion > 1 else None
    return {"ttft": ttft, "tokens": completion, "prompt_tokens": prompt, "decode_tps": decode, "seconds": end - t0}


def run_load(port, model, concurrency, requests, cache_prompt, max_tokens, tag_base):
    results = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            res = one_request(port, model, f"{tag_base}-{i}", cache_prompt, max_tokens)
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
    tokens = sum(r["tokens"] for r in results)

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    return {
        "requests": len(results),
        "wall_s": wall,
        "output_tokens": tokens,
        "aggregate_tps": tokens / wall,
        "ttft_p50_ms": pct(ttfts, 50) * 1000,
        "ttft_p95_ms": pct(ttfts, 95) * 1000,
        "decode_tps_p50": statistics.median(decodes) if decodes else None,
        "prompt_tokens": results[0]["prompt_tokens"] if results else None,
    }


class Server:
    def __init__(self, name, argv, port, health):
        self.name, self.argv, self.port, self.health = name, argv, port, health
        self.proc = None

    def __enter__(self):
        self.log = open(f"/tmp/bench-{self.name}.log", "w")
        t0 = time.time()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(f"http://127.0.0.1:{self.port}{self.health}")
        self.ready_s = time.time() - t0
        return self

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def cold_start(node_bin, model, runs=5):
    """Seconds from exec to the first 200 from /healthz (no model load needed)."""
    times = []
    for _ in range(runs):
        port = free_port()
        t0 = time.perf_counter()
        p = subprocess.Popen([node_bin, "serve", "--model", model, "--listen", f"127.0.0.1:{port}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                c.request("GET", "/healthz")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.001)
        times.append(time.perf_counter() - t0)
        p.terminate()
        p.wait()
    return {"runs": runs, "min_s": min(times), "median_s": statistics.median(times), "max_s": max(times)}


def engine_events(port):
    """The node's `gantry_engine_events_total` by event (the engine's graphs built and reused,
    ABI 1.12), summed over its models; the scheduler refreshes them about once a second."""
    import re
    import urllib.request

    out = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("gantry_engine_events_total{"):
                event = re.search(r'event="([^"]+)"', line).group(1)
                out[event] = out.get(event, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", required=True)
    ap.add_argument("--peer", required=True, help="llama-server binary")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-slot", type=int, default=3, help="requests per concurrent client")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--parallel", type=int, default=8,
                    help="sequences each server runs at once (node --max-batch-size, llama-server -np)")
    ap.add_argument("--node-arg", action="append", default=[], help="extra gantry-node serve argument")
    ap.add_argument("--peer-arg", action="append", default=[], help="extra llama-server argument (e.g. -ngl 999 on CUDA)")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    ctx_per_seq, parallel = 4096, args.parallel

    node_port, peer_port = free_port(), free_port()
    node_argv = [args.node, "serve", "--model", args.model, "--model-id", "gemma", "--listen", f"127.0.0.1:{node_port}",
                 "--threads", str(args.threads), "--context-length", str(ctx_per_seq), "--max-batch-size", str(parallel),
                 "--request-timeout", "0", *args.node_arg]
    peer_argv = [args.peer, "-m", args.model, "--host", "127.0.0.1", "--port", str(peer_port), "-t", str(args.threads),
                 "-tb", str(args.threads), "-np", str(parallel), "-c", str(ctx_per_seq * parallel), "--kv-unified",
                 "--no-webui", "-a", "gemma", *args.peer_arg]
    report = {
        "benchmark": "node_vs_llama_server",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": Path(args.model).name,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "parallel": parallel,
        "ctx_per_seq": ctx_per_seq,
        "runs": [],
    }
    report["cold_start"] = cold_start(args.node, args.model)
    with Server("gantry", node_argv, node_port, "/readyz") as node, Server("llama-server", peer_argv, peer_port, "/health") as peer:
        # Warm both once.
        one_request(node_port, "gemma", "warm", None, 8)
        one_request(peer_port, "gemma", "warm", True, 8)
        for conc in levels:
            for peer_cache in (True, False):
                n = conc * args.requests_per_slot
                tag = f"c{conc}-{'cache' if peer_cache else 'nocache'}-{time.time_ns()}"
                before = engine_events(node_port)
                g = run_load(node_port, "gemma", conc, n, None, args.max_tokens, "g-" + tag)
                time.sleep(1.3)  # one more read of the engine's counters
                after = engine_events(node_port)
                g["engine_events"] = {k: after[k] - before.get(k, 0) for k in after}
                p = run_load(peer_port, "gemma", conc, n, peer_cache, args.max_tokens, "p-" + tag)
                row = {
                    "concurrency": conc,
                    "peer_prompt_cache": peer_cache,
                    "gantry": g,
                    "llama_server": p,
                    "ratio_aggregate_tps": g["aggregate_tps"] / p["aggregate_tps"],
                    "ratio_ttft_p50": g["ttft_p50_ms"] / p["ttft_p50_ms"],
                    "ratio_decode_tps_p50": (g["decode_tps_p50"] or 0) / (p["decode_tps_p50"] or 1),
                }
                report["runs"].append(row)
                # Written after every row: a run stopped at a time limit keeps what it measured.
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
                print(f"c={conc} peer_cache={peer_cache}: gantry {g['aggregate_tps']:.1f} tok/s ttft50 {g['ttft_p50_ms']:.0f} ms | "
                      f"llama-server {p['aggregate_tps']:.1f} tok/s ttft50 {p['ttft_p50_ms']:.0f} ms | "
                      f"ratio tps {row['ratio_aggregate_tps']:.3f} ttft {row['ratio_ttft_p50']:.3f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"cold start (exec to /healthz 200): median {report['cold_start']['median_s'] * 1000:.1f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
