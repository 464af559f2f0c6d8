#!/usr/bin/env python3
"""Make the test LoRA adapters for SmolLM2-135M-Instruct (no registry ships one).

    python smollm2_lora.py BASE_DIR BASE.gguf OUT_DIR

BASE_DIR is the f32 Hugging Face directory gguf_to_hf.py made from BASE.gguf (the Q4_1 GGUF the
llama.cpp engine serves). OUT_DIR receives, all from fixed seeds:

- `pirate/`, `formal/`: PEFT adapters (adapter_config.json, adapter_model.safetensors), rank 8,
  lora_alpha 16, f32, on q/k/v/o/gate/up/down of every layer, in the Hugging Face layout of
  BASE_DIR's weights;
- `pirate.gguf`, `formal.gguf`: the same adapters as GGUF LoRA files, as llama.cpp's
  convert_lora_to_gguf.py writes them and llama_adapter_lora_init reads them;
- `pirate-merged/`: BASE_DIR with W + (alpha/r)·B·A of `pirate` in place of each target W (f32,
  same tensor names), the reference for the native engine's adapter output;
- adapters llama.cpp and the native engine must refuse: `bad-shape/` + `bad-shape.gguf`
  (q_proj's lora_A has 512 input features, not 576), `other-base.gguf` (general.architecture
  gemma3), `bad-target/` (a `qkv_proj` target the model does not have);
- README.txt (what each is) and manifest.json (the same, for tests).

The weights are random, not trained: A ~ N(0, 1/in) row-wise, B ~ N(0, 1) then scaled so that
the delta (alpha/r)·B·A has a Frobenius norm of REL_DELTA times its weight's. That is enough for
the greedy output to leave the base model's within a few tokens while staying readable text,
and the two adapters (different seeds) differ from each other.

Layouts. PEFT: lora_A [r, in], lora_B [out, r] (torch's [out, in] convention), keys
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`. GGUF: `blk.N.attn_q.weight.lora_a`
is numpy [r, in] (ggml ne = [in, r]) and `.lora_b` numpy [out, r] (ne = [r, out]), which is what
llama-adapter.cpp checks (a.ne[0] == W.ne[0], b.ne[1] == W.ne[1], a.ne[1] == b.ne[0]). llama.cpp's
converter permutes the rows of llama's q_proj / k_proj (rotary pairs interleaved) and, for a LoRA,
applies that permutation to lora_B's rows only; the same is done here, so the GGUF adapter on the
GGUF weights is the same function as the PEFT adapter on the Hugging Face weights. The script
checks this on what it wrote (lora_A equal, lora_B equal once unpermuted; the permutation equal to
the one relating BASE.gguf's q/k to BASE_DIR's) and the merged weights against W + delta.

Everything is built in OUT_DIR.part and renamed to OUT_DIR at the end. Only numpy, the `gguf`
package and hf_files.py / gguf_to_hf.py beside this file are used.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from gguf_to_hf import unpermute
from hf_files import write_safetensors

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
RANK = 8
ALPHA = 16
SCALE = ALPHA / RANK
# Frobenius norm of (alpha/r)·B·A relative to the weight's, per adapter (see README_TEXT).
REL_DELTA = 0.12
SEEDS = {"pirate": 1001, "formal": 2002}

# (Hugging Face module, GGUF tensor) in the order PEFT lists them.
TARGETS = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
]
TARGET_MODULES = [hf.split(".")[1] for hf, _ in TARGETS]
BAD_SHAPE_IN = 512  # q_proj's lora_A in bad-shape: 512 input features instead of 576


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict:
    """name -> read-only memory-mapped array (F32 only, which is all these files hold)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            sys.exit(f"{path}: {name} is {info['dtype']}; expected F32")
        a, b = info["data_offsets"]
        out[name] = raw[8 + n + a:8 + n + b].view("<f4").reshape(info["shape"])
    return out


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute of q_proj / k_proj rows (the inverse of
    gguf_to_hf.unpermute)."""
    dim = w.shape[0]
    return w.reshape(n_head, 2, dim // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------


def make_adapter(weights: dict, cfg: dict, seed: int) -> dict:
    """(layer, hf module) -> (A [r, in], B [out, r]), f32, the delta scaled to REL_DELTA."""
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for k, (module, _) in enumerate(TARGETS):
            w = weights[f"model.layers.{layer}.{module}.weight"]
            n_out, n_in = w.shape
            # One generator per tensor, keyed by (seed, layer, module): order-independent.
            rng = np.random.default_rng([seed, layer, k])
            a = (rng.standard_normal((RANK, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = rng.standard_normal((n_out, RANK)).astype(np.float32)
            # ||s·B·A||_F² = s²·tr((BᵀB)(AAᵀ)), from r×r products.
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            delta_norm = SCALE * np.sqrt(np.sum((b64.T @ b64) * (a64 @ a64.T)))
            w_norm = np.sqrt(np.sum(np.square(w, dtype=np.float64)))
            # Four significant digits: the same factor whatever the BLAS's summation order.
            factor = float(f"{REL_DELTA * w_norm / delta_norm:.4g}")
            out[(layer, module)] = (a, (b * np.float32(factor)).astype(np.float32))
    return out


def peft_key(layer: int, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{module}.lora_{which}.weight"


def write_peft(path: Path, ab: dict, target_modules: list) -> None:
    path.mkdir()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": BASE_MODEL_ID,
        "revision": None,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    entries = []
    for (layer, module), (a, b) in ab.items():
        entries.append((peft_key(layer, module, "A"), "F32", a.shape, a))
        entries.append((peft_key(layer, module, "B"), "F32", b.shape, b))
    entries.sort(key=lambda e: e[0])
    write_safetensors(path / "adapter_model.safetensors", entries, {"format": "pt"})


def write_gguf(path: Path, ab: dict, cfg: dict, name: str, arch: str = "llama") -> None:
    gguf_names = dict(TARGETS)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(ALPHA))
    w.add_name(f"SmolLM2-135M-Instruct LoRA {name}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for (layer, module), (a, b) in ab.items():
        if module == "self_attn.q_proj":
            b = permute(b, cfg["num_attention_heads"])
        elif module == "self_attn.k_proj":
            b = permute(b, cfg["num_key_value_heads"])
        base = f"blk.{layer}.{gguf_names[module]}.weight"
        w.add_tensor(base + ".lora_a", np.ascontiguousarray(a))
        w.add_tensor(base + ".lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_merged(path: Path, base_dir: Path, weights: dict, ab: dict) -> None:
    """base_dir's files, its weights with W + s·B·A for every adapted W (f32)."""
    path.mkdir()
    for f in sorted(base_dir.iterdir()):
        if f.is_file() and not f.name.startswith(".") and f.name != "model.safetensors":
            try:
                os.link(f, path / f.name)
            except OSError:
                shutil.copy2(f, path / f.name)

    def merged(name, layer, module):
        a, b = ab[(layer, module)]
        delta = SCALE * (b.astype(np.float64) @ a.astype(np.float64))
        return (weights[name].astype(np.float64) + delta).astype(np.float32)

    entries = []
    for name in sorted(weights):
        parts = name.split(".")
        key = None
        if len(parts) == 6 and parts[:2] == ["model", "layers"]:
            key = (int(parts[2]), ".".join(parts[3:5]))
        w = weights[name]
        if key in ab:
            entries.append((name, "F32", w.shape, lambda n=name, k=key: merged(n, *k)))
        else:
            entries.append((name, "F32", w.shape, w))
    write_safetensors(path / "model.safetensors", entries,
                      {"format": "pt", "source": "smollm2_lora.py: pirate merged"})


