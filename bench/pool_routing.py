#!/usr/bin/env python3
"""Gateway routing: prefix-aware vs least-load in front of three real nodes, in one run.

Three `gantry-node serve` processes each serve Gemma 3 270M Q4_K_M (the GGUF scripts/setup.sh
installs; 1 engine thread each, since the three share this machine's cores; 8 sequences,
2048-token context, response cache off, prefix cache on, 1536-token prefill chunks so that a
whole prompt is one chunk: an engine matches its prefix cache against a sequence's first chunk
only; a 120 s stall limit, since a chunk that long on one oversubscribed core holds the other
streams' next token for more than the default 5 s). One gateway (`gantry-operator run --components gateway`, a static endpoints file)
fronts them. The same workload runs twice, once with `--routing prefix` and once with
`--routing least-load`; the nodes and the gateway are started afresh for each run, so both
start with cold caches.

Workload: 16 chat conversations. Each starts with the same long system prompt (about 600
tokens) and its own few-shot header (two example exchanges), then grows turn by turn: a turn
sends the whole conversation so far plus a new user message, and its answer (greedy,
`max_tokens` 48) is appended before the next turn. 8 turns each, 128 requests (`--turns 4
--max-tokens 16` is the shorter workload of earlier runs). 4 clients take
turns from a round-robin queue of conversations, so one conversation's turns are interleaved
with the others' as users with think time would be. Requests stream.

Measured per run: TTFT (request sent to first content chunk, client side, through the gateway)
p50/p95; prompt tokens the engines evaluated, summed from the three nodes'
`gantry_prompt_tokens_evaluated_total` (scraped before and after; the engines report what they
took from their prefix cache, ABI 1.4), with the prompt and cached totals beside it; requests per
replica (each node's `gantry_requests_total` increase) with max/mean. Targets (issue 15):
prefix-aware evaluates >= 50 % fewer prompt tokens than least-load, TTFT p50 30 % lower, and no
replica above 1.25 x the mean number of requests.

Usage: bench/pool_routing.py [--model gemma.gguf] [--out bench/results/pool-routing.json]
           [--quick]

Needs `cargo build --release --workspace`. Loopback only. Bounded: 64 requests per run and at
most --max-seconds per run (no turn starts later); about 10 minutes in all on 2 CPU cores.
--quick is a smoke run (6 conversations, 2 turns).
"""
import argparse
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from common import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
DEFAULT_MODEL = os.environ.get(
    "GANTRY_GEMMA_GGUF", str(Path.home() / ".cache/gantry/models/gemma-3-270m-q4_k_m.gguf"))
MODEL = "gemma"
MODES = ("prefix", "least-load")

# The shared system prompt: about 600 Gemma tokens of a support desk's rules.
TOPICS = ["billing", "accounts", "passwords", "exports", "imports", "the mobile app", "the API",
          "webhooks", "single sign-on", "invoices", "refunds", "data retention", "audit logs",
          "backups"]
SYSTEM = ("You are the support assistant of Northwind Cloud. Follow these rules in every answer. "
          + " ".join(f"Rule {i + 1}: for questions about {t}, answer in at most two sentences, name the "
                     f"help-centre page on {t}, and never promise dates or refunds on behalf of the team."
                     for i, t in enumerate(TOPICS)))
PRODUCTS = ["Ledger", "Atlas", "Beacon", "Cobalt", "Delta", "Ember", "Fjord", "Granite", "Harbor", "Iris",
            "Juniper", "Keystone", "Lumen", "Meridian", "Nimbus", "Orchid"]
QUESTIONS = [
    "My {p} export stopped working this morning. What should I check first?",
    "Can I move my {p} workspace to another region?",
    "Where do I see the {p} invoices of last year?",
    "How do I give a new colleague access to {p}?",
    "Is there a way to undo a deleted {p} project?",
    "Why does {p} log me out every hour?",
]


def few_shot(i):
    """Conversation i's own header: two example exchanges about its product."""
    p = PRODUCTS[i % len(PRODUCTS)]
    return [
        {"role": "user", "content": f"Customer {i} uses {p}. Example question: how do I reset my {p} password?"},
        {"role": "assistant", "content": f"Open {p} settings, choose Security, then Reset password; the "
                                         f"help-centre page on passwords has the details."},
        {"role": "user", "content": f"Another example: does {p} keep backups of deleted files?"},
        {"role": "assistant", "content": f"{p} keeps deleted files for 30 days; see the help-centre page on "
                                         f"backups."},
    ]


