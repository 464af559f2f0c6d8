#!/usr/bin/env python3
"""A reference PyTorch decode loop: the peer of the native engine's GPU benchmark.

Gemma 3 270M shapes (or Llama 3 8B), random bf16 weights made on the GPU, a static KV cache
per layer, sampling on the GPU, and the whole decode step (embedding, layers, lm_head,
sampling, next ids and position written in place) captured in one CUDA graph. Plain PyTorch:
separate q/k/v/o and gate/up/down matmuls through F.linear, F.rms_norm, RoPE from
precomputed tables, F.scaled_dot_product_attention with enable_gqa and an additive mask
built from the device position; no custom kernels, nothing fused by hand.

Modes: `graph` (the eager step captured in a CUDA graph) and `compiled`
(torch.compile(mode="default", dynamic=False) first, then the compiled step captured the
same way). The cache starts "filled" to --context positions (random K/V, no prompt is run);
the position is reset to --context before each phase (warm-up, capture, timing), so the
cache holds --context plus the longest phase, rounded up to 64. Each timed replay is
bracketed by CUDA events recorded on the stream, with one synchronize at the end.

Per (mode, batch) row: aggregate tokens/s, ms per step, step p50/p99, and the bandwidth
roofline: bytes read per step = every weight matrix once (the tied embedding once, as the
lm_head) + the KV cache at the mean attended length (sliding layers capped at the window);
roofline tokens/s = batch / (bytes / bandwidth). The JSON is rewritten after every row.

Usage:
  python3 bench/torch_decode.py --shape gemma3-270m --batches 1,8,64,256 \\
      --modes graph,compiled --out bench/results/x.json
  python3 bench/torch_decode.py --device cpu --shape tiny --batches 1,2 --steps 4  # smoke test
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

CAPTURE_WARMUP = 3  # eager steps on a side stream before capture (the standard recipe)


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    act: str  # "gelu_tanh" or "silu"
    gemma: bool  # sandwich norms, q/k norms, sqrt(hidden) embedding scale
    tied: bool
    rope_global: float
    rope_local: float
    window: int  # sliding window of the local layers; 0: every layer is global
    global_every: int  # layer i is global when (i + 1) % global_every == 0
    eps: float

    def sliding(self, i: int) -> bool:
        return self.window > 0 and (i + 1) % self.global_every != 0


SHAPES = {
    "gemma3-270m": Shape(262144, 640, 18, 4, 1, 256, 2048, "gelu_tanh", True, True,
                         1e6, 1e4, 512, 6, 1e-6),
    "llama3-8b": Shape(128256, 4096, 32, 32, 8, 128, 14336, "silu", False, False,
                       5e5, 5e5, 0, 1, 1e-5),
    # Gemma-style and small enough for a CPU smoke test; the window is short so it masks.
    "tiny": Shape(1024, 64, 6, 4, 1, 16, 128, "gelu_tanh", True, True, 1e6, 1e4, 8, 3, 1e-6),
}


def randn(shape, dev, std=0.02):
    return torch.randn(shape, device=dev, dtype=torch.bfloat16).mul_(std)


def norm_weight(n, dev):
    # Effective RMSNorm scale, ~1. Gemma's (1 + w) is folded in here, as a checkpoint
    # converter would do; the step multiplies by the stored weight.
    return torch.ones(n, device=dev, dtype=torch.bfloat16).add_(randn(n, dev))


def rope_tables(base, head_dim, max_len, dev):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_len, device=dev, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def make_weights(c: Shape, max_len: int, dev):
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    layers = []
    for _ in range(c.layers):
        L = {"wq": randn((q, c.hidden), dev), "wk": randn((kv, c.hidden), dev),
             "wv": randn((kv, c.hidden), dev), "wo": randn((c.hidden, q), dev),
             "gate": randn((c.intermediate, c.hidden), dev),
             "up": randn((c.intermediate, c.hidden), dev),
             "down": randn((c.hidden, c.intermediate), dev),
             "in_norm": norm_weight(c.hidden, dev), "post_attn_norm": norm_weight(c.hidden, dev)}
        if c.gemma:
            L.update(pre_ffn_norm=norm_weight(c.hidden, dev), post_ffn_norm=norm_weight(c.hidden, dev),
                     q_norm=norm_weight(c.head_dim, dev), k_norm=norm_weight(c.head_dim, dev))
        layers.append(L)
    embed = randn((c.vocab, c.hidden), dev)
    lm_head = embed if c.tied else randn((c.vocab, c.hidden), dev)
    W = {"layers": layers, "embed": embed, "lm_head": lm_head, "norm": norm_weight(c.hidden, dev),
         "ar": torch.arange(max_len, device=dev)}
    W["cos_g"], W["sin_g"] = rope_tables(c.rope_global, c.head_dim, max_len, dev)
    if c.window:
        W["cos_l"], W["sin_l"] = rope_tables(c.rope_local, c.head_dim, max_len, dev)
    return W


def weight_bytes(W) -> int:
    """Every matrix and norm read once per step; the embedding lookup is left out (its table
    is read once as the lm_head when tied, and only B rows of it otherwise)."""
    per_layer = sum(t.nbytes for L in W["layers"] for t in L.values())
    return per_layer + W["norm"].nbytes + W["lm_head"].nbytes


def kv_bytes(c: Shape, batch: int, mean_len: float) -> float:
    per_pos = 2 * c.kv_heads * c.head_dim * 2 * batch  # K and V, bf16
    return sum(per_pos * (min(mean_len, c.window) if c.sliding(i) else mean_len)
               for i in range(c.layers))


def make_state(c: Shape, batch: int, context: int, max_len: int, dev):
    """Static tensors of one batch: input ids, the position, and the KV cache (random content
    stands for a prefilled prompt of `context` tokens)."""
    cache = (batch, c.kv_heads, max_len, c.head_dim)
    return {"ids": torch.randint(0, c.vocab, (batch,), device=dev),
            "pos": torch.full((1,), context, device=dev, dtype=torch.long),
            "k": [torch.randn(cache, device=dev, dtype=torch.bfloat16) for _ in range(c.layers)],
            "v": [torch.randn(cache, device=dev, dtype=torch.bfloat16) for _ in range(c.layers)]}


def rms_norm(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)  # computes in float32, returns bf16


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def additive_mask(valid):
    zero = torch.zeros((), device=valid.device, dtype=torch.bfloat16)
    return torch.where(valid, zero, float("-inf")).to(torch.bfloat16).view(1, 1, 1, -1)


def attention(c: Shape, L, x, kc, vc, pos, cos, sin, mask):
    B = x.shape[0]
    q = F.linear(x, L["wq"]).view(B, c.heads, 1, c.head_dim)
    k = F.linear(x, L["wk"]).view(B, c.kv_heads, 1, c.head_dim)
    v = F.linear(x, L["wv"]).view(B, c.kv_heads, 1, c.head_dim)
    if c.gemma:
        q, k = rms_norm(q, L["q_norm"], c.eps), rms_norm(k, L["k_norm"], c.eps)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    kc[:, :, pos] = k  # index_put_ along the sequence dim at the device position
    vc[:, :, pos] = v
    o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=c.head_dim ** -0.5,
                                       enable_gqa=True)
    return F.linear(o.reshape(B, c.heads * c.head_dim), L["wo"])


def mlp(c: Shape, L, x):
    g = F.linear(x, L["gate"])
    g = F.gelu(g, approximate="tanh") if c.act == "gelu_tanh" else F.silu(g)
    return F.linear(g * F.linear(x, L["up"]), L["down"])


def make_step(c: Shape, greedy: bool):
    """One decode step for all sequences at the same position; mutates ids, pos and the cache."""
    def step(W, S):
        ids, pos = S["ids"], S["pos"]
        x = F.embedding(ids, W["embed"])
        if c.gemma:
            x = x * math.sqrt(c.hidden)
        valid = W["ar"] <= pos
        mask_g = additive_mask(valid)
        cos_g, sin_g = W["cos_g"].index_select(0, pos), W["sin_g"].index_select(0, pos)
        cos_l, sin_l, mask_l = cos_g, sin_g, mask_g
        if c.window:  # sliding layers: their own RoPE base, and only the last `window` positions
            mask_l = additive_mask(valid & (W["ar"] > pos - c.window))
            cos_l, sin_l = W["cos_l"].index_select(0, pos), W["sin_l"].index_select(0, pos)
        for i, L in enumerate(W["layers"]):
            rot = (cos_l, sin_l, mask_l) if c.sliding(i) else (cos_g, sin_g, mask_g)
            h = attention(c, L, rms_norm(x, L["in_norm"], c.eps), S["k"][i], S["v"][i], pos, *rot)
            if c.gemma:
                x = x + rms_norm(h, L["post_attn_norm"], c.eps)
                x = x + rms_norm(mlp(c, L, rms_norm(x, L["pre_ffn_norm"], c.eps)), L["post_ffn_norm"], c.eps)
            else:
                x = x + h  # Llama's "post-attention" norm is the one before the MLP
                x = x + mlp(c, L, rms_norm(x, L["post_attn_norm"], c.eps))
        logits = F.linear(rms_norm(x, W["norm"], c.eps), W["lm_head"])
        if greedy:
            nxt = logits.argmax(dim=-1)
        else:  # temperature 1.0: softmax over the logits in float32, one draw per sequence
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            nxt = torch.multinomial(probs, 1).view(-1)
        ids.copy_(nxt)
        pos.add_(1)
        return logits  # for checks; the benchmark ignores it
    return step


def capture(call):
    """Warm up on a side stream, then capture one step in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(CAPTURE_WARMUP):
            call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    return g


