#!/usr/bin/env python3
"""Convert a llama-architecture GGUF file into a Hugging Face style model directory.

The native engine reads Hugging Face checkpoints (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json), while the only instruct model
the tests have (SmolLM2-135M-Instruct) ships as a GGUF file for the llama.cpp engine. This script
turns such a GGUF into a directory the native engine can load, so both engines can be run and
compared on the same model:

* config.json for LlamaForCausalLM, from the GGUF metadata;
* model.safetensors with the Hugging Face tensor names; quantized tensors are dequantized with
  `gguf.quants.dequantize` and written as f32 (exact dequantized values) or, with
  `--dtype bf16`, rounded to bf16. llama.cpp's converter permutes the rows of q_proj and k_proj
  of llama models (rotary pairs interleaved instead of split in halves); that is undone here;
* tokenizer.json (byte-level BPE) from tokenizer.ggml.tokens / merges / token_type, with the
  pre-tokenizer implied by tokenizer.ggml.pre; control tokens become special added tokens;
* tokenizer_config.json (chat template, BOS/EOS) and generation_config.json (EOS ids).

Only the standard library, numpy, the `gguf` package and hf_files.py beside this file are used.

Usage: python testkit/python/gguf_to_hf.py IN.gguf OUT_DIR [--dtype f32|bf16]

The conversion is idempotent: a marker file, written last, records the input's size and
modification time, the output dtype and the converter version; when OUT_DIR already holds a
complete conversion of the same input, nothing is done. Every file is written under a
temporary name and renamed into place, so a reader never sees a half-written file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

try:
    import gguf
    from gguf.quants import dequantize
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("gguf_to_hf.py needs the `gguf` package (pip install gguf==0.19.0)")

from hf_files import to_bf16_bits, write_safetensors

CONVERTER_VERSION = 1
MARKER = ".gguf_to_hf.json"
OUTPUT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6,
)

# tokenizer.ggml.pre values whose llama.cpp pre-tokenizer is GPT-2's regex, alone.
GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais", "trillion", "granite-docling"}
# ... and those where llama.cpp first splits every digit on its own (`\p{N}`), then applies
# GPT-2's regex: in `tokenizers` terms, Digits(individual_digits) followed by ByteLevel.
DIGITS_THEN_GPT2_PRE = {
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum",
}


# --------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------


class Meta:
    def __init__(self, reader: gguf.GGUFReader):
        self.fields = reader.fields

    def get(self, key, default=None):
        field = self.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def req(self, key):
        value = self.get(key)
        if value is None:
            sys.exit(f"the GGUF file has no `{key}`; cannot convert")
        return value


def f32_value(x) -> float:
    """A GGUF f32 as the shortest decimal that round-trips (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def llama_config(meta: Meta, n_vocab: int, tied: bool, dtype: str) -> dict:
    arch = meta.req("general.architecture")
    if arch != "llama":
        sys.exit(f"general.architecture is {arch!r}; this converter handles `llama` only")
    p = "llama."
    hidden = int(meta.req(p + "embedding_length"))
    n_heads = int(meta.req(p + "attention.head_count"))
    n_kv = int(meta.get(p + "attention.head_count_kv", n_heads))
    head_dim = int(meta.get(p + "attention.key_length", hidden // n_heads))
    rope_dim = meta.get(p + "rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        sys.exit(f"partial rotary (rope.dimension_count {rope_dim} != head_dim {head_dim}) "
                 "is not a LlamaForCausalLM option")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.req(p + "feed_forward_length")),
        "num_hidden_layers": int(meta.req(p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f32_value(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": f32_value(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(p + "context_length", 4096)),
        "vocab_size": n_vocab,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": {"f32": "float32", "bf16": "bfloat16"}[dtype],
    }
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        factor = meta.get(p + "rope.scaling.factor")
        if scaling != "linear" or factor is None:
            sys.exit(f"rope scaling {scaling!r} is not supported by this converter")
        cfg["rope_scaling"] = {"type": "linear", "rope_type": "linear", "factor": f32_value(factor)}
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            cfg[key] = int(value)
    return cfg


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------

LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp stores that have no Hugging Face counterpart (computed, not learned).
SKIPPED = {"rope_freqs.weight"}


def hf_name(name: str) -> str | None:
    if name in SKIPPED:
        return None
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    sys.exit(f"tensor {name} has no Hugging Face llama counterpart; cannot convert")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute of q_proj / k_proj rows."""
    dim = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, dim // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def tensor_array(t, n_heads: int, n_kv: int) -> np.ndarray:
    """Dequantize a GGUF tensor into an f32 array of the Hugging Face shape."""
    shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
    data = dequantize(t.data, t.tensor_type)
    w = np.asarray(data, dtype=np.float32).reshape(shape)
    if t.name.endswith("attn_q.weight"):
        w = unpermute(w, n_heads)
    elif t.name.endswith("attn_k.weight"):
        w = unpermute(w, n_kv)
    return np.ascontiguousarray(w)


def write_weights(path: Path, tensors, cfg: dict, dtype: str) -> int:
    """Every tensor, by Hugging Face name, into one safetensors file, each dequantized when its
    turn comes; returns the file's size in bytes."""
    st_dtype = {"f32": "F32", "bf16": "BF16"}[dtype]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def data(t):
        w = tensor_array(t, n_heads, n_kv)
        return to_bf16_bits(w) if dtype == "bf16" else w.astype("<f4", copy=False)

    entries = []
    for t in tensors:
        name = hf_name(t.name)
        if name is not None:
            shape = [int(d) for d in reversed([int(x) for x in t.shape])]
            entries.append((name, st_dtype, shape, lambda t=t: data(t)))
    entries.sort(key=lambda e: e[0])
    return write_safetensors(path, entries, {"format": "pt", "source": "gguf"})


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def pre_tokenizer_for(pre: str) -> dict:
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    if pre in GPT2_PRE:
        return byte_level
    if pre in DIGITS_THEN_GPT2_PRE:
        return {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        }
    sys.exit(f"tokenizer.ggml.pre {pre!r}: its llama.cpp pre-tokenizer regex is not mapped "
             "by this converter")


def tokenizer_json(meta: Meta) -> dict:
    model = meta.req("tokenizer.ggml.model")
    if model != "gpt2":
        sys.exit(f"tokenizer.ggml.model is {model!r}; this converter handles byte-level BPE "
                 "(`gpt2`) only")
    tokens = list(meta.req("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    merges = list(meta.req("tokenizer.ggml.merges"))
    pre = meta.get("tokenizer.ggml.pre", "default")
    added = []
    for i, (text, ty) in enumerate(zip(tokens, types)):
        if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            added.append({
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": ty != TOKEN_CONTROL,
                "special": ty == TOKEN_CONTROL,
            })
    vocab = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    if len(vocab) != len(tokens):
        print(f"warning: {len(tokens) - len(vocab)} duplicate token texts in the GGUF vocabulary",
              file=sys.stderr)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or " " in b:
            sys.exit(f"merge {m!r} is not two space-separated tokens")
        pairs.append([a, b])
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer_for(pre),
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": pairs,
        },
    }


def tokenizer_config(meta: Meta, cfg: dict) -> dict:
    tokens = meta.req("tokenizer.ggml.tokens")

    def text(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    out = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
    }
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                      ("unk_token", "unknown")):
        value = text(name)
        if value is not None:
            out[key] = value
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template
    return out


def generation_config(meta: Meta, cfg: dict) -> dict:
    eos = []
    for key in ("eos", "eot", "eom"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and int(i) not in eos:
            eos.append(int(i))
    out = {"_from_model_config": True}
    if "bos_token_id" in cfg:
        out["bos_token_id"] = cfg["bos_token_id"]
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "pad_token_id" in cfg:
        out["pad_token_id"] = cfg["pad_token_id"]
    return out


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def input_identity(src: Path, dtype: str) -> dict:
    st = src.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "input": str(src.resolve()),
        "input_size": st.st_size,
        "input_mtime_ns": st.st_mtime_ns,
        "dtype": dtype,
    }


def already_converted(out: Path, identity: dict) -> bool:
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == identity and all((out / f).is_file() for f in OUTPUT_FILES)


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def convert(src: Path, out: Path, dtype: str) -> None:
    identity = input_identity(src, dtype)
    if already_converted(out, identity):
        print(f"{out}: already holds a conversion of {src} ({dtype}); nothing to do")
        return
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    try:
        (out / MARKER).unlink()  # an interrupted run must not look complete
    except FileNotFoundError:
        pass

    reader = gguf.GGUFReader(str(src))
    meta = Meta(reader)
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        sys.exit("the GGUF file has no token_embd.weight")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    n_vocab = int(embd.shape[1])
    n_tokens = len(meta.req("tokenizer.ggml.tokens"))
    if n_tokens > n_vocab:
        sys.exit(f"{n_tokens} tokens but only {n_vocab} embedding rows")
    tied = "output.weight" not in names
    cfg = llama_config(meta, n_vocab, tied, dtype)

    tmp = out / "model.safetensors.tmp"
    size = write_weights(tmp, reader.tensors, cfg, dtype)
    os.replace(tmp, out / "model.safetensors")
    write_json(out / "config.json", cfg)
    write_json(out / "tokenizer.json", tokenizer_json(meta))
    write_json(out / "tokenizer_config.json", tokenizer_config(meta, cfg))
    write_json(out / "generation_config.json", generation_config(meta, cfg))
    write_json(out / MARKER, identity)  # last: marks the conversion complete
    print(f"{out}: converted {src.name} in {time.monotonic() - start:.1f}s "
          f"(model.safetensors {size / 2**20:.1f} MiB, {dtype}, "
          f"{'tied' if tied else 'untied'} embeddings, pre-tokenizer "
          f"{meta.get('tokenizer.ggml.pre', 'default')!r})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", type=Path, help="the .gguf file")
    ap.add_argument("out_dir", type=Path, help="the Hugging Face style directory to write")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                    help="weight dtype in model.safetensors (default f32: exact dequantized "
                         "values)")
    args = ap.parse_args(argv)
    if not args.input.is_file():
        sys.exit(f"{args.input}: no such file")
    convert(args.input, args.out_dir, args.dtype)


if __name__ == "__main__":
    main()
