#!/usr/bin/env python3
"""Structured outputs: what a JSON Schema constraint costs the node's throughput, in one run.

One gantry-node serves Gemma 3 270M Q4_K_M (2 threads, 8 sequences, 1024-token context each,
the response cache off so every request is generated). The same prompts (support tickets to
triage) are sent at concurrency 1, 4 and 8 in two variants: unconstrained, and with
`response_format: {"type": "json_schema", ...}` on a ticket-triage schema whose documents are
about 60-120 tokens on this model. Requests stream at temperature 0 with the same fixed
max_tokens in both variants. The variants take turns (a round runs both; the next round runs
them in the other order) so that drift on a shared machine hits both alike.

Reports, per concurrency and variant: aggregate completion tokens/s (every request's
completion tokens over the run's wall time), TTFT p50, per-request decode tokens/s p50 and
tokens per request; the constrained/unconstrained ratio of aggregate tokens/s (target >= 0.95);
the same ratio at equal length (both variants forced to the same number of tokens per request,
see EQUAL_TOKENS: replies of different lengths make the first ratio say little);
how many constrained documents parse and validate. And the host's time to compute one token's
allowed-token mask, p50 and p99, from the node's `gantry_constraint_mask_seconds` histogram:
the buckets' increase over the constrained runs, interpolated linearly within a bucket (as
Prometheus's histogram_quantile does); the same for `gantry_constraint_batch_seconds` (the time
a step waited for its batch's masks) when the node exports it.

Usage: bench/structured.py [--node target/release/gantry-node] [--model gemma.gguf]
           [--out bench/results/structured.json] [--quick]

Needs `cargo build --release --workspace`. Bounded: at most --requests-per-slot requests per
client and --max-seconds per run; --quick is a smoke run (concurrency 1 and 4, one request per
client, one round) of well under a minute.
"""
import argparse
import http.client
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from common import free_port

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
DEFAULT_MODEL = os.environ.get("GANTRY_GEMMA_GGUF", str(Path.home() / ".cache/gantry/models/gemma-3-270m-q4_k_m.gguf"))

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 48},
        "category": {"type": "string", "enum": ["bug", "feature", "question", "incident"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "component": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 4},
        "summary": {"type": "string", "maxLength": 120},
        "next_steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"owner": {"type": "string", "maxLength": 20},
                               "action": {"type": "string", "maxLength": 40}},
                "required": ["owner", "action"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "needs_followup": {"type": "boolean"},
    },
    "required": ["title", "category", "priority", "component", "tags", "summary", "next_steps", "needs_followup"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket_triage", "schema": SCHEMA, "strict": True}}

INSTRUCTION = ("Triage this support ticket. Answer with a JSON object with the fields title, category (bug, "
               "feature, question or incident), priority (1-5), component, tags, summary, next_steps (each with "
               "owner and action) and needs_followup.\n\nTicket: ")
TICKETS = [
    "The export button on the billing page does nothing in Firefox since yesterday's release.",
    "Could you add dark mode to the mobile app? Many of our night-shift staff have asked for it.",
    "All API requests from the EU region time out after 30 seconds; the status page says green.",
    "How do I rotate the API key for our staging project without breaking the nightly jobs?",
    "Password reset emails arrive two hours late for customers using Outlook addresses.",
    "The CSV import silently drops rows that contain a comma inside quoted fields.",
    "Please support single sign-on with our Okta tenant for the admin console.",
    "Dashboard charts show yesterday's numbers until the page is reloaded twice.",
]

MASK = "gantry_constraint_mask_seconds"
BATCH = "gantry_constraint_batch_seconds"


def fmt(v, spec):
    return format(v, spec) if v is not None else "-"


def wait_ready(port, proc, log, timeout=180):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"gantry-node exited early:\n{Path(log).read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"gantry-node not ready in {timeout} s:\n{Path(log).read_text()}")


def one_request(port, prompt, constrained, max_tokens):
    body = {
        "model": "gemma",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = RESPONSE_FORMAT
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first = last = None
    usage, finish, text, buf = None, None, [], b""
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
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(content)
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
    end = time.perf_counter()
    c.close()
    tokens = (usage or {}).get("completion_tokens", len(text))
    decode = (tokens - 1) / (last - first) if first and last and last > first and tokens > 1 else None
    return {"tokens": tokens, "ttft": (first or end) - t0, "decode_tps": decode, "seconds": end - t0,
            "finish": finish, "text": "".join(text)}


# Equal-length comparison: replies of different lengths cannot be compared by aggregate tok/s
# (a short unconstrained reply is mostly prefill). Here both variants generate exactly
# EQUAL_TOKENS tokens per request on /v1/completions: the unconstrained one with Gemma's
# end-of-generation tokens banned, the constrained one inside a JSON string that cannot end
# before it.
EQUAL_TOKENS = 96
EQUAL_BAN = {"1": -100, "106": -100}
EQUAL_SCHEMA = {"type": "object", "properties": {"summary": {"type": "string", "minLength": 2000}},
                "required": ["summary"]}


def equal_request(port, prompt, constrained):
    body = {"model": "gemma", "prompt": prompt, "max_tokens": EQUAL_TOKENS, "temperature": 0}
    if constrained:
        body["guided_json"] = EQUAL_SCHEMA
    else:
        body["logit_bias"] = EQUAL_BAN
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    v = json.loads(data)
    return v["usage"]["completion_tokens"], time.perf_counter() - t0


def equal_run(port, concurrency, requests, constrained, max_seconds):
    """`requests` equal-length requests from `concurrency` clients: aggregate tok/s."""
    results, errors, wall = closed_loop(
        concurrency, requests, max_seconds,
        lambda i: equal_request(port, TICKETS[i % len(TICKETS)], constrained)[0])
    return {"requests": len(results), "errors": errors, "completion_tokens": sum(results),
            "wall_s": round(wall, 3), "aggregate_tps": sum(results) / wall,
            "all_equal_length": all(n == EQUAL_TOKENS for n in results)}


def document_ok(text, validator):
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    if validator is None:
        return isinstance(doc, dict) and set(doc) == set(SCHEMA["required"])
    return validator.is_valid(doc)


def closed_loop(concurrency, requests, max_seconds, send):
    """Call `send(i)` for i in range(`requests`) from `concurrency` closed-loop clients; none
    starts after `max_seconds`. Returns (results, errors, wall seconds)."""
    results, errors = [], []
    lock = threading.Lock()
    counter = iter(range(requests))
    deadline = time.perf_counter() + max_seconds

    def worker():
        while time.perf_counter() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                res = send(i)
            except Exception as e:  # reported, not hidden: the run's JSON lists them
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors, time.perf_counter() - t0


def run_load(port, concurrency, requests, constrained, max_tokens, max_seconds, start_index, validator):
    """`requests` requests from `concurrency` closed-loop clients; none starts after `max_seconds`."""
    return closed_loop(
        concurrency, requests, max_seconds,
        lambda i: one_request(port, INSTRUCTION + TICKETS[(start_index + i) % len(TICKETS)], constrained,
                              max_tokens))


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def summarize(runs, constrained, validator):
    results = [r for rs, _, _ in runs for r in rs]
    wall = sum(w for _, _, w in runs)
    tokens = sum(r["tokens"] for r in results)
    decodes = [r["decode_tps"] for r in results if r["decode_tps"]]
    out = {
        "requests": len(results),
        "errors": [e for _, es, _ in runs for e in es],
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "aggregate_tps": tokens / wall if wall > 0 else None,
        "tokens_per_request": tokens / len(results) if results else None,
        "ttft_p50_ms": pct([r["ttft"] * 1000 for r in results], 50),
        "decode_tps_p50": statistics.median(decodes) if decodes else None,
        "finish_reasons": {f: sum(1 for r in results if r["finish"] == f) for f in sorted({str(r["finish"]) for r in results})},
    }
    if constrained:
        out["valid_documents"] = sum(1 for r in results if document_ok(r["text"], validator))
    return out


def scrape(port):
    """{metric: (buckets [(le, cumulative)], count, sum)} for model="gemma"."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in (MASK, BATCH):
        buckets, count, total = {}, 0.0, 0.0
        for line in text.splitlines():
            m = re.match(rf'{name}_(bucket|count|sum)\{{([^}}]*)\}} (\S+)$', line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if labels.get("model") != "gemma":
                continue
            v = float(m.group(3))
            if m.group(1) == "bucket":
                buckets[float(labels["le"])] = v
            elif m.group(1) == "count":
                count = v
            else:
                total = v
        out[name] = (buckets, count, total)
    return out


def delta(after, before):
    d = {}
    for name, (buckets, count, total) in after.items():
        b0, c0, s0 = before.get(name, ({}, 0.0, 0.0))
        d[name] = ({le: c - b0.get(le, 0.0) for le, c in buckets.items()}, count - c0, total - s0)
    return d


def add(a, b):
    if a is None:
        return b
    out = {}
    for name in set(a) | set(b):
        ba, ca, sa = a.get(name, ({}, 0.0, 0.0))
        bb, cb, sb = b.get(name, ({}, 0.0, 0.0))
        out[name] = ({le: ba.get(le, 0.0) + bb.get(le, 0.0) for le in set(ba) | set(bb)}, ca + cb, sa + sb)
    return out


def quantile(q, buckets):
    """histogram_quantile: linear interpolation inside the bucket holding rank q * count."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in items:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def hist_report(d, name, tokens):
    buckets, count, total = d.get(name, ({}, 0.0, 0.0))
    if count <= 0:
        return None
    return {
        "observations": int(count),
        "p50_us": quantile(0.50, buckets) * 1e6,
        "p99_us": quantile(0.99, buckets) * 1e6,
        "mean_us": total / count * 1e6,
        "observations_per_completion_token": count / tokens if tokens else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--node", default=str(TARGET / "gantry-node"))
    ap.add_argument("--plugins-dir", default=str(TARGET / "engines"))
    ap.add_argument("--model", default=DEFAULT_MODEL, help="Gemma 3 270M GGUF")
    ap.add_argument("--out", default=str(ROOT / "bench/results/structured.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=192, help="the same for both variants")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests-per-slot", type=int, default=3, help="requests per concurrent client per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per variant and concurrency, order alternating")
    ap.add_argument("--max-seconds", type=float, default=120, help="no request starts later than this into a run")
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4, one request per client, one round")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.requests_per_slot, args.rounds, args.max_seconds = "1,4", 1, 1, 30
    levels = [int(x) for x in args.concurrency.split(",")]
    for p in (args.node, args.model):
        if not Path(p).is_file():
            raise SystemExit(f"{p} is missing (cargo build --release --workspace; scripts/fetch-model.sh)")
    try:
        import jsonschema
        validator = jsonschema.Draft202012Validator(SCHEMA)
    except ImportError:
        validator = None

    work = Path(tempfile.mkdtemp(prefix="gantry-bench-structured-"))
    config = work / "node.yaml"
    config.write_text(
        "models:\n"
        f"  - {{id: gemma, path: {args.model}, format: gguf, contextLength: 1024, maxBatchSize: {max(levels)}}}\n"
        "scheduler: {responseCacheRamFraction: 0.0}\n")
    port = free_port()
    log_path = work / "node.log"
    log = open(log_path, "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANTRY_")}
    proc = subprocess.Popen(
        [args.node, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}", "--threads", str(args.threads),
         "--plugins-dir", args.plugins_dir, "--request-timeout", "0"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    report = {
        "benchmark": "structured",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": Path(args.model).name,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "max_batch_size": max(levels),
        "requests_per_slot": args.requests_per_slot,
        "rounds": args.rounds,
        "quick": args.quick,
        "schema": SCHEMA,
        "target_ratio": 0.95,
        "runs": [],
    }
    try:
        report["ready_s"] = round(wait_ready(port, proc, log_path), 2)
        # Warm-up, not measured: the first constrained request also waits for the model's
        # vocabulary index, which the node builds once per model.
        one_request(port, INSTRUCTION + TICKETS[0], False, 16)
        one_request(port, INSTRUCTION + TICKETS[0], True, args.max_tokens)
        total_masks, total_constrained_tokens = None, 0
        index = 0
        for conc in levels:
            n = conc * args.requests_per_slot
            runs = {False: [], True: []}
            masks = None
            for rnd in range(args.rounds):
                order = (False, True) if rnd % 2 == 0 else (True, False)
                for constrained in order:
                    before = scrape(port) if constrained else None
                    runs[constrained].append(run_load(port, conc, n, constrained, args.max_tokens, args.max_seconds,
                                                      index, validator))
                    if constrained:
                        masks = add(masks, delta(scrape(port), before))
                index += n
            plain = summarize(runs[False], False, validator)
            cons = summarize(runs[True], True, validator)
            total_masks = add(total_masks, masks)
            total_constrained_tokens += cons["completion_tokens"]
            ratio = (cons["aggregate_tps"] / plain["aggregate_tps"]
                     if cons["aggregate_tps"] and plain["aggregate_tps"] else None)
            row = {
                "concurrency": conc,
                "unconstrained": plain,
                "constrained": cons,
                "ratio_aggregate_tps": ratio,
                "meets_target": ratio is not None and ratio >= report["target_ratio"],
                "mask_time": hist_report(masks or {}, MASK, cons["completion_tokens"]),
                "batch_mask_wait": hist_report(masks or {}, BATCH, cons["completion_tokens"]),
            }
            eq_plain = equal_run(port, conc, n, False, args.max_seconds)
            eq_cons = equal_run(port, conc, n, True, args.max_seconds)
            row["equal_length"] = {
                "tokens_per_request": EQUAL_TOKENS,
                "unconstrained": eq_plain,
                "constrained": eq_cons,
                "ratio_aggregate_tps": eq_cons["aggregate_tps"] / eq_plain["aggregate_tps"],
            }
            report["runs"].append(row)
            mt = row["mask_time"] or {}
            print(f"c={conc}: unconstrained {fmt(plain['aggregate_tps'], '.1f')} tok/s | constrained "
                  f"{fmt(cons['aggregate_tps'], '.1f')} tok/s ({cons['valid_documents']}/{cons['requests']} valid) | "
                  f"ratio {fmt(ratio, '.3f')} | mask p50 {fmt(mt.get('p50_us'), '.1f')} us "
                  f"p99 {fmt(mt.get('p99_us'), '.1f')} us", flush=True)
            eq = row["equal_length"]
            print(f"c={conc}: equal length ({EQUAL_TOKENS} tokens): unconstrained "
                  f"{eq['unconstrained']['aggregate_tps']:.1f} tok/s | constrained "
                  f"{eq['constrained']['aggregate_tps']:.1f} tok/s | ratio {eq['ratio_aggregate_tps']:.3f}", flush=True)
        report["mask_time_all_levels"] = hist_report(total_masks or {}, MASK, total_constrained_tokens)
        report["batch_mask_wait_all_levels"] = hist_report(total_masks or {}, BATCH, total_constrained_tokens)
        ratios = [r["ratio_aggregate_tps"] for r in report["runs"] if r["ratio_aggregate_tps"] is not None]
        report["min_ratio"] = min(ratios) if ratios else None
        report["meets_target"] = bool(ratios) and min(ratios) >= report["target_ratio"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    print()
    print(f"{'conc':>4}  {'unconstr tok/s':>14}  {'constr tok/s':>12}  {'ratio':>6}  {'tok/req u/c':>11}  "
          f"{'ttft50 u/c ms':>13}  {'valid':>7}  {'mask p50 us':>11}  {'mask p99 us':>11}")
    for r in report["runs"]:
        u, c, m = r["unconstrained"], r["constrained"], r["mask_time"] or {}
        print(f"{r['concurrency']:>4}  {fmt(u['aggregate_tps'], '.1f'):>14}  {fmt(c['aggregate_tps'], '.1f'):>12}  "
              f"{fmt(r['ratio_aggregate_tps'], '.3f'):>6}  "
              f"{fmt(u['tokens_per_request'], '.0f') + '/' + fmt(c['tokens_per_request'], '.0f'):>11}  "
              f"{fmt(u['ttft_p50_ms'], '.0f') + '/' + fmt(c['ttft_p50_ms'], '.0f'):>13}  "
              f"{str(c['valid_documents']) + '/' + str(c['requests']):>7}  "
              f"{fmt(m.get('p50_us'), '.1f'):>11}  {fmt(m.get('p99_us'), '.1f'):>11}")
    allm = report["mask_time_all_levels"] or {}
    print(f"mask time per token, all levels: p50 {fmt(allm.get('p50_us'), '.1f')} us, p99 {fmt(allm.get('p99_us'), '.1f')} us; "
          f"min ratio {fmt(report['min_ratio'], '.3f')} (target {report['target_ratio']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