def time_steps(replay, n, cuda: bool):
    """Milliseconds of each of n steps. On CUDA: events between replays, one sync at the end."""
    if not cuda:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            replay()
            out.append((time.perf_counter() - t) * 1e3)
        return out
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda.synchronize()
    ev[0].record()
    for i in range(n):
        replay()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def percentile(xs, p):
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def measure(c: Shape, W, mode, batch, args, max_len, dev):
    cuda = dev.type == "cuda"
    S = make_state(c, batch, args.context, max_len, dev)
    fn = make_step(c, args.greedy)
    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, mode="default", fullgraph=False, dynamic=False)
    call = lambda: fn(W, S)  # noqa: E731
    reset = lambda: S["pos"].fill_(args.context)  # noqa: E731
    for _ in range(2):  # compile / autotune / first-call setup, outside any capture
        reset()
        call()
    reset()
    replay = capture(call).replay if cuda else call
    reset()
    for _ in range(args.warmup):
        replay()
    reset()
    ms = time_steps(replay, args.steps, cuda)
    total_s = sum(ms) / 1e3
    return {"aggregate_tps": batch * args.steps / total_s, "ms_per_step": 1e3 * total_s / args.steps,
            "step_ms_p50": percentile(ms, 50), "step_ms_p99": percentile(ms, 99)}


