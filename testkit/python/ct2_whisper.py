"""A CTranslate2 Whisper checkpoint rewritten as the Hugging Face safetensors directory the
native engine (and transformers) load: `python ct2_whisper.py CT2_DIR OUT_DIR`.

CTranslate2's `model.bin` (binary version 6: a spec name, a revision, then named tensors, each
a rank, dims, a dtype code, a byte count and the little-endian data, then aliases) holds the
same numbers as the transformers checkpoint it was converted from, under other names and with
some projections fused; this undoes that without touching a value:

- self-attention `linear_0` is q, k and v stacked by rows (and a bias for k, all zeros: Whisper's
  k projection has none, and the zeros are checked), `linear_1` the output;
- cross-attention `linear_0` is q, `linear_1` k and v stacked, `linear_2` the output;
- `position_encodings/encodings` are the encoder's sinusoids and the decoder's learned
  positions, `decoder/projection` an alias of the token embeddings (tied, as in transformers);
- the tensors stay in their stored dtype (float16 for the released checkpoints).

The shape comes from the tensors (widths, layers, mel bins, vocabulary) and the heads from the
spec's own `num_heads`; the token ids (end of text, start of transcript, no timestamps) from the
tokenizer; suppressed tokens, alignment heads and languages from CTranslate2's `config.json`.
English-only checkpoints (a 51,864-token vocabulary, as every released `.en` Whisper has) are
marked `is_multilingual: false` in `generation_config.json`, as transformers' own are.
"""
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# CTranslate2's DataType codes.
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
ENGLISH_ONLY_VOCAB = 51864


def read_ct2(path: Path) -> dict:
    b = path.read_bytes()
    off = 0

    def take(fmt):
        nonlocal off
        v = struct.unpack_from("<" + fmt, b, off)
        off += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal off
        n = take("H")
        s = b[off:off + n - 1].decode()
        off += n
        return s

    version = take("I")
    if version != 6:
        raise SystemExit(f"{path}: CTranslate2 binary version {version}, this converter reads 6")
    spec = string()
    if spec != "WhisperSpec":
        raise SystemExit(f"{path}: a {spec}, not a WhisperSpec")
    take("I")  # revision
    out = {}
    for _ in range(take("I")):
        name = string()
        shape = [take("I") for _ in range(take("B"))]
        dtype = DTYPES[take("B")]
        nbytes = take("I")
        if dtype == "bfloat16":
            raise SystemExit(f"{path}: {name} is bfloat16, which this converter does not read")
        a = np.frombuffer(b, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=off)
        off += nbytes
        out[name] = a.reshape(shape)
    for _ in range(take("I")):
        alias, target = string(), string()
        out[alias] = out[target]
    if off != len(b):
        raise SystemExit(f"{path}: {len(b) - off} bytes after the last alias")
    return out


