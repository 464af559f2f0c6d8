#!/usr/bin/env python3
"""Embeddings on the CPU: the native engine vs transformers, all-MiniLM-L6-v2.

The model scripts/setup.sh fetches (`GANTRY_MINILM_DIR`), served by `gantry-node serve` through
`/v1/embeddings`, against the sentence-transformers computation in PyTorch (the model's own
tokenizer, `AutoModel`, mean pooling over the attention mask, L2 normalisation: what
sentence-transformers runs for this model's `modules.json`), run by the reference
virtualenv's Python (`peer`). Both sides on the same threads (`--threads`,
`torch.set_num_threads`), f32 weights as shipped.

Workloads, each over the same 20 sentences (8 to 30 tokens) repeated:
- one input per request, one request at a time (an online caller);
- `--batch` inputs per request (Gantry) vs one padded batch per call (PyTorch), `--batch` at a time.

With `--gguf` and `--llama-server`, also the same model as a GGUF through the node's llama.cpp
plugin against llama.cpp's own server with as many slots as a batch has inputs.

Both sides stay up for the whole run and their rounds alternate (Gantry single, PyTorch single,
Gantry batch, PyTorch batch, `--rounds` times), so drift on a shared machine hits both alike.
Reports each side's median embeddings per second, the ratio, and every round's ratio; writes
JSON.

Usage: bench/embeddings.py --node target/release/gantry-node \\
           --python ~/.cache/gantry/venv-reference/bin/python --out bench/results/embeddings-cpu.json
"""
import argparse
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def texts():
    ref = Path(os.environ["GANTRY_HF_REFERENCE"]) / "minilm-expected.json"
    return json.loads(ref.read_text())["texts"]


def peer(model_dir: str, threads: int, batch: int, n: int):
    """The PyTorch side, kept running: one round of a workload per line on stdin ("single" or
    "batch"), its embeddings per second on stdout."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    sentences = (texts() * (n // 20 + 1))[:n]

    def embed(chunk):
        enc = tok(chunk, padding=True, return_tensors="pt")
        h = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        v = (h * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(v, dim=1)

    with torch.no_grad():
        embed(sentences[:batch])
        print("ready", flush=True)
        for line in sys.stdin:
            size = 1 if line.strip() == "single" else batch
            t0 = time.perf_counter()
            for i in range(0, n, size):
                embed(sentences[i:i + size])
            print(n / (time.perf_counter() - t0), flush=True)


def post(port, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/embeddings", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)


def gantry_round(port: int, sentences: list, size: int) -> float:
    """One round of a workload through an OpenAI-style `/v1/embeddings` server (the node, or
    llama-server): embeddings per second."""
    t0 = time.perf_counter()
    for i in range(0, len(sentences), size):
        chunk = sentences[i:i + size]
        r = post(port, {"model": "minilm", "input": chunk if size > 1 else chunk[0]})
        assert len(r["data"]) == len(chunk)
    return len(sentences) / (time.perf_counter() - t0)


def alternate(rounds: int, workloads, ours, theirs) -> tuple[dict, dict]:
    """`rounds` rounds of each workload (name, inputs per call), the two sides' rounds
    alternating so drift on the machine hits both alike: each side's embeddings per second."""
    a = {name: [] for name, _ in workloads}
    b = {name: [] for name, _ in workloads}
    for _ in range(rounds):
        for name, size in workloads:
            a[name].append(ours(name, size))
            b[name].append(theirs(name, size))
    return a, b