def device_name(dev):
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")


def write_json(path, doc):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def describe(row):
    head = f"{row['mode']:8s} batch={row['batch']:<4d}"
    if row.get("skipped"):
        return f"{head} skipped: {row['skipped']}"
    if row["error"]:
        return f"{head} error: {row['error']}"
    return (f"{head} {row['aggregate_tps']:10.1f} tok/s  {row['ms_per_step']:.3f} ms/step  "
            f"p50 {row['step_ms_p50']:.3f}  p99 {row['step_ms_p99']:.3f}  "
            f"roofline {row['roofline_tps']:.0f} tok/s ({row['roofline_fraction']:.1%})")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-270m")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--modes", default="graph,compiled")
    ap.add_argument("--context", type=int, default=128, help="positions already in the cache")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=8, help="untimed replays before timing")
    ap.add_argument("--greedy", action="store_true", help="argmax instead of multinomial")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="memory bandwidth in GB/s (default: 4800 on an H200, else 3350)")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds; later rows are skipped")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for an eager smoke test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file, rewritten after every row")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    modes = [m for m in args.modes.split(",") if m]
    bad = set(modes) - {"graph", "compiled"}
    if bad:
        ap.error(f"unknown modes: {sorted(bad)}")
    args.modes = sorted(set(modes), key=["graph", "compiled"].index)  # cheaper rows first
    return args


@torch.no_grad()
def main():
    args = parse_args()
    start = time.monotonic()
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    c = SHAPES[args.shape]
    name = device_name(dev)
    bandwidth = args.bandwidth_gbs or (4800.0 if "H200" in name else 3350.0)
    longest = max(args.warmup, args.steps, CAPTURE_WARMUP, 2)
    max_len = -(-(args.context + longest) // 64) * 64
    W = make_weights(c, max_len, dev)
    wbytes = weight_bytes(W)
    mean_len = args.context + (args.steps + 1) / 2  # attended positions, averaged over timed steps
    doc = {"benchmark": "torch_decode", "device": name, "torch": torch.__version__,
           "shape": args.shape, "config": {**dataclasses.asdict(c), "max_len": max_len},
           "context": args.context, "steps": args.steps, "warmup": args.warmup,
           "sampling": "greedy" if args.greedy else "temperature 1.0, multinomial",
           "bandwidth_gbs": bandwidth, "weight_bytes": wbytes, "kv_mean_len": mean_len, "rows": []}
    if dev.type != "cuda":
        doc["note"] = "cpu: eager steps timed with perf_counter, no CUDA graph"
    print(f"torch_decode {args.shape} on {name}, torch {torch.__version__}, "
          f"weights {wbytes / 1e9:.3f} GB, max_len {max_len}", flush=True)
    for mode in args.modes:
        for batch in args.batches:
            nbytes = wbytes + kv_bytes(c, batch, mean_len)
            roof = batch / (nbytes / (bandwidth * 1e9))
            row = {"mode": mode, "batch": batch, "aggregate_tps": None, "ms_per_step": None,
                   "step_ms_p50": None, "step_ms_p99": None, "bytes_per_step": nbytes,
                   "roofline_tps": roof, "roofline_fraction": None, "error": None}
            if time.monotonic() - start > args.time_budget:
                row["skipped"] = "time budget"
            else:
                try:
                    row.update(measure(c, W, mode, batch, args, max_len, dev))
                    row["roofline_fraction"] = row["aggregate_tps"] / roof
                except Exception as e:  # OOM, compile or capture failure: record it, go on
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                free(dev)
            doc["rows"].append(row)
            write_json(args.out, doc)
            print(describe(row), flush=True)


if __name__ == "__main__":
    main()
