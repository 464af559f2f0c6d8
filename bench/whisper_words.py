#!/usr/bin/env python3
"""Word timestamps on the CPU: the native engine vs faster-whisper, Whisper tiny.en.

The same checkpoint and the same six real recordings as bench/whisper.py (its setup, its
faster-whisper virtualenv and CTranslate2 files, both made on demand). Both sides decode with
timestamps, greedily, English, no VAD, no conditioning on previous text, 2 threads:

- Gantry: `gantry-node serve --threads 2`, `/v1/audio/transcriptions` with
  `response_format=verbose_json`, once with `timestamp_granularities[]=segment` and once with
  `segment` and `word` (ABI 1.11 `seq_token_times`: one more decoder pass per window over its
  text, the alignment heads' attention, DTW).
- faster-whisper 1.2.0: `transcribe(..., word_timestamps=False)` and `=True` (its own alignment
  pass, `find_alignment` on CTranslate2's `align`, and openai-whisper's heuristics).

Reported: how the two sides' words agree (on the recordings where both write the same words,
the difference of each word's start and end: median, 90th percentile, largest), and what word
times cost each side (seconds per pass over the six recordings, sequential, with and without;
`--passes` passes, the median).

Usage: bench/whisper_words.py --node target/release/gantry-node --out bench/results/whisper-words-cpu.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "testkit" / "python"))
from wer import words as norm  # noqa: E402
from whisper import MODEL_ID, cache, ensure_ct2, ensure_venv, post_transcription, recordings  # noqa: E402

PEER = r"""
import json, sys, time, wave
import numpy as np
import faster_whisper
ct2, speech, threads, passes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
names = json.loads(sys.argv[5])
model = faster_whisper.WhisperModel(ct2, device="cpu", compute_type="float32", cpu_threads=threads)
audio = {}
for n in names:
    with wave.open(f"{speech}/{n}") as w:
        audio[n] = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768.0
def run(n, words):
    segs, _ = model.transcribe(audio[n], language="en", beam_size=1, best_of=1, temperature=0.0,
                               condition_on_previous_text=False, vad_filter=False,
                               word_timestamps=words, no_speech_threshold=None,
                               log_prob_threshold=None, compression_ratio_threshold=None)
    return [(w.word, w.start, w.end) for s in segs for w in (s.words or [])]
out = {"words": {n: run(n, True) for n in names}, "pass_s": {}}
for words in (False, True):
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        for n in names:
            run(n, words)
        times.append(time.perf_counter() - t)
    out["pass_s"]["words" if words else "segments"] = times
print(json.dumps(out))
"""


def gantry_words(port: int, path: Path, granularities: list[str]) -> list:
    fields = [("model", MODEL_ID), ("response_format", "verbose_json"), ("temperature", "0")]
    fields += [("timestamp_granularities[]", g) for g in granularities]
    answer = post_transcription(port, fields, path.name, path.read_bytes())
    return [(w["word"], w["start"], w["end"]) for w in answer.get("words", [])]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node", default=str(HERE.parent / "target" / "release" / "gantry-node"))
    ap.add_argument("--out", default=str(HERE / "results" / "whisper-words-cpu.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--venv", default=str(cache() / "venv-faster-whisper"))
    ap.add_argument("--ct2-dir", default=str(cache() / "models" / "whisper-tiny-en-ct2"))
    args = ap.parse_args()
    from common import free_port, write_report
    from node_vs_llama_server import Server

    speech = Path(os.environ["GANTRY_SPEECH_DIR"])
    names = recordings(speech)
    py = ensure_venv(Path(args.venv))
    ct2_dir = ensure_ct2(py, Path(args.ct2_dir))
    work = Path(tempfile.mkdtemp(prefix="bench-whisper-words-"))
    config = work / "node.json"
    config.write_text(json.dumps({
        # Greedy on both sides: faster-whisper's thresholds are off, and so is Gantry's fallback.
        "models": [{"id": MODEL_ID, "path": os.environ["GANTRY_WHISPER_DIR"], "format": "safetensors",
                    "temperatureFallback": False}],
        "scheduler": {"responseCacheRamFraction": 0.0}}))
    port = free_port()
    argv = [args.node, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}",
            "--threads", str(args.threads), "--plugins-dir", str(Path(args.node).resolve().parent / "engines")]
    with Server("whisper-words", argv, port, "/readyz"):
        gantry = {n: gantry_words(port, speech / n, ["segment", "word"]) for n in names}
        g_pass = {"segments": [], "words": []}
        for _ in range(args.passes):
            for key, gran in (("segments", ["segment"]), ("words", ["segment", "word"])):
                t = time.perf_counter()
                for n in names:
                    gantry_words(port, speech / n, gran)
                g_pass[key].append(time.perf_counter() - t)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    fw = json.loads(subprocess.run([str(py), "-c", PEER, str(ct2_dir), str(speech), str(args.threads),
                                    str(args.passes), json.dumps(names)],
                                   check=True, capture_output=True, text=True, env=env).stdout)
    starts, ends, same = [], [], []
    for n in names:
        a, b = gantry[n], [tuple(w) for w in fw["words"][n]]
        if [norm(w[0]) for w in a] != [norm(w[0]) for w in b]:
            print(f"{n}: the words differ: {[w[0] for w in a]} / {[w[0] for w in b]}")
            continue
        same.append(n)
        starts += [abs(x[1] - y[1]) for x, y in zip(a, b)]
        ends += [abs(x[2] - y[2]) for x, y in zip(a, b)]
    med = {side: {k: statistics.median(v) for k, v in p.items()} for side, p in
           (("gantry", g_pass), ("faster_whisper", fw["pass_s"]))}
    report = {
        "benchmark": "whisper-word-timestamps", "model": MODEL_ID, "threads": args.threads,
        "passes": args.passes, "recordings": names, "same_words": same, "words_compared": len(starts),
        "start_diff_s": {"median": statistics.median(starts), "p90": pct(starts, 0.9), "max": max(starts)},
        "end_diff_s": {"median": statistics.median(ends), "p90": pct(ends, 0.9), "max": max(ends)},
        "pass_s": {"gantry": g_pass, "faster_whisper": fw["pass_s"]},
        "word_times_cost": {side: m["words"] / m["segments"] for side, m in med.items()},
        "pass_s_median": med, "gantry_words": gantry, "faster_whisper_words": fw["words"],
    }
    print(f"{len(same)}/{len(names)} recordings with the same words; {len(starts)} words: start "
          f"|diff| median {report['start_diff_s']['median']:.3f} s, p90 {report['start_diff_s']['p90']:.3f}, "
          f"max {report['start_diff_s']['max']:.3f}; end median {report['end_diff_s']['median']:.3f}, "
          f"p90 {report['end_diff_s']['p90']:.3f}, max {report['end_diff_s']['max']:.3f}")
    print("seconds per pass (median):", med, "cost of word times:", report["word_times_cost"])
    write_report(args.out, report, "2 vCPU; the sides ran one after the other")


if __name__ == "__main__":
    main()
