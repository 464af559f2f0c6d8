#!/usr/bin/env python3
"""Mixture of experts (and hybrid Mamba-2) on the CPU: the native engine vs Hugging Face
transformers, same checkpoint.

The models, random checkpoints written by transformers itself (`make`, cached under
`${GANTRY_CACHE:-~/.cache/gantry}/bench/`), each with a 32,000-token vocabulary and a word-level
tokenizer (`t0` .. `t31999`), bf16:
- `qwen3-moe` (default, `qwen3-moe-490m`): hidden 1024, 8 layers, 16 query and 4 key/value
  heads, 32 experts of 512 with 4 chosen per token (renormalised); 490 M parameters, about 100 M
  active per token.
- `granite-hybrid` (`--model granite-hybrid`, `granite-4h-tiny-shape`): Granite 4.0-H Tiny's
  layout at 1024 wide: 8 layers, of which 6 Mamba-2 (32 heads of 64, 128-value states) and 2
  attention (no RoPE), each with 32 experts of 512 (4 chosen) beside a shared MLP of 1024;
  538 M parameters.
- `nemotron-h` (`--model nemotron-h`, `nemotron-3-nano-shape`): Nemotron 3 Nano's block types at
  1024 wide: 8 layers, one mixer each: 3 Mamba-2 (32 heads of 64, 128-value states, 8 groups),
  1 attention (8 heads of 128, no position encoding), 4 mixture-of-experts layers (32 relu²
  experts of 512, 4 chosen by sigmoid score, a shared expert of 1024). Written and run by
  transformers 5 (the directory `scripts/setup.sh reference` installs it into).
- `gpt-oss` (`--model gpt-oss`, `gpt-oss-20b-shape`): gpt-oss-20b's layout at 1024 wide: 8
  layers alternating a 128-token sliding window and full attention (16 query and 4 key/value
  heads of 64, biases, a sink per head, YaRN), each with 32 clamped-SwiGLU experts of 512 with
  biases, 4 chosen per token; bf16 (the released MXFP4 is dequantized to bf16 at load anyway).
No registry ships a small MoE or hybrid, so speed is measured on random weights (correctness is
engines/native/tests/reference.rs's job).

With `--mxfp4` (gpt-oss only), Gantry and llama-server run the same model with its experts in
MXFP4, the released files' layout (`gpt-oss-20b-shape-mxfp4`, quantized by
`testkit/python/hf_reference.py`'s `mxfp4`): the native engine dequantizes them to bf16 at load,
llama.cpp's converter keeps them as MXFP4 and llama.cpp multiplies them as such. transformers is
left out of that run (its MXFP4 loader needs a GPU or `accelerate`).

- Gantry: `gantry-node serve` with the native engine, streaming completions at temperature 0
  through the OpenAI API, `concurrency` requests at a time, the response cache and the prefix
  cache off (`--no-response-cache`, GANTRY_NATIVE_PREFIX_CACHE=0), 2 threads.
- Peer: transformers' `generate` on the same directory in bf16 (`peer`, run by the reference
  virtualenv's Python), the `concurrency` prompts as one batch, greedy, `torch.set_num_threads`
  the same threads; one warm-up call first.
- With `--llama-server PATH` (`bench/build-llama-server.sh`), also llama.cpp's server on the same
  weights converted to a bf16 GGUF by llama.cpp's own converter (`testkit/python/hf_to_gguf.py`,
  the converter `scripts/setup.sh reference` fetches; cached beside the checkpoint): the same
  load through its OpenAI API, the prompt given as the same token ids, `ignore_eos` (llama.cpp
  gives a vocabulary without an end token a default one), `-np` the largest concurrency, the
  same threads, its prompt cache off (`cache_prompt: false`).

Both decode `max_tokens` tokens after the same 100-token prompt, `concurrency` copies of it at
once (no end token: the model has none). Reports aggregate output tokens/s per concurrency and the ratio Gantry / transformers.
Writes JSON.

Usage: bench/moe.py --node target/release/gantry-node \\
           --python ~/.cache/gantry/venv-reference/bin/python --out bench/results/moe-cpu.json
       bench/moe.py ... --model granite-hybrid --out bench/results/granite-hybrid-cpu.json
       bench/moe.py ... --model nemotron-h --out bench/results/nemotron-h-cpu.json
       bench/moe.py ... --model gpt-oss --out bench/results/gpt-oss-cpu.json
       bench/moe.py ... --model gpt-oss --mxfp4 --llama-server PATH --out bench/results/gpt-oss-mxfp4-cpu.json
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 32000
PROMPT_TOKENS = 100


def prompt_ids(i):
    rng = random.Random(1000 + i)
    return [rng.randrange(2, VOCAB) for _ in range(PROMPT_TOKENS)]


# name: (cache directory, description, config for AutoConfig.for_model).
MODELS = {
    "qwen3-moe": ("qwen3-moe-490m", "random Qwen3-MoE, 490M total / ~100M active, bf16", dict(
        model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=2048, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True, max_position_embeddings=4096,
        rope_theta=1e6, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)),
    "granite-hybrid": ("granite-4h-tiny-shape",
                       "random Granite 4.0-H (6 Mamba-2 + 2 attention layers, 32 experts top 4 + shared MLP), "
                       "538M, bf16", dict(
        model_type="granitemoehybrid", vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, intermediate_size=512, num_local_experts=32,
        num_experts_per_tok=4, shared_intermediate_size=1024, layer_types=["mamba"] * 3 + ["attention"]
        + ["mamba"] * 3 + ["attention"], mamba_n_heads=32, mamba_d_head=64, mamba_d_state=128,
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, position_embedding_type="nope",
        max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)),
    # Written and run by transformers 5 (TRANSFORMERS5: the directory setup installs it into).
    "nemotron-h": ("nemotron-3-nano-shape",
                   "random Nemotron-H with Nemotron 3 Nano's block types (3 Mamba-2, 1 attention, 4 expert "
                   "layers: 32 relu² experts top 4 + shared expert, sigmoid routing), 1024 wide, bf16", dict(
        model_type="nemotron_h", vocab_size=VOCAB, hidden_size=1024,
        layers_block_type=["linear_attention", "moe", "linear_attention", "moe", "full_attention", "moe",
                           "linear_attention", "moe"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, mamba_num_heads=32, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, conv_kernel=4, n_routed_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=None,
        eos_token_id=None, tie_word_embeddings=False)),
    "gpt-oss": ("gpt-oss-20b-shape",
                "random gpt-oss with gpt-oss-20b's layout (8 layers alternating sliding 128 / full attention, "
                "sinks, 32 clamped-SwiGLU experts top 4), 1024 wide, bf16", dict(
        model_type="gpt_oss", vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=512,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
        rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                               truncate=False, original_max_position_embeddings=4096),
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)),
}
# Models only transformers 5 has: their `make` and `peer` run with it in front of the packages.
TRANSFORMERS5 = {"nemotron-h"}


def make(out: Path, which: str):
    """Write the checkpoint with transformers (run with the reference virtualenv)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(MODELS[which][2])
    cfg = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    if which == "gpt-oss":
        # The MXFP4 twin, as the released files are (`--mxfp4`), with this vocabulary.
        sys.path.insert(0, str(HERE.parent / "testkit/python"))
        from hf_reference import write_mxfp4

        twin = out.parent / (out.name + "-mxfp4")
        write_mxfp4(model.float(), twin)
        tok.save(str(twin / "tokenizer.json"))
    (out / ".complete").write_text("1")


