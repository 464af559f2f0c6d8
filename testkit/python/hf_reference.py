"""Tiny random checkpoints written by Hugging Face transformers, and transformers' own answers.

The native engine's independent reference (engines/native/tests/reference.rs): for every
architecture the engine runs, this script builds a small config with `AutoConfig.for_model`,
makes the model with `AutoModelForCausalLM.from_config` under a fixed seed, saves it with
`save_pretrained` (float32, and a bfloat16 twin), and records what transformers computes on the
CPU:

- the log-probabilities of the whole vocabulary at every position of a few prompts (one
  forward pass each);
- the greedy continuation of each prompt by `generate` (32 tokens, transformers' KV cache),
  and the log-probabilities at each generated position under teacher forcing.

The bfloat16 twin's reference is the float32 forward pass of the bfloat16-rounded weights,
twice: as is, and with every linear layer's input rounded to bfloat16 first (`bf16_activations`),
which is what the engine's bf16 kernel computes (bf16 products, f32 sums) on CPUs that have
one. The test compares with the one that matches the engine's kernel.

Weights are re-drawn with larger scales than transformers' training initialisation (which
makes every next-token distribution almost uniform and every comparison weak): linear layers
N(0, 1/fan_in), embeddings N(0, 1), norm weights around their neutral value, a sharper output
layer.

FP8 (`qwen3-fp8`): the Qwen3 model's decoder-layer projections quantized to float8_e4m3fn in
blocks of 32x32 with one f32 scale each (`weight_scale_inv`, the layout of FP8 checkpoints on the
Hub, `quantization_config` `quant_method: fp8`), everything else in bf16; its reference is
computed from the weights the engine dequantizes them to (q x scale, in bf16).

Embedding models (`ENCODERS`, a tiny BertModel): the checkpoint with a sentence-transformers
`modules.json` (mean pooling, then L2 normalisation), and the embedding of each prompt computed
that way from transformers' `last_hidden_state`.

Families only the llama.cpp plugin runs (`LLAMA_CPP_ONLY`, float32 only) get the same reference;
OUT_DIR/llama-cpp-families.txt names every checkpoint setup converts to GGUF for that plugin.

Speech recognition (`whisper-float32`): a tiny WhisperForConditionalGeneration and transformers'
log-mel features and decoder log-probabilities on two signals, written by hf_whisper.py.

Families transformers 4.57 does not have (`ARCHS_V5`: Nemotron-H) are written the same way by
transformers 5 (scripts/requirements-reference-5.txt, installed beside the same PyTorch):
`hf_reference.py v5 OUT_DIR`.

Usage: hf_reference.py OUT_DIR
       hf_reference.py v5 OUT_DIR   (ARCHS_V5 only, under transformers 5)
       hf_reference.py minilm MODEL_DIR OUT_JSON   (a real sentence-transformers model: the
           embeddings transformers gives the texts of MINILM_TEXTS, tokenized by its own
           tokenizer, mean-pooled and normalised as the model's modules.json says)
       hf_reference.py whisper-real MODEL_DIR SPEECH_DIR OUT_JSON   (a real Whisper: transformers'
           greedy transcriptions of real recordings, without and with timestamps; hf_whisper.py)
Writes OUT_DIR/<name>-<dtype>/ (config.json, model.safetensors, tokenizer.json) and
OUT_DIR/<name>-<dtype>/reference.json.
"""
import copy
import json
import math
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hf_families import (
    ARCHS, ARCHS_V5, COMMON, ENCODERS, LLAMA_CPP_ONLY, LLAMA_CPP_SHARED, NEW_TOKENS, OMIT,
    PROMPT_LENGTHS, VOCAB,
)


