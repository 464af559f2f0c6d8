#!/usr/bin/env python3
"""Speculative decoding (prompt lookup, or a draft model): decode speed with and without it, in
one run.

One gantry-node serves Gemma 3 270M (Q4_K_M through the llama.cpp plugin by default, or the
bf16 safetensors through the native engine with --native), 2 threads, 8 sequences, the
response cache off so every request is generated. With --draft PATH the model drafts with that
GGUF instead (`speculation: {method: draftModel}`); --pair qwen-coder is the real pair,
Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct (both Q4_K_M, fetched on
demand by bench/fetch-qwen-coder.sh), sent as chat completions since both are instruct models. Two prompt sets, sent as plain completions
at temperature 0 with a `seed` (the test model is a base model; the seed makes both variants
evaluate their prompt whole, as docs/node.md's reproducible sampling says, so their texts can be
compared):

- input-grounded: the reply copies much of the prompt (fix the spelling of a paragraph, extract
  sentences, edit code, reformat a list) — what prompt lookup drafts well;
- open-ended: the reply is new text (stories, explanations) — drafts rarely match.

Each prompt is sent with speculation on (the model's default) and off (the request's
`speculation: false`), in alternating order from round to round so that drift on a shared
machine hits both alike. At concurrency 1 every request streams and its decode speed is
(completion tokens - 1) / (last token time - first token time); a set's figure is its tokens
over its decode time. At concurrency 8 (a closed loop over both sets) the figure is aggregate
completion tokens per second of wall time. Reported: the on/off ratios (targets: >= 1.6 on the
input-grounded set at c = 1, >= 0.95 on the open-ended set and at c = 8), whether the texts with
and without speculation are identical (they should be, at temperature 0), and the acceptance
rate from the node's `gantry_speculative_*_tokens_total`.

Usage: bench/speculation.py [--node target/release/gantry-node] [--model PATH] [--native]
           [--draft PATH] [--chat] [--pair qwen-coder] [--draft-tokens N] [--adaptive on|off]
           [--out bench/results/speculation.json] [--rounds 2] [--quick]

Needs `cargo build --release --workspace`. Bounded: --rounds rounds of 12 prompts per variant
at c = 1, and --c8-seconds of closed loop per variant at c = 8; --quick is one round and 10 s.
"""
import argparse
import http.client
import json
import os
import platform
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from common import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
CACHE = Path.home() / ".cache/gantry/models"
GGUF = os.environ.get("GANTRY_GEMMA_GGUF", str(CACHE / "gemma-3-270m-q4_k_m.gguf"))
SAFETENSORS = os.environ.get("GANTRY_GEMMA_ST_DIR", str(CACHE / "gemma-3-270m-bf16"))
# The served id of the measured model, whatever its files.
MODEL = "target"
CHAT = False

PARAGRAPH = ("The comittee met on tuesday to discus the new budjet. Most members agred that the "
             "libary needs more funding, but some argued that the park shoud come first. After a "
             "long debate, they desided to split the mony evenly and revisit the isue next year.")
CODE = '''def total(items):
    result = 0
    for item in items:
        if item.price > 0:
            result = result + item.price * item.quantity
    return result


def average(items):
    if len(items) == 0:
        return 0
    return total(items) / len(items)
'''
NOTES = ("Alice joined the team in March. The server migration finished in April. Bob wrote the "
         "new billing module. The office moved to the fourth floor in May. Alice led the security "
         "review. Carol fixed the login timeout bug. The team adopted weekly planning in June.")