def peer(model_dir: str, concurrency: list[int], max_tokens: int, threads: int, rounds: int):
    """transformers' generate, batched; prints JSON {concurrency: [aggregate tok/s per round]}."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = {}
    with torch.no_grad():
        model.generate(torch.tensor([prompt_ids(0)]), max_new_tokens=4, do_sample=False)
        for c in concurrency:
            ids = torch.tensor([prompt_ids(0)] * c)
            runs = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
                wall = time.perf_counter() - t0
                assert gen.shape[1] == PROMPT_TOKENS + max_tokens, gen.shape
                runs.append(c * max_tokens / wall)
            out[c] = runs
            print(f"transformers c={c}: {statistics.median(runs):.1f} tok/s", file=sys.stderr, flush=True)
    print(json.dumps(out))


def gantry(node: str, model_dir: Path, concurrency: list[int], max_tokens: int, threads: int, rounds: int):
    sys.path.insert(0, str(HERE))
    from node_vs_llama_server import Server, free_port

    # The shared request loop, with this model's prompt: the token ids as `t<id>` words, which
    # the word-level tokenizer maps back to the same ids the peer is given.
    prompt = {"prompt": " ".join(f"t{t}" for t in prompt_ids(0))}
    port = free_port()
    argv = [node, "serve", "--model", str(model_dir), "--model-id", "moe", "--listen", f"127.0.0.1:{port}",
            "--threads", str(threads), "--context-length", "512", "--max-batch-size", str(max(concurrency)),
            "--request-timeout", "0", "--no-response-cache"]
    os.environ["GANTRY_NATIVE_PREFIX_CACHE"] = "0"
    with Server("moe-gantry", argv, port, "/readyz"):
        return measure("gantry", port, prompt, concurrency, max_tokens, rounds)


def measure(name: str, port: int, body: dict, concurrency: list[int], max_tokens: int, rounds: int):
    """One warm-up request, then `rounds` loads of `c` requests at a time for each level:
    {concurrency: [aggregate tok/s per round]}."""
    from native_vs_llama_cpp import one_request, run_load

    one_request(port, "moe", "warm", 4, body)
    out = {}
    for c in concurrency:
        runs = []
        for r in range(rounds):
            res = run_load(port, "moe", c, c, max_tokens, f"moe-{c}-{r}", body)
            assert res["prompt_tokens"] in (PROMPT_TOKENS, PROMPT_TOKENS + 1), res
            runs.append(res["aggregate_tps"])
        out[c] = runs
        print(f"{name} c={c}: {statistics.median(runs):.1f} tok/s", file=sys.stderr, flush=True)
    return out


def llama_server(server: str, python: str, model_dir: Path, concurrency: list[int], max_tokens: int,
                 threads: int, rounds: int):
    sys.path.insert(0, str(HERE))
    from node_vs_llama_server import Server, free_port

    cache = Path(os.environ.get("GANTRY_CACHE", Path.home() / ".cache/gantry"))
    converter = next(cache.glob("llama-cpp-converter-*"), None)
    if converter is None:
        raise SystemExit("llama.cpp's converter is missing: run scripts/setup.sh reference")
    gguf = model_dir / "model-bf16.gguf"
    if not gguf.is_file():
        subprocess.run([python, HERE.parent / "testkit/python/hf_to_gguf.py", converter, "--outtype", "bf16",
                        model_dir, gguf], check=True)
    body = {"prompt": prompt_ids(0), "ignore_eos": True, "cache_prompt": False}
    parallel = max(concurrency)
    port = free_port()
    argv = [server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(parallel), "-c", str(512 * parallel), "--kv-unified", "--no-webui",
            "-a", "moe"]
    with Server("moe-llama-server", argv, port, "/health"):
        return measure("llama-server", port, body, concurrency, max_tokens, rounds)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "make":
        make(Path(sys.argv[2]), sys.argv[3])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer(sys.argv[2], [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5]),
             int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", required=True)
    ap.add_argument("--python", required=True, help="a Python with torch and transformers (the reference venv)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-moe")
    ap.add_argument("--llama-server", help="also run llama.cpp's server (bench/build-llama-server.sh prints it)")
    ap.add_argument("--mxfp4", action="store_true", help="gpt-oss: run the MXFP4 twin (no transformers)")
    ap.add_argument("--machine-note", default="nothing else ran on the machine")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    cache = Path(os.environ.get("GANTRY_CACHE", Path.home() / ".cache/gantry"))
    dir_name, description, _ = MODELS[args.model]
    model_dir = cache / "bench" / dir_name
    env = dict(os.environ)
    if args.model in TRANSFORMERS5:
        env["PYTHONPATH"] = str(cache / "transformers5")
    if not (model_dir / ".complete").exists():
        subprocess.run([args.python, __file__, "make", str(model_dir), args.model], check=True, env=env)
    if args.mxfp4:
        if args.model != "gpt-oss":
            raise SystemExit("--mxfp4 is for --model gpt-oss")
        model_dir = model_dir.parent / (model_dir.name + "-mxfp4")
        description += "; experts in MXFP4"
    ours = gantry(args.node, model_dir, levels, args.max_tokens, args.threads, args.rounds)
    theirs = None
    if not args.mxfp4:
        p = subprocess.run([args.python, __file__, "peer", str(model_dir), args.concurrency, str(args.max_tokens),
                            str(args.threads), str(args.rounds)], check=True, stdout=subprocess.PIPE, text=True,
                           env=env)
        theirs = {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}
    llama = None
    if args.llama_server:
        llama = llama_server(args.llama_server, args.python, model_dir, levels, args.max_tokens, args.threads,
                             args.rounds)
    rows = []
    for c in levels:
        g = statistics.median(ours[c])
        row = {"concurrency": c, "gantry_aggregate_tps": g, "gantry_runs": ours[c]}
        line = f"c={c}: gantry {g:.1f} tok/s"
        if theirs:
            t = statistics.median(theirs[c])
            row.update({"transformers_aggregate_tps": t, "ratio": g / t, "transformers_runs": theirs[c]})
            line += f", transformers {t:.1f} tok/s, ratio {g / t:.2f}"
        if llama:
            l = statistics.median(llama[c])
            row.update({"llama_server_aggregate_tps": l, "ratio_vs_llama_server": g / l, "llama_server_runs": llama[c]})
            line += f"; llama-server {l:.1f} tok/s, ratio {g / l:.2f}"
        rows.append(row)
        print(line, flush=True)
    report = {"benchmark": "moe_cpu", "model": description,
              "threads": args.threads, "max_tokens": args.max_tokens, "prompt_tokens": PROMPT_TOKENS,
              "runs": rows}
    sys.path.insert(0, str(HERE))
    from common import write_report

    write_report(args.out, report, args.machine_note)


if __name__ == "__main__":
    main()