def scrape(port):
    """This node's gemma counters: prompt, cached, evaluated tokens and requests."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"prompt": 0.0, "cached": 0.0, "evaluated": 0.0, "requests": 0.0}
    names = {"gantry_prompt_tokens_total": "prompt", "gantry_prompt_tokens_cached_total": "cached",
             "gantry_prompt_tokens_evaluated_total": "evaluated", "gantry_requests_total": "requests"}
    for line in text.splitlines():
        m = re.match(r'(\w+)\{([^}]*)\} (\S+)$', line)
        if not m or m.group(1) not in names:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("model") == MODEL:
            out[names[m.group(1)]] += float(m.group(3))
    return out


def chat(port, messages, max_tokens):
    """One streaming chat turn through the gateway: (answer, TTFT s, total s, usage)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first, usage, text, buf = None, None, [], b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            line = ev.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                content = (ch.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
    end = time.perf_counter()
    c.close()
    return "".join(text), (first or end) - t0, end - t0, usage or {}


def workload(gw_port, conversations, turns, concurrency, max_tokens, max_seconds):
    """Run every conversation's turns from `concurrency` clients; a conversation goes back to
    the end of the queue after each turn. Returns the per-turn records and the errors."""
    queue = deque((i, [{"role": "system", "content": SYSTEM}] + few_shot(i), 0) for i in range(conversations))
    lock = threading.Lock()
    records, errors = [], []
    deadline = time.perf_counter() + max_seconds

    def worker():
        while time.perf_counter() < deadline:
            with lock:
                if not queue:
                    return
                i, messages, turn = queue.popleft()
            q = QUESTIONS[(i + turn) % len(QUESTIONS)].format(p=PRODUCTS[i % len(PRODUCTS)])
            messages = messages + [{"role": "user", "content": q}]
            try:
                answer, ttft, total, usage = chat(gw_port, messages, max_tokens)
            except Exception as e:  # reported in the JSON, not hidden
                with lock:
                    errors.append(f"conversation {i} turn {turn}: {e}")
                continue
            with lock:
                records.append({"conversation": i, "turn": turn, "ttft_s": ttft, "total_s": total,
                                "prompt_tokens": usage.get("prompt_tokens"),
                                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
                if turn + 1 < turns:
                    queue.append((i, messages + [{"role": "assistant", "content": answer}], turn + 1))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, errors, time.perf_counter() - t0


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def stop(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_mode(mode, args, work):
    """Start three cold nodes and a gateway routing by `mode`, run the workload, stop them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANTRY_")}
    env["GANTRY_LOG"] = "warn"
    config = work / "node.yaml"
    config.write_text(
        "models:\n"
        f"  - {{id: {MODEL}, path: {args.model}, format: gguf, contextLength: 2048, maxBatchSize: 8}}\n"
        f"scheduler: {{responseCacheRamFraction: 0.0, prefillChunkTokens: {args.prefill_chunk_tokens}, "
        "stallTimeoutSeconds: 120}\n")
    procs, ports = [], []
    try:
        for n in range(3):
            port = free_port()
            log = work / f"{mode}-node{n}.log"
            procs.append(subprocess.Popen(
                [args.node, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}",
                 "--threads", str(args.threads), "--plugins-dir", args.plugins_dir, "--request-timeout", "0"],
                stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
            ports.append(port)
        for n, port in enumerate(ports):
            wait_http(f"http://127.0.0.1:{port}/readyz", 180, procs[n], work / f"{mode}-node{n}.log")
        endpoints = work / "endpoints.json"
        endpoints.write_text(json.dumps({"models": {MODEL: [f"http://127.0.0.1:{p}" for p in ports]}}))
        gw_port = free_port()
        gw_log = work / f"{mode}-gateway.log"
        procs.append(subprocess.Popen(
            [args.operator, "run", "--components", "gateway", "--endpoints-file", str(endpoints),
             "--gateway-addr", f"127.0.0.1:{gw_port}", "--probe-interval-ms", "200", "--routing", mode,
             "--load-slack", str(args.load_slack)],
            stdout=open(gw_log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.time() + 60
        while MODEL not in wait_http(f"http://127.0.0.1:{gw_port}/v1/models", 180, procs[-1], gw_log)[1]:
            if time.time() > deadline:
                raise SystemExit(f"the gateway did not route {MODEL} in 60 s:\n{gw_log.read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(1.0)  # every replica probed at least once, so every one counts as warm
        before = [scrape(p) for p in ports]
        records, errors, wall = workload(gw_port, args.conversations, args.turns, args.concurrency,
                                         args.max_tokens, args.max_seconds)
        after = [scrape(p) for p in ports]
    finally:
        stop(procs)
    d = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    per_replica = [int(x["requests"]) for x in d]
    mean = sum(per_replica) / len(per_replica)
    ttft = [r["ttft_s"] * 1000 for r in records]
    totals = {k: int(sum(x[k] for x in d)) for k in ("prompt", "cached", "evaluated")}
    return {
        "routing": mode,
        "requests": len(records),
        "errors": errors,
        "wall_s": round(wall, 2),
        "ttft_ms": {"p50": pct(ttft, 50), "p95": pct(ttft, 95), "mean": sum(ttft) / len(ttft) if ttft else None},
        "prompt_tokens": totals["prompt"],
        "prompt_tokens_cached": totals["cached"],
        "prompt_tokens_evaluated": totals["evaluated"],
        "requests_per_replica": per_replica,
        "evaluated_per_replica": [int(x["evaluated"]) for x in d],
        "max_over_mean": max(per_replica) / mean if mean else None,
        "ttft_by_turn_p50_ms": {t: pct([r["ttft_s"] * 1000 for r in records if r["turn"] == t], 50)
                                for t in range(args.turns)},
        "records": records,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--node", default=str(TARGET / "gantry-node"))
    ap.add_argument("--operator", default=str(TARGET / "gantry-operator"))
    ap.add_argument("--plugins-dir", default=str(TARGET / "engines"))
    ap.add_argument("--model", default=DEFAULT_MODEL, help="Gemma 3 270M GGUF")
    ap.add_argument("--out", default=str(ROOT / "bench/results/pool-routing.json"))
    ap.add_argument("--threads", type=int, default=1, help="engine threads per node (three nodes share the CPUs)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--load-slack", type=int, default=3, help="the gateway's --load-slack (0: plain CHWBL)")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=1536,
                    help="the nodes' prefillChunkTokens (a prompt must fit one chunk to be matched whole)")
    ap.add_argument("--max-seconds", type=float, default=600, help="no turn starts later than this into a run")
    ap.add_argument("--quick", action="store_true", help="smoke run: 6 conversations, 2 turns")
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns, args.max_seconds = 6, 2, 60
    for p in (args.node, args.operator, args.model):
        if not Path(p).is_file():
            raise SystemExit(f"{p} is missing (cargo build --release --workspace; scripts/setup.sh)")
    work = Path(tempfile.mkdtemp(prefix="gantry-bench-pool-routing-"))
    report = {
        "benchmark": "pool-routing",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": Path(args.model).name,
        "nodes": 3,
        "threads_per_node": args.threads,
        "node_config": {"contextLength": 2048, "maxBatchSize": 8, "responseCacheRamFraction": 0.0,
                        "prefillChunkTokens": args.prefill_chunk_tokens, "stallTimeoutSeconds": 120},
        "gateway": {"load_factor": 1.25, "load_slack": args.load_slack, "prefix_chars": 256},
        "workload": {"conversations": args.conversations, "turns": args.turns, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "system_prompt_chars": len(SYSTEM), "temperature": 0,
                     "stream": True},
        "quick": args.quick,
        "targets": {"evaluated_reduction_min": 0.5, "ttft_p50_reduction_min": 0.3, "max_over_mean_max": 1.25},
        "runs": {},
    }
    for mode in MODES:
        # A failed run leaves its node and gateway logs in `work`; a complete one removes them.
        run = run_mode(mode, args, work)
        report["runs"][mode] = run
        print(f"{mode:>10}: {run['requests']} requests in {run['wall_s']} s, TTFT p50 {run['ttft_ms']['p50']:.0f} ms "
              f"p95 {run['ttft_ms']['p95']:.0f} ms, prompt tokens {run['prompt_tokens']} "
              f"(evaluated {run['prompt_tokens_evaluated']}, cached {run['prompt_tokens_cached']}), "
              f"requests per replica {run['requests_per_replica']}, errors {len(run['errors'])}", flush=True)
    px, ll = report["runs"]["prefix"], report["runs"]["least-load"]
    evaluated_reduction = 1 - px["prompt_tokens_evaluated"] / ll["prompt_tokens_evaluated"]
    ttft_reduction = 1 - px["ttft_ms"]["p50"] / ll["ttft_ms"]["p50"]
    report["comparison"] = {
        "evaluated_reduction": evaluated_reduction,
        "ttft_p50_reduction": ttft_reduction,
        "ttft_p95_reduction": 1 - px["ttft_ms"]["p95"] / ll["ttft_ms"]["p95"],
        "prefix_max_over_mean": px["max_over_mean"],
        "met": {
            "evaluated": evaluated_reduction >= 0.5,
            "ttft_p50": ttft_reduction >= 0.3,
            "balance": px["max_over_mean"] <= 1.25,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(f"{'':>12} {'TTFT p50':>9} {'TTFT p95':>9} {'prompt':>7} {'evaluated':>9} {'cached':>7}  per replica (max/mean)")
    for mode in MODES:
        r = report["runs"][mode]
        print(f"{mode:>12} {r['ttft_ms']['p50']:>7.0f}ms {r['ttft_ms']['p95']:>7.0f}ms {r['prompt_tokens']:>7} "
              f"{r['prompt_tokens_evaluated']:>9} {r['prompt_tokens_cached']:>7}  "
              f"{r['requests_per_replica']} ({r['max_over_mean']:.2f})")
    c = report["comparison"]
    print(f"prefix vs least-load: evaluated {-c['evaluated_reduction']:+.0%} (target <= -50 %: "
          f"{'met' if c['met']['evaluated'] else 'missed'}), TTFT p50 {-c['ttft_p50_reduction']:+.0%} "
          f"(target <= -30 %: {'met' if c['met']['ttft_p50'] else 'missed'}), max/mean "
          f"{c['prefix_max_over_mean']:.2f} (target <= 1.25: {'met' if c['met']['balance'] else 'missed'})")
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