def make_encoder(model_type: str, config: dict, seed: int):
    cfg = AutoConfig.for_model(model_type, **config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModel.from_config(cfg, dtype=torch.float32, add_pooling_layer=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2 and "embeddings" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif p.dim() == 2:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def write_sentence_transformers(out: Path, dims: int):
    """The modules a sentence-transformers directory declares: mean pooling, then Normalize."""
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": dims, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))


def embeddings(model, prompts):
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
            out.append(torch.nn.functional.normalize(h.mean(dim=0), dim=0).tolist())
    return out


def make_model(model_type: str, extra: dict, seed: int):
    given = {k: v for k, v in {**COMMON, **extra}.items() if v is not OMIT}
    cfg = AutoConfig.for_model(model_type, **given)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gemma = model_type.startswith("gemma")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.startswith("ln_"):
                # Gemma's norms multiply by (1 + w): neutral is 0, elsewhere 1.
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or name == "model.embeddings.weight":
                # Gemma scales its embeddings by sqrt(hidden): keep the scaled rows near RMS 1.
                scale = 1.0 / math.sqrt(p.shape[1]) if gemma else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                scale = 1.0 / math.sqrt(p.shape[1])
                if name.startswith("lm_head"):
                    scale *= 3.0
                p.copy_(scale * torch.randn(p.shape, generator=g))
            elif model_type == "nemotron_h" and p.dim() == 3:
                # Its experts, stored as one [experts][rows][cols] tensor each (transformers 5).
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[2]))
            elif model_type == "gpt_oss" and p.dim() == 3:
                # Its experts, [experts][in][out]; gate/up four times larger, so some gate and
                # up values pass the SwiGLU clamp (7).
                scale = (4.0 if "gate_up" in name else 1.0) / math.sqrt(p.shape[1])
                p.copy_(scale * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):
                # gpt-oss's per-head sink logits, of the attention scores' size.
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # A learned routing bias (a buffer, zero at initialisation).
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


FP8_BLOCK = 32


def quantize_fp8(model, out: Path):
    """Write `model` as an FP8 checkpoint; return the state dict the engine dequantizes it to."""
    from safetensors.torch import save_file
    tensors, dequantized = {}, {}
    for name, p in model.state_dict().items():
        w = p.detach().float()
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            rows, cols = w.shape
            br, bc = FP8_BLOCK, FP8_BLOCK
            blocks = w.reshape(rows // br, br, cols // bc, bc)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            deq = (q.float() * scale[:, None, :, None]).reshape(rows, cols)
            tensors[name] = q.reshape(rows, cols).contiguous()
            tensors[name + "_scale_inv"] = scale.contiguous()
            dequantized[name] = deq.to(torch.bfloat16).float()
        else:
            tensors[name] = w.to(torch.bfloat16).contiguous()
            dequantized[name] = tensors[name].float()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return dequantized


FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4(w):
    """`w` `[..][out][in]` as MXFP4 blocks `[..][out][in / 32][16]` (two e2m1 codes a byte, low
    nibble first) and scales `[..][out][in / 32]` (a power of two, biased by 127): each block of
    32 scaled so its largest magnitude fits e2m1's 6, each value rounded to the nearest code."""
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0))
    codes = (blocks / torch.exp2(exp)).unsqueeze(-1).sub(FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8).contiguous()


def write_mxfp4(model, out: Path):
    """`model` (gpt-oss) as its released files are: the experts' fused projections in MXFP4
    (`*_blocks`, `*_scales`, rows as outputs), everything else in bf16, `quant_method: mxfp4`."""
    from safetensors.torch import save_file
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4(p.detach().float().transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = p.detach().to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out)