# --------------------------------------------------------------------------------------------
# Checks on what was written
# --------------------------------------------------------------------------------------------


def check(out: Path, base_gguf: Path, weights: dict, cfg: dict) -> str:
    # The permutation: BASE.gguf's q/k rows are permute(BASE_DIR's q/k) exactly.
    reader = gguf.GGUFReader(str(base_gguf))
    for t in reader.tensors:
        if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            g = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            q = t.name == "blk.0.attn_q.weight"
            hf = weights[f"model.layers.0.self_attn.{'q' if q else 'k'}_proj.weight"]
            heads = cfg["num_attention_heads"] if q else cfg["num_key_value_heads"]
            if not np.array_equal(permute(hf, heads), g) or not np.array_equal(unpermute(g, heads), hf):
                sys.exit(f"check failed: {t.name} of {base_gguf} is not permute() of {base_gguf}'s "
                         "Hugging Face twin")

    gguf_names = dict(TARGETS)
    worst = 0.0
    for name in SEEDS:
        peft = read_safetensors(out / name / "adapter_model.safetensors")
        lora = {t.name: t for t in gguf.GGUFReader(str(out / f"{name}.gguf")).tensors}
        for layer in range(cfg["num_hidden_layers"]):
            for module, gname in TARGETS:
                a = peft[peft_key(layer, module, "A")]
                b = peft[peft_key(layer, module, "B")]
                ta = lora[f"blk.{layer}.{gname}.weight.lora_a"]
                tb = lora[f"blk.{layer}.{gname}.weight.lora_b"]
                ga = np.asarray(ta.data).reshape(a.shape)
                gb = np.asarray(tb.data).reshape(b.shape)
                if gname in ("attn_q", "attn_k"):
                    heads = cfg["num_attention_heads" if gname == "attn_q" else "num_key_value_heads"]
                    gb = unpermute(gb, heads)
                if not (np.array_equal(a, ga) and np.array_equal(b, gb)):
                    sys.exit(f"check failed: {name}: {module} of layer {layer} differs between "
                             "the PEFT and the GGUF file")
                # The deltas themselves, as each engine would form them.
                d_peft = SCALE * (b.astype(np.float64) @ a.astype(np.float64))
                d_gguf = SCALE * (gb.astype(np.float64) @ ga.astype(np.float64))
                worst = max(worst, float(np.max(np.abs(d_peft - d_gguf))))
    if worst != 0.0:
        sys.exit(f"check failed: PEFT and GGUF deltas differ by up to {worst}")

    merged = read_safetensors(out / "pirate-merged" / "model.safetensors")
    peft = read_safetensors(out / "pirate" / "adapter_model.safetensors")
    rel_worst = 0.0
    for name, w in weights.items():
        m = merged[name]
        parts = name.split(".")
        module = ".".join(parts[3:5]) if len(parts) == 6 else None
        if module in dict(TARGETS):
            layer = int(parts[2])
            a = peft[peft_key(layer, module, "A")].astype(np.float64)
            b = peft[peft_key(layer, module, "B")].astype(np.float64)
            want = w.astype(np.float64) + SCALE * (b @ a)
            err = np.max(np.abs(m - want)) / np.max(np.abs(want))
            rel_worst = max(rel_worst, float(err))
        elif not np.array_equal(m, w):
            sys.exit(f"check failed: pirate-merged's {name} differs from the base")
    if rel_worst > 1e-6:
        sys.exit(f"check failed: pirate-merged is off W + delta by {rel_worst:.2e} (relative)")
    return (f"checked: PEFT and GGUF tensors identical once lora_B of q/k is unpermuted (delta "
            f"max |diff| {worst}), merged = W + delta within {rel_worst:.1e}")


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

