"""A tiny random Whisper written by transformers, and transformers' own answers (run by
hf_reference.py; engines/native/tests/whisper.rs reads them).

`WhisperForConditionalGeneration` at toy size (64 wide, two encoder and two decoder layers, 80
mel bins, the real 1500 encoder positions, i.e. 30 s of audio), its weights re-drawn as
hf_reference.py re-draws a decoder's (the encoder's sinusoidal positions kept), saved in float32
with a word-level tokenizer that has Whisper's special tokens after the 256 words. For two
deterministic signals (3 s of tones, a chirp and noise; 1.3 s of other tones):

- the log-mel features transformers' `WhisperFeatureExtractor` computes (a few frames of them,
  to check the engine's front end on its own);
- the log-probabilities of the whole vocabulary after each token of the decoder prompt
  `<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`;
- the greedy continuation (plain argmax over the model's logits, 24 tokens, no logits
  processors) and the log-probabilities at each of its positions;
- the language transformers' `detect_language` hears (of `<|en|>` and `<|de|>`).
"""
import json
import math
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

WORDS = 256
SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
           "<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(31)]
ID = {t: WORDS + i for i, t in enumerate(SPECIAL)}
PROMPT = [ID["<|startoftranscript|>"], ID["<|en|>"], ID["<|transcribe|>"], ID["<|notimestamps|>"]]
NEW_TOKENS = 24
PROBE_FRAMES = [0, 1, 50, 150, 151, 299, 1000, 2999]
RATE = 16000


def signals():
    g = np.random.default_rng(11)
    t = np.arange(3 * RATE) / RATE
    a = 0.3 * np.sin(2 * math.pi * 440 * t) + 0.2 * np.sin(2 * math.pi * (200 + 300 * t) * t) \
        + 0.05 * g.standard_normal(t.size)
    t = np.arange(int(1.3 * RATE)) / RATE
    b = 0.4 * np.sin(2 * math.pi * 97 * t) * np.sin(2 * math.pi * 3 * t) + 0.1 * np.sin(2 * math.pi * 2500 * t)
    return [a.astype(np.float32), b.astype(np.float32)]


def make(seed: int):
    cfg = WhisperConfig(
        vocab_size=WORDS + len(SPECIAL), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=64, decoder_start_token_id=ID["<|startoftranscript|>"],
        eos_token_id=ID["<|endoftext|>"], pad_token_id=ID["<|endoftext|>"], bos_token_id=ID["<|endoftext|>"],
        begin_suppress_tokens=None, suppress_tokens=None,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "encoder.embed_positions" in name:
                continue  # the sinusoids Whisper is trained with
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                # Also the output layer (tied): logits of a softer spread than N(0, 1) rows give.
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed_positions" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                # The decoder's layer outputs three times larger: with the output layer tied to
                # the token embeddings, a residual stream dominated by the input token's
                # embedding predicts that token again and again.
                big = name.startswith("model.decoder.layers") and ("fc2" in name or "self_attn.out_proj" in name)
                p.copy_((3.0 if big else 1.0) * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif p.dim() == 3:  # convolutions: [out][in][k]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1] * p.shape[2]))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def write_tokenizer(out: Path):
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(WORDS)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(out / "tokenizer.json"))


def log_probs(model, features, ids):
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def write(out: Path, seed: int):
    model = make(seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE)
    languages = {t: i for t, i in ID.items() if t in ("<|en|>", "<|de|>")}
    model.generation_config.lang_to_id = languages
    cases = []
    for audio in signals():
        features = extractor(audio, sampling_rate=RATE, return_tensors="pt").input_features
        with torch.no_grad():
            detected = int(model.detect_language(input_features=features)[0])
        prompt_lp = log_probs(model, features, PROMPT)
        ids = list(PROMPT)
        for _ in range(NEW_TOKENS):
            ids.append(int(log_probs(model, features, ids)[-1].argmax()))
        full = log_probs(model, features, ids)
        cases.append({
            "audio": audio.tolist(),
            "features": {str(f): features[0, :, f].tolist() for f in PROBE_FRAMES},
            "prompt_logprobs": prompt_lp.tolist(),
            "greedy": ids[len(PROMPT):],
            "greedy_logprobs": full[len(PROMPT) - 1:len(PROMPT) - 1 + NEW_TOKENS].tolist(),
            # transformers' `detect_language`: the likelier of <|en|> and <|de|> after the start.
            "language": next(t[2:-2] for t, i in languages.items() if i == detected),
        })
    (out / "reference.json").write_text(json.dumps({
        "class": model.config.architectures[0] if model.config.architectures else "WhisperForConditionalGeneration",
        "transformers": __import__("transformers").__version__, "torch": torch.__version__,
        "sample_rate": RATE, "prompt": PROMPT, "cases": cases,
    }))
    print(f"{out.name}: WhisperForConditionalGeneration, greedy {cases[0]['greedy'][:8]}...", flush=True)


def read_wav(path: Path) -> np.ndarray:
    import wave
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE), path
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0