def convert(src: Path, dst: Path):
    t = read_ct2(src / "model.bin")
    ct2 = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    eot, sot, no_ts = ids["<|endoftext|>"], ids["<|startoftranscript|>"], ids["<|notimestamps|>"]

    w = {}

    def put(name, a):
        w[name] = np.ascontiguousarray(a)

    def layers(prefix):
        heads = (k[len(prefix):].split("/")[0] for k in t if k.startswith(prefix))
        return sorted({int(h) for h in heads if h.isdigit()})

    def norm(hf, ct):
        put(f"{hf}.weight", t[f"{ct}/gamma"])
        put(f"{hf}.bias", t[f"{ct}/beta"])

    def linear(hf, ct, bias=True):
        put(f"{hf}.weight", t[f"{ct}/weight"])
        if bias:
            put(f"{hf}.bias", t[f"{ct}/bias"])

    def split_qkv(hf, ct, names):
        wt, bs = t[f"{ct}/weight"], t[f"{ct}/bias"]
        d = wt.shape[1]
        for i, n in enumerate(names):
            put(f"{hf}.{n}.weight", wt[i * d:(i + 1) * d])
            if n == "k_proj":
                if np.any(bs[i * d:(i + 1) * d] != 0):
                    raise SystemExit(f"{ct}: a non-zero k bias, which Whisper does not have")
            else:
                put(f"{hf}.{n}.bias", bs[i * d:(i + 1) * d])

    def ffn(hf, ct):
        norm(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")
        linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")

    def self_attn(hf, ct):
        norm(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
        split_qkv(f"{hf}.self_attn", f"{ct}/self_attention/linear_0", ["q_proj", "k_proj", "v_proj"])
        linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")

    for c in ("conv1", "conv2"):
        linear(f"model.encoder.{c}", f"encoder/{c}")
    put("model.encoder.embed_positions.weight", t["encoder/position_encodings/encodings"])
    enc_layers = layers("encoder/layer_")
    for i in enc_layers:
        hf, ct = f"model.encoder.layers.{i}", f"encoder/layer_{i}"
        self_attn(hf, ct)
        ffn(hf, ct)
    norm("model.encoder.layer_norm", "encoder/layer_norm")

    put("model.decoder.embed_tokens.weight", t["decoder/embeddings/weight"])
    put("model.decoder.embed_positions.weight", t["decoder/position_encodings/encodings"])
    dec_layers = layers("decoder/layer_")
    for i in dec_layers:
        hf, ct = f"model.decoder.layers.{i}", f"decoder/layer_{i}"
        self_attn(hf, ct)
        norm(f"{hf}.encoder_attn_layer_norm", f"{ct}/attention/layer_norm")
        linear(f"{hf}.encoder_attn.q_proj", f"{ct}/attention/linear_0")
        split_qkv(f"{hf}.encoder_attn", f"{ct}/attention/linear_1", ["k_proj", "v_proj"])
        linear(f"{hf}.encoder_attn.out_proj", f"{ct}/attention/linear_2")
        ffn(hf, ct)
    norm("model.decoder.layer_norm", "decoder/layer_norm")
    if not np.array_equal(t["decoder/projection/weight"], t["decoder/embeddings/weight"]):
        raise SystemExit("decoder/projection is not the token embeddings: an untied output layer")

    vocab, d = t["decoder/embeddings/weight"].shape
    heads = int(t["encoder/num_heads"])
    if int(t["decoder/num_heads"]) != heads:
        raise SystemExit("encoder and decoder heads differ")
    ffn_dim = t["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    multilingual = vocab != ENGLISH_ONLY_VOCAB
    config = {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
        "activation_function": "gelu", "d_model": int(d), "vocab_size": int(vocab),
        "encoder_layers": len(enc_layers), "decoder_layers": len(dec_layers), "num_hidden_layers": len(enc_layers),
        "encoder_attention_heads": heads, "decoder_attention_heads": heads,
        "encoder_ffn_dim": int(ffn_dim), "decoder_ffn_dim": int(ffn_dim),
        "num_mel_bins": int(t["encoder/conv1/weight"].shape[1]),
        "max_source_positions": int(t["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(t["decoder/position_encodings/encodings"].shape[0]),
        "scale_embedding": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": sot, "decoder_start_token_id": sot, "eos_token_id": eot, "pad_token_id": eot,
        "suppress_tokens": ct2["suppress_ids"], "begin_suppress_tokens": ct2["suppress_ids_begin"],
        "torch_dtype": "float16",
    }
    generation = {
        "alignment_heads": ct2.get("alignment_heads", []),
        "begin_suppress_tokens": ct2["suppress_ids_begin"], "suppress_tokens": ct2["suppress_ids"],
        "bos_token_id": sot, "decoder_start_token_id": sot, "eos_token_id": eot, "pad_token_id": eot,
        "is_multilingual": multilingual, "max_initial_timestamp_index": 50,
        "max_length": config["max_target_positions"], "no_timestamps_token_id": no_ts,
        "prev_sot_token_id": ids.get("<|startofprev|>"), "return_timestamps": False,
    }
    if multilingual:
        names = {i: c for c, i in ids.items()}
        generation["lang_to_id"] = {names[i]: i for i in ct2["lang_ids"]}
        generation["task_to_id"] = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=1))
    (dst / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": config["num_mel_bins"],
        "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400,
        "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right", "padding_value": 0.0,
        "return_attention_mask": False,
    }, indent=1))
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    print(f"{dst.name}: Whisper {d} wide, {len(enc_layers)}+{len(dec_layers)} layers, vocabulary {vocab}, "
          f"{'multilingual' if multilingual else 'English-only'}, {len(w)} tensors", flush=True)


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
