#!/usr/bin/env python3
"""Speculative decoding's draft-length policies, replayed on recorded greedy replies against a
measured step-cost table: what each policy would gain without timing noise, and with the same
token streams for every policy.

1. Records (or reads, with --truth FILE) the greedy reply of every prompt of
   bench/speculation.py's two sets: one gantry-node serving Gemma 3 270M Q4_K_M, speculation
   off, temperature 0, 160 tokens, and the node's /v1/tokenize for the prompt and prompt+reply.
2. Replays each reply step by step: prompt lookup over the text so far (the node's
   `scheduler/src/draft.rs`, with or without the agreement cut), a policy's length, the drafted
   tokens kept while they equal the reply, a step cost from the table. The ratio is the
   reply's tokens times the cost of a one-token step over the replayed time.

Policies: fixed k (3, 7, 15), adaptive (a port of `scheduler/src/draft_len.rs`: per-depth
acceptance with forgetting, probes, the model's pooled rate; costs taken as known) and an oracle
that knows how many of each draft will be kept (an upper bound for any length policy over this
lookup).

The cost table is milliseconds per step of 1..16 tokens, by default the one measured on the
2-core test machine with `cargo run --release -p gantry-engine-llama-cpp --example batch_cost`
(docs/benchmarks.md); pass another with --costs.

Usage: bench/speculation_replay.py [--truth FILE] [--costs 15,26,...] [--out FILE]
"""
import argparse
import json
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import speculation as S
from common import free_port, wait_http

LLAMA_CPU_MS = [15.0, 26.0, 31.7, 33.1, 52.0, 59.8, 63.9, 49.6, 71.2, 70.6, 80.2, 65.5, 78.9,
                88.0, 97.6, 81.1]
MAX_DEPTH = 16
FORGET, PRIOR_WEIGHT, MODEL_FORGET, FIRST_RATE = 0.97, 2.0, 0.995, 0.6
PROBE_AFTER, PROBE_AFTER_MAX, PROBE_RATE = 8, 128, 0.8


def record(node):
    work = Path(tempfile.mkdtemp(prefix="gantry-replay-"))
    cfg = work / "node.yaml"
    cfg.write_text(f"models:\n  - {{id: {S.MODEL}, path: {S.GGUF}, format: gguf, contextLength: 2048, "
                   f"maxBatchSize: 8}}\nscheduler: {{responseCacheRamFraction: 0.0}}\n")
    port = free_port()
    log = work / "node.log"
    proc = subprocess.Popen([node, "serve", "--config", cfg, "--listen", f"127.0.0.1:{port}",
                             "--threads", "2", "--plugins-dir", S.TARGET / "engines"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def tokenize(text):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/tokenize", json.dumps(
            {"model": S.MODEL, "content": text, "add_special": True}).encode(),
            {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)["tokens"]

    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 300, proc, log)
        truth = {}
        for name, prompts in (("input_grounded", S.GROUNDED), ("open_ended", S.OPEN)):
            truth[name] = []
            for p in prompts:
                reply = S.chat(port, p, False, 160)
                truth[name].append({"prompt": tokenize(p), "all": tokenize(p + reply["text"])})
        return truth
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def lookup(ctx, k, agree, nmin=2, nmax=4):
    n_ctx = len(ctx)
    for n in range(min(nmax, n_ctx - 1), nmin - 1, -1):
        tail = ctx[n_ctx - n:]
        occ = [s for s in range(n_ctx - n - 1, -1, -1) if ctx[s:s + n] == tail][:2]
        if not occ:
            continue
        draft = ctx[occ[0] + n:min(occ[0] + n + k, n_ctx)]
        if agree and len(occ) > 1:
            other = ctx[occ[1] + n:]
            same = 0
            while same < min(len(draft), len(other)) and draft[same] == other[same]:
                same += 1
            if same < min(len(draft), len(other)):
                draft = draft[:same]
        return draft
    return []


