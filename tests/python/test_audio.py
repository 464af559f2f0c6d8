"""Speech recognition through the official `openai` client: `audio.transcriptions.create` and
`audio.translations.create` against `gantry-node serve` with the native engine's Whisper.

The model is the tiny random `WhisperForConditionalGeneration` the test setup writes with
transformers (testkit/python/hf_whisper.py, `GANTRY_HF_REFERENCE/whisper-float32`), with
transformers' greedy continuation of its decoder prompt for two signals. Random weights say
nothing about speech, so what is checked is the path: the upload decoded, resampled and given
to the engine, the decoder prompt, the text. Here:

- a float32 wav of signal 1 at 16 kHz transcribes to transformers' greedy tokens (the text
  starts with them), in `json`, `text` and `verbose_json`; the same signal as a 16-bit stereo
  wav at 44.1 kHz goes through mixing and resampling and gives a transcription too;
- a translation with the model's translate task answers;
- `verbose_json` decodes with timestamps: its segments lie within the audio, in order; without a
  `language` it reports the one the model detects, as transformers' `detect_language` does;
- bad input is a 400 naming the field (not audio, no file, an unknown language or format, word
  timestamps from a checkpoint that names no alignment heads, segment timestamps outside
  verbose_json, a streamed srt), and a completion on the model says to use this route;
- the gateway routes an upload by its form's `model` field and relays the answer;
- the model is served with `temperatureFallback: false` (plain greedy decoding; the fallback
  is checked on real weights in test_transcription.py);
- each runs with the engine in the node process and in a worker process.
"""
import json
import os
import struct
import tempfile
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import gateway_for, serving


def _reference() -> tuple[Path, dict]:
    d = Path(os.environ.get("GANTRY_HF_REFERENCE", "")) / "whisper-float32"
    if not (d / "reference.json").is_file():
        pytest.fail(f"{d}/reference.json missing: run scripts/setup.sh (scripts/test.sh does)")
    return d, json.loads((d / "reference.json").read_text())


def wav_f32(samples, rate: int) -> bytes:
    """A mono IEEE-float wav."""
    data = struct.pack(f"<{len(samples)}f", *samples)
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def wav_i16_stereo(samples, rate: int) -> bytes:
    frames = b"".join(struct.pack("<hh", int(s * 32767), int(s * 32767)) for s in samples)
    fmt = struct.pack("<HHIIHH", 1, 2, rate, rate * 4, 4, 16)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(frames)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(frames)) + frames)


@pytest.fixture(scope="module", params=["inProcess", "process"])
def whisper(request):
    model_dir, ref = _reference()
    work = Path(tempfile.mkdtemp(prefix="gantry-whisper-"))
    config = work / "node.json"
    config.write_text(json.dumps({
        # Random weights fail every threshold of the temperature fallback, which would
        # resample each window: the path is checked on plain greedy decoding.
        "models": [{"id": "whisper", "path": str(model_dir), "format": "safetensors",
                    "temperatureFallback": False}],
        "scheduler": {"responseCacheRamFraction": 0.0},
        "isolation": {"default": request.param},
    }))
    with serving(config, work) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), ref


def expected_text(ref, case: int) -> str:
    """The text of transformers' greedy tokens: `t<id>` each, joined as the word-level test
    vocabulary (which has no decoder) joins them."""
    return "".join(f"t{t}" for t in ref["cases"][case]["greedy"])