def summarise(workloads, ours: dict, theirs: dict, us: str, them: str) -> list:
    """One row per workload: each side's median, the ratio, every round's ratio."""
    rows = []
    for name, size in workloads:
        g, t = sorted(ours[name])[len(ours[name]) // 2], sorted(theirs[name])[len(theirs[name]) // 2]
        ratios = sorted(x / y for x, y in zip(ours[name], theirs[name]))
        rows.append({"workload": name, "inputs_per_call": size,
                     f"{us}_embeddings_per_s": g, f"{them}_embeddings_per_s": t, "ratio": g / t,
                     "round_ratios": ratios, f"{us}_runs": ours[name], f"{them}_runs": theirs[name]})
        print(f"{name}: {us} {g:.1f}/s, {them} {t:.1f}/s, ratio {g / t:.2f} "
              f"(rounds {min(ratios):.2f} to {max(ratios):.2f})", flush=True)
    return rows


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node", required=True)
    ap.add_argument("--python", required=True, help="a Python with torch and transformers (the reference venv)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--inputs", type=int, default=640, help="inputs per round and workload")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gguf", help="the same model as a GGUF (llama.cpp's converter): also compare "
                    "the node's llama.cpp plugin with --llama-server on it")
    ap.add_argument("--llama-server", help="llama.cpp's server (bench/build-llama-server.sh)")
    ap.add_argument("--machine-note", default="nothing else ran on the machine")
    args = ap.parse_args()
    model_dir = os.environ["GANTRY_MINILM_DIR"]
    sys.path.insert(0, str(HERE))
    from node_vs_llama_server import Server, free_port

    sentences = (texts() * (args.inputs // 20 + 1))[:args.inputs]
    workloads = (("single", 1), ("batch", args.batch))
    serve = ["serve", "--model-id", "minilm", "--threads", str(args.threads), "--no-response-cache"]
    port = free_port()
    argv = [args.node, *serve, "--model", model_dir, "--listen", f"127.0.0.1:{port}"]
    peer_proc = subprocess.Popen(
        [args.python, __file__, "peer", model_dir, str(args.threads), str(args.batch), str(args.inputs)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def pytorch_round(name, _size):
        peer_proc.stdin.write(name + "\n")
        peer_proc.stdin.flush()
        return float(peer_proc.stdout.readline())

    try:
        assert peer_proc.stdout.readline().strip() == "ready", "the PyTorch side did not start"
        with Server("embeddings-gantry", argv, port, "/readyz"):
            post(port, {"model": "minilm", "input": sentences[:args.batch]})
            ours, theirs = alternate(args.rounds, workloads,
                                     lambda _n, size: gantry_round(port, sentences, size), pytorch_round)
    finally:
        peer_proc.stdin.close()
        peer_proc.wait(timeout=60)
    report = {"benchmark": "embeddings_cpu", "model": "all-MiniLM-L6-v2 (f32 safetensors)",
              "threads": args.threads, "inputs": args.inputs, "rounds": args.rounds,
              "order": "rounds alternate: Gantry single, PyTorch single, Gantry batch, PyTorch batch",
              "runs": summarise(workloads, ours, theirs, "gantry", "pytorch")}
    if args.gguf and args.llama_server:
        # The same GGUF on both sides: the node's llama.cpp plugin (`embed_batch`: one slot per
        # input, as many per pass as it has slots) and llama-server with as many slots.
        pg, pl = free_port(), free_port()
        node = [args.node, *serve, "--model", args.gguf, "--listen", f"127.0.0.1:{pg}",
                "--max-batch-size", str(args.batch), "--context-length", "512"]
        peer_argv = [args.llama_server, "-m", args.gguf, "--embedding", "--pooling", "mean",
                     "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.batch),
                     "-c", str(512 * args.batch), "-b", "2048", "-ub", "2048",
                     "--host", "127.0.0.1", "--port", str(pl)]
        with Server("embeddings-gantry-gguf", node, pg, "/readyz"), \
                Server("embeddings-llama-server", peer_argv, pl, "/health"):
            for p in (pg, pl):
                post(p, {"model": "minilm", "input": sentences[:args.batch]})
            ours, theirs = alternate(args.rounds, workloads,
                                     lambda _n, size: gantry_round(pg, sentences, size),
                                     lambda _n, size: gantry_round(pl, sentences, size))
        report["gguf"] = {"model": "all-MiniLM-L6-v2 as an f32 GGUF (llama.cpp's converter)",
                          "peer": "llama-server --embedding --pooling mean, one slot per input of a batch",
                          "runs": summarise(workloads, ours, theirs, "gantry_llama_cpp", "llama_server")}
    from common import write_report

    write_report(args.out, report, args.machine_note)


if __name__ == "__main__":
    main()