GROUNDED = [
    f"Original: {PARAGRAPH}\nThe same text with the spelling corrected: ",
    f"Here is a Python module:\n\n{CODE}\nThe same module with `total` renamed to `order_total`:\n\n",
    f"Here is a Python module:\n\n{CODE}\nThe same module with a docstring on each function:\n\n",
    f"Notes: {NOTES}\nThe sentences of the notes that mention Alice, word for word: ",
    "To do:\n- buy milk and eggs\n- call the plumber about the kitchen sink\n- send the quarterly "
    "report to Dana\n- book the train tickets for the conference\n- renew the library card\n\n"
    "The same list, numbered:\n1.",
    f"Text: {NOTES}\nThe text again, copied exactly: ",
]
OPEN = [
    "Once upon a time, in a small village by the sea,",
    "The history of the bicycle begins",
    "Ten tips for a better night's sleep:\n1.",
    "Dear diary, today",
    "The main causes of the French Revolution were",
    "A recipe for chocolate cake:\n",
]


def chat(port, prompt, spec, max_tokens, timeout=600):
    body = {
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "speculation": spec,
        "seed": 0,
    }
    if CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.monotonic()
    path = "/v1/chat/completions" if CHAT else "/v1/completions"
    c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()[:500]!r}")
    text, first, last, tokens = "", None, None, 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        for ch in ev.get("choices", []):
            piece = ch.get("text") if not CHAT else (ch.get("delta") or {}).get("content")
            if piece:
                now = time.monotonic()
                first = first or now
                last = now
                text += piece
    c.close()
    return {"text": text, "tokens": tokens, "ttft": (first or t0) - t0,
            "decode_s": (last - first) if first and last else 0.0, "e2e": time.monotonic() - t0}