class Acceptance:
    def __init__(self):
        self.kept, self.tried = [0.0] * MAX_DEPTH, [0.0] * MAX_DEPTH
        self.quiet, self.probe_after = 0, PROBE_AFTER

    def rate(self, prior):
        return (sum(self.kept) + PRIOR_WEIGHT * prior) / (sum(self.tried) + PRIOR_WEIGHT)

    def rates_now(self, prior):
        pooled = self.rate(prior)
        rates = [(k + PRIOR_WEIGHT * pooled) / (t + PRIOR_WEIGHT) for k, t in zip(self.kept, self.tried)]
        return [max(r, PROBE_RATE) for r in rates] if self.quiet >= self.probe_after else rates

    def verified(self, drafted, kept):
        if self.quiet > self.probe_after:
            self.probe_after = min(self.probe_after * 2, PROBE_AFTER_MAX) if kept == 0 else PROBE_AFTER
        self.quiet = 0
        for d in range(kept):
            self.kept[d] += 1
            self.tried[d] += 1
        if kept < drafted:
            self.tried[kept] += 1

    def scale(self, by):
        self.kept = [x * by for x in self.kept]
        self.tried = [x * by for x in self.tried]

    def forget(self):
        self.scale(FORGET)
        self.quiet += 1


def choose(rates, available, ms):
    best_k, best, expected, nxt = 0, 1 / ms[0], 1.0, rates[0]
    for k in range(1, available + 1):
        expected += nxt
        nxt *= rates[k] if k < MAX_DEPTH else 0.0
        if expected / ms[k] > best:
            best, best_k = expected / ms[k], k
    return best_k


def replay(reply, policy, k_max, agree, ms, model):
    gen = reply["all"][len(reply["prompt"]):]
    ctx = list(reply["prompt"]) + gen[:1]  # the first token comes from the prefill
    pos, t, acc = 1, 0.0, Acceptance()
    while pos < len(gen):
        draft = lookup(ctx, min(k_max, len(gen) - pos - 1), agree)
        right = 0
        while right < len(draft) and draft[right] == gen[pos + right]:
            right += 1
        if policy == "fixed":
            k = len(draft)
        elif policy == "oracle":
            k = max(range(len(draft) + 1), key=lambda k: (1 + min(k, right)) / ms[k])
        else:
            k = choose(acc.rates_now(model.rate(FIRST_RATE)), len(draft), ms) if draft else 0
        kept = min(k, right)
        acc.forget()
        if k:
            acc.verified(k, kept)
            model.scale(MODEL_FORGET)
            model.verified(k, kept)
        step = min(kept + 1, len(gen) - pos)
        ctx.extend(gen[pos:pos + step])
        pos += step
        t += ms[k]
    return (len(gen) - 1) * ms[0] / t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default=str(S.TARGET / "gantry-node"))
    ap.add_argument("--truth", default=None, help="recorded replies (JSON written by --out)")
    ap.add_argument("--costs", default=",".join(map(str, LLAMA_CPU_MS)),
                    help="ms per step of 1..16 tokens")
    ap.add_argument("--out", default=str(S.ROOT / "bench/results/speculation-replay.json"))
    a = ap.parse_args()
    ms = [float(x) for x in a.costs.split(",")]
    truth = json.loads(Path(a.truth).read_text())["truth"] if a.truth else record(a.node)
    result = {"benchmark": "speculation_replay", "costs_ms": ms, "policies": {}, "truth": truth}
    for agree in (False, True):
        for policy, k in (("fixed", 3), ("fixed", 7), ("fixed", 15), ("adaptive", 15), ("oracle", 15)):
            name = f"{policy}-{k}" + ("-agree" if agree else "")
            result["policies"][name] = {}
            for set_name, replies in truth.items():
                model = Acceptance()
                ratios = [replay(r, policy, k, agree, ms, model) for r in replies]
                # Equal token counts: the set's ratio is the harmonic mean.
                result["policies"][name][set_name] = {
                    "ratio": len(ratios) / sum(1 / r for r in ratios),
                    "per_prompt": [round(r, 3) for r in ratios]}
            print(name, {s: round(v["ratio"], 3) for s, v in result["policies"][name].items()})
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
