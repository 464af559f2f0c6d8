"""Speech from a Kokoro-distilled voice: Hibari's "heart" (24 kHz, the PyPI package hibari-tts
0.2.1) served by `gantry-node serve` on the ONNX Runtime plugin (engines/onnx), with Whisper
tiny.en on the native engine in the same node to listen to it. Here:

- the audio is the package's own within float32 rounding: the package's Python pipeline
  (its ONNX Runtime session, its numpy vocoder) speaks the same phonemes (its own phonemiser's,
  given to the node in misaki's markup `[text](/phonemes/)`) with the noise branch off (a copy
  of the voice whose `voices.json` entry says `noise_scale: 0`), and the node's 16-bit samples
  are within 2 steps of its float audio written the same way (measured: 1 step at most);
- what the voice says from plain text (espeak-ng phonemes in misaki's alphabet, noise on as
  shipped, seeded by the text) is heard back by Whisper: word error rate at most 10 % over the
  ten sentences of the benchmark (measured: 6 of 105 words, 5 of 52 in the first five, most of
  them Whisper writing "sea shells" as "seashells"; the package's own phonemiser gives 4 of 52
  and 6 of 105), through the node and, for one sentence, through the gateway;
- the same text gives the same audio; `speed` 2 about halves it; `pcm` streams sentence by
  sentence at the voice's own 24 kHz through the official client;
- an unknown voice and an empty input are 400s naming the field, and the voice answers after;
- a model's own `threads` reaches its engine (one voice on 1 thread, the other on the node's 2).
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import gateway_for, serving
from test_speech import samples, transcribe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testkit" / "python"))
from tts_sentences import SENTENCES as ALL_SENTENCES  # noqa: E402
from wer import word_errors, words  # noqa: E402

SENTENCES = ALL_SENTENCES[:5]
FILES = ("hibari.onnx", "vocab.json")


def _assets() -> Path:
    d = Path(os.environ.get("GANTRY_HIBARI_DIR", ""))
    if not (d / "hibari.onnx").is_file():
        pytest.fail(f"{d / 'hibari.onnx'} missing: run scripts/setup.sh (scripts/test.sh does)")
    return d


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    assets = _assets()
    whisper = Path(os.environ.get("GANTRY_WHISPER_DIR", ""))
    if not (whisper / "model.safetensors").is_file():
        pytest.fail(f"{whisper} missing: run scripts/setup.sh (scripts/test.sh does)")
    work = tmp_path_factory.mktemp("hibari")
    # The same voice with its noise branch off: the audio is then a function of the phonemes.
    exact = work / "heart-exact"
    exact.mkdir()
    for f in FILES:
        (exact / f).symlink_to(assets / f)
    registry = json.loads((assets / "voices.json").read_text())
    registry["heart"]["noise_scale"] = 0.0
    (exact / "voices.json").write_text(json.dumps(registry))
    config = work / "node.json"
    config.write_text(json.dumps({
        "models": [
            # One thread for this voice, the node's two for the other: the model's own
            # `threads` (a Model's `engineConfig.threads`) reaches its engine.
            {"id": "heart", "path": str(assets / "hibari.onnx"), "format": "onnx", "threads": 1},
            {"id": "heart-exact", "path": str(exact / "hibari.onnx"), "format": "onnx"},
            {"id": "whisper-tiny.en", "path": str(whisper), "format": "safetensors"},
        ],
        "scheduler": {"responseCacheRamFraction": 0.0},
    }))
    with serving(config, work) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), work


def speak(client, text, model="heart", fmt="wav", **kw):
    return client.audio.speech.create(model=model, voice="heart", input=text, response_format=fmt, **kw).read()


class _NoNoise:
    """Stands in for the package's numpy Generator: the noise branch draws zeros."""

    def standard_normal(self, shape, dtype):
        return np.zeros(shape, dtype)


def test_the_audio_is_the_packages_own_within_rounding(node):
    from hibari import Hibari

    _, client, _ = node
    reference = Hibari(threads=2)
    worst = 0
    for text in SENTENCES:
        for ps in reference.phonemize(text):
            want = reference.from_ids(reference.ids(ps), 1.0, rng=_NoNoise())
            want16 = (np.clip(want, -1.0, 1.0) * 32767.0).astype("<i2")
            got, rate = samples(speak(client, f"[{text}](/{ps}/)", model="heart-exact"))
            assert rate == 24000
            assert len(got) == len(want16), (ps, len(got), len(want16))
            diff = int(np.abs(got.astype(int) - want16.astype(int)).max())
            worst = max(worst, diff)
            print(f"{ps!r}: {len(got)} samples, max difference {diff} (of 32767)")
    assert worst <= 2, worst


def test_whisper_hears_what_the_voice_says(node):
    base, client, _ = node
    errors = total = 0
    for text in ALL_SENTENCES:
        heard = transcribe(client, speak(client, text))
        errors += word_errors(words(heard), words(text))
        total += len(words(text))
        print(f"said {text!r}, heard {heard!r}")
    print(f"Hibari heart (espeak-ng phonemes) -> Whisper tiny.en: word error rate {errors}/{total}")
    assert errors * 10 <= total, f"{errors}/{total}"
    with gateway_for({"heart": base, "whisper-tiny.en": base}, "heart") as (gw, _):
        g = openai.OpenAI(base_url=f"{gw}/v1", api_key="unused", max_retries=0)
        audio = g.audio.speech.create(model="heart", voice="heart", input=SENTENCES[0]).read()
        heard = transcribe(g, audio, "speech.mp3")
        assert word_errors(words(heard), words(SENTENCES[0])) <= 1, heard


def test_same_text_same_audio_speed_and_streaming(node):
    _, client, _ = node
    text = " ".join(SENTENCES[:3])
    wav, rate = samples(speak(client, text))
    assert rate == 24000
    secs = len(wav) / rate
    n_words = len(words(text))
    assert n_words / 4.5 < secs < n_words / 1.5, (secs, n_words)
    assert np.array_equal(samples(speak(client, text))[0], wav), "seeded by the text"
    fast, _ = samples(speak(client, text, speed=2.0))
    assert 0.4 < len(fast) / len(wav) < 0.7, len(fast) / len(wav)
    # pcm is the voice's own rate (24 kHz, OpenAI's): the wav's samples, sentence by sentence.
    with client.audio.speech.with_streaming_response.create(model="heart", voice="heart", input=text,
                                                            response_format="pcm") as r:
        chunks = [c for c in r.iter_bytes() if c]
    assert len(chunks) >= 3, len(chunks)
    assert np.array_equal(np.frombuffer(b"".join(chunks), dtype="<i2"), wav)


def test_bad_requests_are_400s_naming_the_field(node):
    _, client, _ = node

    def refused(param, **kw):
        args = {"model": "heart", "voice": "heart", "input": "Hello."} | kw
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(**args)
        assert e.value.body["param"] == param, e.value.body
        return e.value.message

    assert "heart" in refused("voice", voice="alloy")
    refused("input", input="   ")
    assert "nothing to speak" in refused("input", input="... !!!")
    wav, rate = samples(speak(client, "Still here."))
    assert len(wav) > rate // 2


def test_each_voice_runs_on_its_own_threads(node):
    _, _, work = node
    log = (work / "node.log").read_text()
    lines = [line for line in log.splitlines() if "loaded HibariVoice voice" in line]
    assert any("heart-exact/hibari.onnx" in line and "2 threads" in line for line in lines), lines
    assert any("assets/hibari.onnx" in line and "1 threads" in line for line in lines), lines