def read_mxfp4(model, out: Path):
    """The MXFP4 checkpoint in `out` as transformers reads it on a CPU: every tensor from the
    file, the experts' blocks dequantized by transformers' own `convert_moe_packed_tensors`
    (what `from_pretrained` does without a GPU; its quantizer also needs `accelerate`, which
    nothing else here does), into a float32 copy of `model`."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    saved = load_file(str(out / "model.safetensors"))
    state = {}
    for name, t in saved.items():
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            state[base] = convert_moe_packed_tensors(t, saved[base + "_scales"]).float()
        elif not name.endswith("_scales"):
            state[name] = t.float()
    ref_model = copy.deepcopy(model).float()
    ref_model.load_state_dict(state)
    ref_model.config._attn_implementation = "eager"
    return ref_model.eval()


def save_twin(model, out: Path, dtype: str) -> Path:
    """`model` saved by transformers into `out` in `dtype` (the model itself left in float32),
    with the word-level tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    saved = model if dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)
    saved.save_pretrained(out, safe_serialization=True)
    if model.config.model_type == "nemotron_h" and "moe" not in model.config.layers_block_type:
        # Written as a dense release's file is (Nemotron-H 8B): the layer pattern as the
        # `hybrid_override_pattern` string (llama.cpp's converter reads the MLP layers from
        # it), and none of the expert defaults transformers 5 writes into every Nemotron-H
        # config (the converter takes their presence for a mixture of experts).
        cfg = json.loads((out / "config.json").read_text())
        letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
        cfg["hybrid_override_pattern"] = "".join(letters[t] for t in cfg.pop("layers_block_type"))
        cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
        for key in [k for k in cfg if k.startswith("moe_") or k in (
                "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
                "topk_group", "routed_scaling_factor", "norm_topk_prob")]:
            del cfg[key]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out)
    return out


# Tokens a family's loader in llama.cpp looks up by name (Phi-3's: llama.cpp sets their
# attributes when it loads a model named phi3), at their ids in that family's vocabulary.
NAMED_TOKENS = {"phi3": {0: "<unk>", 1: "<s>", 2: "</s>", 3: "<|endoftext|>"}}


def write_tokenizer(out: Path, named: dict | None = None):
    named = named or {}
    vocab = {named.get(i, f"t{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=named.get(0, "t0")))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))


def with_bf16_activations(model, compute):
    """`compute(model)` with the input of every linear product rounded to bf16 (round to
    nearest even, kept in float32: the engine's bf16 kernel), `nn.Linear` layers and experts
    stored as one tensor (`F.linear` on a slice) alike; a router the model runs in float32
    (DeepSeek-V3's, Nemotron-H's: `_keep_in_fp32_modules_strict`) keeps its input, as the
    engine's does."""
    keep = {m.weight.data_ptr() for m in model.modules() if type(m).__name__.endswith("TopkRouter")}
    plain = torch.nn.functional.linear

    def linear(x, w, b=None):
        if w.data_ptr() not in keep:
            x = x.to(torch.bfloat16).to(torch.float32)
        return plain(x, w, b)

    # gpt-oss's experts multiply with `@` (Tensor.__matmul__), rounded likewise while they run
    # (and only then: its rotary embedding multiplies with `@` too).
    plain_matmul = torch.Tensor.__matmul__
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]

    def rounding(forward):
        def run(*args, **kwargs):
            torch.Tensor.__matmul__ = lambda a, b: plain_matmul(a.to(torch.bfloat16).to(torch.float32), b)
            try:
                return forward(*args, **kwargs)
            finally:
                torch.Tensor.__matmul__ = plain_matmul
        return run

    for m in experts:
        m.forward = rounding(m.forward)
    torch.nn.functional.linear = linear
    try:
        return compute(model)
    finally:
        torch.nn.functional.linear = plain
        for m in experts:
            del m.forward


def read_back(out: Path):
    """The decoder checkpoint in `out` as written, in float32, generating without end tokens."""
    # transformers 5 picks a grouped product for experts stored as one tensor; the eager one
    # goes through F.linear, which `with_bf16_activations` rounds.
    v5 = int(__import__("transformers").__version__.split(".")[0]) >= 5
    extra = {"experts_implementation": "eager"} if v5 else {}
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", **extra).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def decoder_reference(model, prompts):
    """The keys reference.json holds for a decoder."""
    prompt_lp, greedy, greedy_lp = reference(model, prompts)
    return {"prompt_logprobs": prompt_lp, "greedy": greedy, "greedy_logprobs": greedy_lp}


def log_probs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def reference(model, prompts):
    prompt_lp, greedy, greedy_lp = [], [], []
    for ids in prompts:
        prompt_lp.append(log_probs(model, ids).tolist())
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        gen = out[0, len(ids):].tolist()
        assert len(gen) == NEW_TOKENS, gen
        greedy.append(gen)
        # The distribution each generated token was taken from, under teacher forcing.
        full = log_probs(model, ids + gen)
        greedy_lp.append(full[len(ids) - 1:len(ids) - 1 + NEW_TOKENS].tolist())
    return prompt_lp, greedy, greedy_lp


MINILM_TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A monkey is playing drums.",
    "Kubernetes schedules pods onto nodes.",
    "Gantry serves language models on Kubernetes through one OpenAI-compatible endpoint.",
    "A man is riding a horse.",
    "A woman is playing the violin.",
    "Two men pushed carts through the woods.",
    "A cheetah is running behind its prey.",
    "The new movie is awesome.",
    "The cat sits outside.",
    "A man is playing guitar.",
    "The new movie is so great.",
    "The dog plays in the garden.",
    "Do you like pizza?",
    "The stock market fell sharply on Monday after the announcement.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "Ünïcödé text, emoji 🙂 and numbers 3.14159 are tokenized too.",
    "short",
]