def processed_top(model, features, prompt, ids, stamps, k=20):
    """transformers' logits processors (as `generate` orders them) over one forward pass of the
    decoder prompt and `ids`: the `k` likeliest tokens' log-probabilities at each sampled step."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor)
    gc = model.generation_config
    begin = len(prompt)
    procs = [SuppressTokensAtBeginLogitsProcessor(gc.begin_suppress_tokens, begin_index=begin),
             SuppressTokensLogitsProcessor(gc.suppress_tokens)]
    if stamps:
        procs.append(WhisperTimeStampLogitsProcessor(gc, begin_index=begin))
    procs = LogitsProcessorList(procs)
    full = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=full).logits[0]
    out = []
    for j in range(len(ids)):
        pos = begin - 1 + j
        s = procs(full[:, :pos + 1], logits[pos:pos + 1].clone())
        v, i = torch.log_softmax(s[0].float(), dim=-1).topk(k)
        out.append([[int(a), float(b)] for a, b in zip(i, v)])
    return out


def real(model_dir: Path, speech_dir: Path, out: Path):
    """Transformers' `generate` (greedy, the checkpoint's own generation config: suppressed
    tokens, and the timestamp rules when asked for) on every recording in `speech_dir`, without
    and with timestamps: the sampled tokens, their text, and the 20 likeliest tokens' log-
    probabilities at each step after the logits processors (what the engine's rules give); and
    each recording's no-speech probability."""
    from transformers import WhisperTokenizerFast
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.forced_decoder_ids = None
    gc = model.generation_config
    extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
    tok = WhisperTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    transcripts = json.loads((speech_dir / "transcripts.json").read_text())
    cases = []
    for name in sorted(transcripts):
        features = extractor(read_wav(speech_dir / name), sampling_rate=RATE, return_tensors="pt").input_features
        case = {"file": name}
        for key, stamps in (("plain", False), ("timestamps", True)):
            with torch.no_grad():
                g = model.generate(features, num_beams=1, do_sample=False, return_timestamps=stamps)
            # transformers returns the sampled tokens without the decoder prompt (an
            # English-only model's: start of transcript, and no timestamps unless asked for).
            ids = g[0].tolist()
            prompt = [gc.decoder_start_token_id] + ([] if stamps else [gc.no_timestamps_token_id])
            case[key] = {"prompt": prompt, "tokens": ids, "text": tok.decode(ids, skip_special_tokens=True).strip(),
                         "top": processed_top(model, features, prompt, ids, stamps)}
        # openai-whisper's no-speech probability: `<|nospeech|>` (`<|nocaptions|>` in this
        # vocabulary) after the start of transcript, from the raw logits.
        no_speech = tok.convert_tokens_to_ids("<|nospeech|>")
        if no_speech is None or no_speech == tok.unk_token_id:
            no_speech = tok.convert_tokens_to_ids("<|nocaptions|>")
        with torch.no_grad():
            sot = model(input_features=features,
                        decoder_input_ids=torch.tensor([[gc.decoder_start_token_id]])).logits[0, -1]
        case["no_speech_prob"] = float(sot.float().softmax(-1)[no_speech])
        cases.append(case)
        print(f"whisper-tiny.en {name}: {case['plain']['text']!r}", flush=True)
    out.write_text(json.dumps({"transformers": __import__("transformers").__version__, "cases": cases}))