README_TEXT = """\
Test LoRA adapters for SmolLM2-135M-Instruct ({base_id}), made by
testkit/python/smollm2_lora.py from
  {base_dir}
the f32 Hugging Face twin of
  {base_gguf}
Random, untrained weights from fixed seeds.

Good adapters: rank {r}, lora_alpha {alpha} (scale alpha/r = {scale:g}), f32, targets
{targets} in all {layers} layers;
each delta (alpha/r)·B·A has a Frobenius norm of {rel:g} x its weight's.

  pirate/            PEFT (adapter_config.json, adapter_model.safetensors), seed {seed_pirate}
  pirate.gguf        the same adapter as a llama.cpp GGUF LoRA (lora_B of q/k row-permuted
                     as llama.cpp's converter does)
  formal/            PEFT, seed {seed_formal}
  formal.gguf        the same as GGUF
  pirate-merged/     the base Hugging Face directory with W + (alpha/r)·B·A of `pirate` (f32):
                     the reference for an engine applying pirate/ or pirate.gguf at scale 1

Adapters to refuse:

  bad-shape/         PEFT like pirate, but every q_proj lora_A is [{r}, {bad_in}] ({hidden} expected)
  bad-shape.gguf     the same as GGUF (blk.N.attn_q.weight.lora_a ne = [{bad_in}, {r}])
  other-base.gguf    pirate.gguf with general.architecture = "gemma3"
  bad-target/        PEFT like pirate plus target "qkv_proj" (self_attn.qkv_proj.lora_A/B,
                     [{r}, {hidden}] / [{n_qkv}, {r}]), a module SmolLM2 does not have

manifest.json lists the same for tests.
"""


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        sys.exit("usage: smollm2_lora.py BASE_DIR BASE.gguf OUT_DIR")
    base_dir, base_gguf, out = Path(args[0]), Path(args[1]), Path(args[2])
    start = time.monotonic()
    cfg = json.loads((base_dir / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        sys.exit(f"{base_dir}: model_type {cfg.get('model_type')!r}; expected llama")
    weights = read_safetensors(base_dir / "model.safetensors")

    part = out.with_name(out.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)

    adapters = {name: make_adapter(weights, cfg, seed) for name, seed in SEEDS.items()}
    for name, ab in adapters.items():
        write_peft(part / name, ab, TARGET_MODULES)
        write_gguf(part / f"{name}.gguf", ab, cfg, name)
    pirate = adapters["pirate"]
    write_merged(part / "pirate-merged", base_dir, weights, pirate)

    # bad-shape: q_proj's lora_A with BAD_SHAPE_IN input features, in every layer.
    bad = dict(pirate)
    for layer in range(cfg["num_hidden_layers"]):
        a, b = pirate[(layer, "self_attn.q_proj")]
        bad[(layer, "self_attn.q_proj")] = (np.ascontiguousarray(a[:, :BAD_SHAPE_IN]), b)
    write_peft(part / "bad-shape", bad, TARGET_MODULES)
    write_gguf(part / "bad-shape.gguf", bad, cfg, "bad-shape")
    # other-base: a gemma3 adapter (same tensors).
    write_gguf(part / "other-base.gguf", pirate, cfg, "other-base", arch="gemma3")
    # bad-target: pirate plus a fused qkv_proj the model lacks.
    qkv = dict(pirate)
    n_qkv = cfg["hidden_size"] + 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    for layer in range(cfg["num_hidden_layers"]):
        rng = np.random.default_rng([SEEDS["pirate"], layer, 99])
        a = (rng.standard_normal((RANK, cfg["hidden_size"])) / np.sqrt(cfg["hidden_size"]))
        b = rng.standard_normal((n_qkv, RANK)) * 0.01
        qkv[(layer, "self_attn.qkv_proj")] = (a.astype(np.float32), b.astype(np.float32))
    write_peft(part / "bad-target", qkv, TARGET_MODULES + ["qkv_proj"])

    fields = dict(
        base_id=BASE_MODEL_ID, base_dir=base_dir, base_gguf=base_gguf, r=RANK, alpha=ALPHA,
        scale=SCALE, targets=", ".join(TARGET_MODULES), layers=cfg["num_hidden_layers"],
        rel=REL_DELTA, seed_pirate=SEEDS["pirate"], seed_formal=SEEDS["formal"],
        bad_in=BAD_SHAPE_IN, hidden=cfg["hidden_size"], n_qkv=n_qkv)
    (part / "README.txt").write_text(README_TEXT.format(**fields))
    manifest = {
        "base_model": BASE_MODEL_ID,
        "rank": RANK,
        "lora_alpha": ALPHA,
        "target_modules": TARGET_MODULES,
        "relative_delta": REL_DELTA,
        "good": {
            name: {"peft": name, "gguf": f"{name}.gguf", "seed": seed}
            for name, seed in SEEDS.items()
        },
        "merged": {"pirate": "pirate-merged"},
        "bad": {
            "bad-shape": {"peft": "bad-shape", "gguf": "bad-shape.gguf",
                          "why": f"q_proj lora_A has {BAD_SHAPE_IN} input features, not "
                                 f"{cfg['hidden_size']}"},
            "other-base": {"gguf": "other-base.gguf",
                           "why": "general.architecture is gemma3, the model is llama"},
            "bad-target": {"peft": "bad-target",
                           "why": "target module qkv_proj does not exist in the model"},
        },
    }
    (part / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    checked = check(part, base_gguf, weights, cfg)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(part, out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: SmolLM2 test adapters in {time.monotonic() - start:.1f}s "
          f"({size / 2**20:.0f} MiB counting pirate-merged's links); {checked}")


if __name__ == "__main__":
    main()