def scrape(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    val = lambda name: float((re.search(rf'^{name}\{{model="{MODEL}"\}} (\S+)$', text, re.M) or [0, 0])[1])
    return {"drafted": val("gantry_speculative_draft_tokens_total"),
            "accepted": val("gantry_speculative_accepted_tokens_total")}


def c1(port, prompts, rounds, max_tokens):
    out = {True: [], False: []}
    accept = {True: {"drafted": 0.0, "accepted": 0.0}}
    for rnd in range(rounds):
        order = [True, False] if rnd % 2 == 0 else [False, True]
        for p in prompts:
            for spec in order:
                before = scrape(port)
                out[spec].append(chat(port, p, spec, max_tokens))
                if spec:
                    after = scrape(port)
                    for k in accept[True]:
                        accept[True][k] += after[k] - before[k]
    fig = {}
    for spec, rs in out.items():
        toks = sum(max(r["tokens"] - 1, 0) for r in rs)
        secs = sum(r["decode_s"] for r in rs)
        fig["on" if spec else "off"] = {
            "decode_tok_s": toks / secs if secs else 0.0,
            "completion_tokens": sum(r["tokens"] for r in rs),
            "ttft_mean_s": sum(r["ttft"] for r in rs) / len(rs),
        }
    same = sum(a["text"] == b["text"] for a, b in zip(out[True], out[False]))
    fig["ratio"] = fig["on"]["decode_tok_s"] / fig["off"]["decode_tok_s"] if fig["off"]["decode_tok_s"] else None
    fig["identical_texts"] = f"{same}/{len(out[True])}"
    fig["acceptance"] = (accept[True]["accepted"] / accept[True]["drafted"]) if accept[True]["drafted"] else None
    fig["drafted_tokens"] = accept[True]["drafted"]
    return fig


def c8(port, prompts, seconds, max_tokens, spec):
    tokens, lock, stop = [0], threading.Lock(), time.monotonic() + seconds
    t0 = time.monotonic()

    def worker(i):
        k = i
        while time.monotonic() < stop:
            r = chat(port, prompts[k % len(prompts)], spec, max_tokens)
            with lock:
                tokens[0] += r["tokens"]
            k += 8

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0] / (time.monotonic() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default=str(TARGET / "gantry-node"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--native", action="store_true", help="the bf16 safetensors on the native engine")
    ap.add_argument("--out", default=str(ROOT / "bench/results/speculation.json"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--c8-seconds", type=float, default=40)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--draft-tokens", type=int, default=None, help="the model's speculation.draftTokens")
    ap.add_argument("--max-batch", type=int, default=None, help="the model's speculation.maxBatch")
    ap.add_argument("--adaptive", choices=["on", "off"], default=None,
                    help="the model's speculation.adaptive (default: the node's, on)")
    ap.add_argument("--sets", default="input_grounded,open_ended,c8")
    ap.add_argument("--draft", default=None, help="a GGUF the model drafts with (method draftModel)")
    ap.add_argument("--chat", action="store_true", help="chat completions (instruct models)")
    ap.add_argument("--pair", choices=["qwen-coder"], default=None,
                    help="qwen-coder: Qwen2.5-Coder 1.5B drafted by 0.5B (bench/fetch-qwen-coder.sh)")
    a = ap.parse_args()
    global CHAT
    if a.quick:
        a.rounds, a.c8_seconds = 1, 10
    if a.pair == "qwen-coder":
        env = subprocess.run(["bash", str(ROOT / "bench/fetch-qwen-coder.sh")], check=True,
                             capture_output=True, text=True).stdout
        paths = dict(re.findall(r"export (\w+)='([^']*)'", env))
        a.model, a.draft, a.chat = paths["GANTRY_QWEN_TARGET"], paths["GANTRY_QWEN_DRAFT"], True
    CHAT = a.chat
    model = a.model or (SAFETENSORS if a.native else GGUF)
    fmt = "safetensors" if a.native else "gguf"
    work = Path(tempfile.mkdtemp(prefix="gantry-spec-"))
    cfg = work / "node.yaml"
    spec = {k: v for k, v in (("draftTokens", a.draft_tokens), ("maxBatch", a.max_batch)) if v}
    if a.adaptive:
        spec["adaptive"] = a.adaptive == "on"
    draft_yaml = ""
    if a.draft:
        spec.update(method="draftModel", draftModel="draft")
        draft_yaml = (f"  - {{id: draft, path: {a.draft}, format: gguf, contextLength: 2048, "
                      f"maxBatchSize: 1}}\n")
    spec_yaml = f", speculation: {json.dumps(spec)}" if spec else ""
    cfg.write_text(f"models:\n{draft_yaml}  - {{id: {MODEL}, path: {model}, format: {fmt}, "
                   f"contextLength: 2048, maxBatchSize: 8{spec_yaml}}}\n"
                   f"scheduler: {{responseCacheRamFraction: 0.0}}\n")
    port = free_port()
    log = work / "node.log"
    proc = subprocess.Popen([a.node, "serve", "--config", cfg, "--listen", f"127.0.0.1:{port}",
                             "--threads", "2", "--plugins-dir", TARGET / "engines"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 300, proc, log)
        # Warm-up, not measured: a short reply, then one input-grounded prompt each way, so
        # that the engine has run steps of the sizes verification uses before the first
        # measured request (llama.cpp reserves a graph the first time a batch shape runs).
        chat(port, "Hello", True, 8)
        for spec_on in (True, False):
            chat(port, GROUNDED[-1], spec_on, 48)
        result = {
            "benchmark": "speculation",
            "engine": "native" if a.native else "llama_cpp",
            "model": Path(model).name,
            "draft": Path(a.draft).name if a.draft else None,
            "endpoint": "chat" if CHAT else "completions",
            "threads": 2,
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "max_tokens": a.max_tokens,
            "rounds": a.rounds,
            "speculation": spec or "defaults",
            "c1": {},
        }
        sets = a.sets.split(",")
        for name, prompts in (("input_grounded", GROUNDED), ("open_ended", OPEN)):
            if name in sets:
                result["c1"][name] = c1(port, prompts, a.rounds, a.max_tokens)
        if "c8" in sets:
            both = GROUNDED + OPEN
            on = c8(port, both, a.c8_seconds, a.max_tokens, True)
            off = c8(port, both, a.c8_seconds, a.max_tokens, False)
            on2 = c8(port, both, a.c8_seconds, a.max_tokens, True)
            result["c8"] = {"on_tok_s": (on + on2) / 2, "off_tok_s": off, "ratio": (on + on2) / 2 / off}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
