"""Make the native engine's real test model from the Gemma 3 270M Q4_K_M GGUF.

    python gemma_bf16.py SOURCE.gguf OUT_DIR OUT.gguf

writes, from the same dequantized values:

- OUT_DIR: a Hugging Face model directory (`config.json` with the real hyper-parameters read
  from the GGUF metadata, one bf16 `model.safetensors`, `tokenizer.json` whose ids are exactly
  the GGUF's vocabulary, `tokenizer_config.json` with Gemma 3's chat template,
  `generation_config.json`);
- OUT.gguf: a GGUF with the original metadata and tokenizer whose matrices are BF16 tensors
  holding the very same bf16 values, for llama.cpp (the differential test's peer).

Every quantized tensor is dequantized by PyPI's `gguf` package, rounded once to bf16 (round to
nearest even, ggml's own rule) and written to both files. llama.cpp's converter stores Gemma's
RMSNorm weights as 1 + w (ggml multiplies by the weight as is); the Hugging Face files hold w,
the GGUF keeps 1 + w in F32 (exact: w is a bf16 value of small magnitude), so both engines
multiply by the same numbers.

Both outputs are written under temporary names and renamed at the end, so an interrupted run
leaves nothing that looks complete.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np

from hf_files import to_bf16_bits, write_safetensors

ARCH = "gemma3"
# llama.cpp's gemma3 graph: every 6th layer attends globally, the others over a sliding window
# with RoPE base 10 000 (llama-model.cpp, LLM_ARCH_GEMMA3; transformers' Gemma3TextConfig).
SLIDING_WINDOW_PATTERN = 6
ROPE_LOCAL_BASE = 10000.0

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# transformers' Gemma 3 chat template (tokenizer_config.json of google/gemma-3-270m-it).
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def tokenizer_json(pieces, scores, types, bos, eos, unk):
    """A `tokenizers` BPE model equivalent to llama.cpp's SentencePiece tokenizer for this vocab.

    SentencePiece (and llama.cpp's port) repeatedly merges the adjacent pair whose concatenation
    is the highest-scoring piece. The same order as BPE merges: every split of a normal piece into
    two pieces is a merge, ranked by the merged piece's score (transformers'
    SentencePieceExtractor builds Gemma's tokenizer.json this way). Control tokens are special
    added tokens; user-defined ones (newline and space runs) are matched before the model, on the
    raw text, as llama.cpp does.
    """
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for i, piece in enumerate(pieces):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        local = []
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None and types[li] == NORMAL and types[ri] == NORMAL:
                local.append((li, ri, left, right))
        local.sort()
        merges.extend((scores[i], n, left, right) for n, (_, _, left, right) in enumerate(local))
    # Highest score first; a stable sort keeps each piece's splits in vocabulary order.
    merges.sort(key=lambda m: -m[0])
    added = []
    for i, piece in enumerate(pieces):
        if types[i] in (CONTROL, UNKNOWN):
            added.append({"id": i, "content": piece, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True})
        elif types[i] == USER_DEFINED:
            added.append({"id": i, "content": piece, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": False})
    bos_piece = pieces[bos]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_piece, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos_piece, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos_piece, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos_piece: {"id": bos_piece, "ids": [bos], "tokens": [bos_piece]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": pieces[unk], "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
            "vocab": vocab,
            "merges": [[left, right] for _, _, left, right in merges],
        },
    }


def main(src: str, out_dir: str, out_gguf: str) -> None:
    reader = gguf.GGUFReader(src)
    if field(reader, "general.architecture") != ARCH:
        sys.exit(f"{src}: expected a {ARCH} GGUF")
    kv = lambda k, d=None: field(reader, f"{ARCH}.{k}", d)
    n_layer = int(kv("block_count"))
    pieces = list(field(reader, "tokenizer.ggml.tokens"))
    scores = [float(s) for s in field(reader, "tokenizer.ggml.scores")]
    types = [int(t) for t in field(reader, "tokenizer.ggml.token_type")]
    bos = int(field(reader, "tokenizer.ggml.bos_token_id"))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
    unk = int(field(reader, "tokenizer.ggml.unknown_token_id"))
    pad = field(reader, "tokenizer.ggml.padding_token_id")
    eot = pieces.index("<end_of_turn>")

    out_dir, out_gguf = Path(out_dir), Path(out_gguf)
    tmp_dir = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)

    # Tensors: one bf16 rounding, shared by both files.
    hf = {}
    gguf_tensors = []
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        name = t.name
        is_norm = name.endswith("norm.weight")
        if is_norm:
            bits = to_bf16_bits(values - 1.0)
            gguf_tensors.append((name, (from_bf16_bits(bits) + np.float32(1.0)).astype(np.float32), None))
        else:
            bits = to_bf16_bits(values)
            gguf_tensors.append((name, bits.view(np.uint8), gguf.GGMLQuantizationType.BF16))
        if name == "token_embd.weight":
            hf_name = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf_name = "model.norm.weight"
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            base = rest.removesuffix(".weight")
            hf_name = f"model.layers.{layer}.{LAYER_NAMES[base]}.weight"
        else:
            sys.exit(f"unexpected tensor {name}")
        hf[hf_name] = ("BF16", bits.shape, bits)

    layer_types = ["full_attention" if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else "sliding_attention" for i in range(n_layer)]
    head_dim = int(kv("attention.key_length"))
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "bos_token_id": bos,
        "eos_token_id": [eos, eot],
        "pad_token_id": int(pad) if pad is not None else 0,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": int(kv("embedding_length")),
        "intermediate_size": int(kv("feed_forward_length")),
        "layer_types": layer_types,
        "max_position_embeddings": int(kv("context_length")),
        "num_attention_heads": int(kv("attention.head_count")),
        "num_hidden_layers": n_layer,
        "num_key_value_heads": int(kv("attention.head_count_kv")),
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": float(np.float32(kv("attention.layer_norm_rms_epsilon"))),
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "rope_scaling": None,
        "rope_theta": float(kv("rope.freq_base")),
        "sliding_window": int(kv("attention.sliding_window")),
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": len(pieces),
    }
    (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": [eos, eot], "pad_token_id": config["pad_token_id"]}, indent=2) + "\n")
    (tmp_dir / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", True)),
        "add_eos_token": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        "bos_token": pieces[bos],
        "eos_token": pieces[eos],
        "unk_token": pieces[unk],
        "pad_token": pieces[config["pad_token_id"]],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "GemmaTokenizer",
    }, indent=2) + "\n")
    with open(tmp_dir / "tokenizer.json", "w") as f:
        json.dump(tokenizer_json(pieces, scores, types, bos, eos, unk), f, ensure_ascii=False)
    write_safetensors(tmp_dir / "model.safetensors", [(n, *v) for n, v in hf.items()], {"format": "pt"})

    # The GGUF twin: original metadata (minus what the writer sets itself), BF16 matrices.
    tmp_gguf = out_gguf.with_name(out_gguf.name + ".partial")
    writer = gguf.GGUFWriter(tmp_gguf, ARCH)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.name"):
            continue
        if key == "general.file_type":
            writer.add_key_value(key, int(gguf.LlamaFileType.MOSTLY_BF16), f.types[0])
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub)
    writer.add_key_value("general.name", "Gemma 3 270m (bf16 from Q4_K_M)", gguf.GGUFValueType.STRING)
    for name, data, qtype in gguf_tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp_gguf, out_gguf)
    os.replace(tmp_dir, out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