def minilm(model_dir: Path, out: Path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    vectors, counts = [], []
    with torch.no_grad():
        for text in MINILM_TEXTS:
            enc = tok(text, return_tensors="pt")
            h = model(**enc).last_hidden_state[0]
            vectors.append(torch.nn.functional.normalize(h.mean(dim=0), dim=0).tolist())
            counts.append(int(enc["input_ids"].shape[1]))
    out.write_text(json.dumps({"texts": MINILM_TEXTS, "embeddings": vectors, "prompt_tokens": counts,
                               "transformers": __import__("transformers").__version__}))


def write_decoder(out_root: Path, name: str, model_type: str, extra: dict, seed: int, prompts):
    """One decoder family's float32 and bfloat16 checkpoints and their references; the model."""
    model = make_model(model_type, extra, seed)
    for dtype in ("float32", "bfloat16"):
        out = save_twin(model, out_root / f"{name}-{dtype}", dtype)
        # The reference computes from the checkpoint as written, read back in float32
        # (a model cast in memory would also round its rotary buffers).
        ref_model = read_back(out)
        plain = decoder_reference(ref_model, prompts)
        rounded = None
        if dtype == "bfloat16":
            rounded = with_bf16_activations(ref_model, lambda m: decoder_reference(m, prompts))
        (out / "reference.json").write_text(json.dumps({
            "name": name,
            "class": model.config.architectures[0],
            "dtype": dtype,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
            "prompts": prompts,
            **plain,
            "bf16_activations": rounded,
        }))
        print(f"{out.name}: {model.config.architectures[0]}, greedy {plain['greedy'][0][:8]}...",
              file=sys.stderr)
    return model


def prompt_set():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def main():
    if sys.argv[1] == "minilm":
        minilm(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    if sys.argv[1] == "whisper-real":
        __import__("hf_whisper").real(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
        return
    if sys.argv[1] == "v5":
        out_root = Path(sys.argv[2])
        out_root.mkdir(parents=True, exist_ok=True)
        for seed, (name, (model_type, extra)) in enumerate(ARCHS_V5.items(), start=200):
            write_decoder(out_root, name, model_type, extra, seed, prompt_set())
        # llama.cpp converts them too (setup reads this list after both runs).
        with (out_root / "llama-cpp-families.txt").open("a") as f:
            f.write("".join(f"{name}\n" for name in ARCHS_V5))
        return
    out_root = Path(sys.argv[1])
    out_root.mkdir(parents=True, exist_ok=True)
    prompts = prompt_set()
    for seed, (name, (model_type, extra)) in enumerate(ARCHS.items(), start=1):
        model = write_decoder(out_root, name, model_type, extra, seed, prompts)
        if name == "gpt-oss":
            out = out_root / "gpt-oss-mxfp4"
            write_mxfp4(model, out)
            ref_model = read_mxfp4(model, out)
            plain = decoder_reference(ref_model, prompts)
            rounded = with_bf16_activations(ref_model, lambda m: decoder_reference(m, prompts))
            (out / "reference.json").write_text(json.dumps({
                "name": "gpt-oss-mxfp4", "class": model.config.architectures[0], "dtype": "mxfp4",
                "transformers": __import__("transformers").__version__, "torch": torch.__version__,
                "prompts": prompts, **plain, "bf16_activations": rounded,
            }))
            print(f"{out.name}: MXFP4 experts, greedy {plain['greedy'][0][:8]}...", file=sys.stderr)
        if name == "qwen3":
            out = out_root / "qwen3-fp8"
            dequantized = quantize_fp8(model, out)
            write_tokenizer(out)
            ref_model = copy.deepcopy(model).float()
            ref_model.load_state_dict(dequantized)
            ref_model.config._attn_implementation = "eager"
            ref_model.eval()
            plain = decoder_reference(ref_model, prompts)
            rounded = with_bf16_activations(ref_model, lambda m: decoder_reference(m, prompts))
            (out / "reference.json").write_text(json.dumps({
                "name": name, "class": model.config.architectures[0], "dtype": "fp8",
                "transformers": __import__("transformers").__version__, "torch": torch.__version__,
                "prompts": prompts, **plain, "bf16_activations": rounded,
            }))
            print(f"{out.name}: FP8 blocks of {FP8_BLOCK}, greedy {plain['greedy'][0][:8]}...",
                  file=sys.stderr)
    for seed, (name, (model_type, extra)) in enumerate(LLAMA_CPP_ONLY.items(), start=50):
        model = make_model(model_type, extra, seed)
        out = save_twin(model, out_root / f"{name}-float32", "float32")
        if name in NAMED_TOKENS:
            write_tokenizer(out, NAMED_TOKENS[name])
        ref_model = read_back(out)
        plain = decoder_reference(ref_model, prompts)
        (out / "reference.json").write_text(json.dumps({
            "name": name, "class": model.config.architectures[0], "dtype": "float32",
            "transformers": __import__("transformers").__version__, "torch": torch.__version__,
            "prompts": prompts, **plain, "bf16_activations": None,
        }))
        print(f"{out.name}: {model.config.architectures[0]} (llama.cpp only)", file=sys.stderr)
    # What setup converts to GGUF with llama.cpp's converter (one name a line): the decoders
    # above and the float32 BERT.
    names = LLAMA_CPP_SHARED + list(LLAMA_CPP_ONLY) + list(ENCODERS)
    (out_root / "llama-cpp-families.txt").write_text("\n".join(names) + "\n")
    # Speech recognition: a tiny Whisper and its answers on two signals (hf_whisper.py).
    __import__("hf_whisper").write(out_root / "whisper-float32", 300)
    for seed, (name, (model_type, config)) in enumerate(ENCODERS.items(), start=100):
        model = make_encoder(model_type, config, seed)
        for dtype in ("float32", "bfloat16"):
            out = save_twin(model, out_root / f"{name}-{dtype}", dtype)
            write_sentence_transformers(out, model.config.hidden_size)
            ref_model = AutoModel.from_pretrained(
                out, dtype=torch.float32, attn_implementation="eager", add_pooling_layer=False).eval()
            plain = embeddings(ref_model, prompts)
            rounded = None
            if dtype == "bfloat16":
                rounded = {"embeddings": with_bf16_activations(ref_model, lambda m: embeddings(m, prompts))}
            (out / "reference.json").write_text(json.dumps({
                "name": name, "class": model.config.architectures[0], "dtype": dtype,
                "transformers": __import__("transformers").__version__, "torch": torch.__version__,
                "prompts": prompts, "embeddings": plain, "bf16_activations": rounded,
            }))
            print(f"{out.name}: {model.config.architectures[0]}, {len(plain[0])} dims", file=sys.stderr)


if __name__ == "__main__":
    main()