def test_a_transcription_is_transformers_greedy_text(whisper):
    _, client, ref = whisper
    audio = wav_f32(ref["cases"][0]["audio"], 16000)
    r = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio, "audio/wav"), language="en")
    assert r.text.startswith(expected_text(ref, 0)), (r.text[:200], expected_text(ref, 0)[:200])
    text = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio, "audio/wav"),
                                              response_format="text", language="en")
    assert isinstance(text, str) and text.strip() == r.text
    # verbose_json decodes with timestamps (random weights: whatever segments they make, each
    # within the audio, in order, the text theirs).
    v = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio, "audio/wav"),
                                           response_format="verbose_json", language="en")
    assert v.language == "en" and abs(v.duration - 3.0) < 1e-3
    ends = [0.0] + [x for s in v.segments for x in (s.start, s.end)]
    assert ends == sorted(ends) and ends[-1] <= 3.0 + 1e-6, ends
    assert v.text == " ".join(s.text.strip() for s in v.segments if s.text.strip())
    # The other signal gives its own text.
    other = client.audio.transcriptions.create(
        model="whisper", file=("b.wav", wav_f32(ref["cases"][1]["audio"], 16000), "audio/wav"), language="en")
    assert other.text.startswith(expected_text(ref, 1))
    # No language: the model's own guess, as transformers' detect_language makes it.
    for i, case in enumerate(ref["cases"]):
        v = client.audio.transcriptions.create(
            model="whisper", file=("c.wav", wav_f32(case["audio"], 16000), "audio/wav"),
            response_format="verbose_json")
        assert v.language == case["language"], (i, v.language, case["language"])


def test_other_rates_and_channels_are_mixed_and_resampled(whisper):
    _, client, ref = whisper
    # Signal 1 at 44.1 kHz, 16-bit, stereo: nearest-sample upsampling keeps it recognisable.
    src = ref["cases"][0]["audio"]
    up = [src[min(int(i * 16000 / 44100), len(src) - 1)] for i in range(int(len(src) * 44100 / 16000))]
    r = client.audio.transcriptions.create(model="whisper", file=("a.wav", wav_i16_stereo(up, 44100), "audio/wav"),
                                           response_format="verbose_json")
    assert abs(r.duration - 3.0) < 1e-3 and r.text
    t = client.audio.translations.create(model="whisper", file=("a.wav", wav_f32(src, 16000), "audio/wav"))
    assert t.text


def test_bad_input_is_a_400_naming_the_field(whisper):
    base, client, ref = whisper
    audio = wav_f32(ref["cases"][0]["audio"], 16000)
    for kwargs, field in [
        (dict(file=("x.mp3", b"this is not audio", "audio/mpeg")), "file"),
        (dict(file=("a.wav", audio, "audio/wav"), language="xx"), "language"),
        (dict(file=("a.wav", audio, "audio/wav"), response_format="mp4"), "response_format"),
        (dict(file=("a.wav", audio, "audio/wav"), response_format="verbose_json",
              timestamp_granularities=["word"]), "timestamp_granularities"),
        (dict(file=("a.wav", audio, "audio/wav"), timestamp_granularities=["segment"]),
         "timestamp_granularities"),
        (dict(file=("a.wav", audio, "audio/wav"), response_format="srt", stream=True), "stream"),
        (dict(file=("a.wav", audio, "audio/wav"), temperature=3), "temperature"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.transcriptions.create(model="whisper", **kwargs)
        assert e.value.body["param"] == field, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="whisper", prompt="hello", max_tokens=4)
    assert "/v1/audio/transcriptions" in e.value.message
    # No file at all: the form says so.
    body = (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b--\r\n")
    req = urllib.request.Request(f"{base}/v1/audio/transcriptions", data=body, method="POST",
                                 headers={"Content-Type": "multipart/form-data; boundary=b"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and json.load(e.value)["error"]["param"] == "file"
    # And the model still answers.
    assert client.audio.transcriptions.create(model="whisper", file=("a.wav", audio, "audio/wav")).text


def test_the_gateway_routes_an_upload_by_its_model_field(whisper):
    base, _, ref = whisper
    with gateway_for({"whisper": base}, "whisper") as (gw, _):
        c = openai.OpenAI(base_url=f"{gw}/v1", api_key="unused", max_retries=0)
        audio = ("a.wav", wav_f32(ref["cases"][0]["audio"], 16000), "audio/wav")
        r = c.audio.transcriptions.create(model="whisper", file=audio, language="en")
        assert r.text.startswith(expected_text(ref, 0))
        text = c.audio.transcriptions.create(model="whisper", file=audio, response_format="text", language="en")
        assert text.strip() == r.text
        with pytest.raises(openai.NotFoundError):
            c.audio.transcriptions.create(model="nobody", file=audio)
