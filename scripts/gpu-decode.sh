#!/usr/bin/env bash
# The native engine's GPU decode check: its CUDA tests and the decode benchmark against a
# plain PyTorch loop on the same shapes, on a GPU machine with no Rust toolchain and no
# network (PyTorch there for the reference loop).
#
#   scripts/gpu-decode.sh pack DIR            # here: build and pack what the GPU machine runs
#   scripts/gpu-decode.sh run DIR OUT [PHASES] # there: run it, JSON and logs into OUT
#
# `pack` builds (release) the native engine's CUDA test binaries and its decode benchmark
# (engines/native/examples/decode_bench.rs), strips and xz-compresses them into DIR (about
# 6 MB: small enough to travel with a checkout). They are built for the x86-64-v3 baseline
# (RUSTFLAGS, default "-C target-cpu=x86-64-v3") in their own target directory
# (target/gpu-pack), not for this machine's CPU as scripts/build.sh builds: a GPU machine's CPU
# may lack what this one has.
# `run` unpacks them, links the machine's CUDA libraries (scripts/cuda-libs.sh), and runs the
# PHASES named (comma-separated; default all):
#   tests     the CUDA tests with --include-ignored (tests/cuda.rs, tests/cuda_sampling.rs and the CUDA test of tests/speculation.rs;
#             the real Gemma 3 270M test is skipped: no real weights travel)
#   gemma     the native engine on Gemma 3 270M's shapes (random bf16 weights written by
#             decode_bench, no download), c = 1, 2, 4, 8, 64, 256: native-gemma.json
#   torch     bench/torch_decode.py on the same shapes, CUDA graph and torch.compile + graph:
#             torch-gemma.json
#   llama8b   both on Llama 3 8B's shapes at c = 1 and 64 (16 GB of random weights made
#             there): native-llama8b.json, torch-llama8b.json
#   gemvsplit the native engine with GANTRY_NATIVE_CUDA_GEMV_SPLIT=1 (no product's columns split
#             over warps) at c = 1, 2 (and the 8B shape at c = 1 within llama8b)
#   nographs  the native engine with GANTRY_NATIVE_CUDA_GRAPHS=0 at c = 1 and 64
#   nogemv    the native engine with GANTRY_NATIVE_CUDA_GEMV=0 (every product on cuBLAS) at
#             c = 1, 2, 4, 8 (and the 8B shape at c = 1 within llama8b)
#   profile   the native engine with GANTRY_NATIVE_CUDA_PROFILE=1 at c = 1, 64, 256 (and the
#             8B shape at 1 and 64 within llama8b): CUDA events
#             between a decode step's phases, one line per batch size in bench.log
#   ncu       Nsight Compute's reading of every kernel's duration and DRAM bytes (graphs off,
#             `--clock-control none`) at c = 1 and 64 (and the 8B shape at c = 1 within
#             llama8b): ncu-*.csv, summarised per kernel over the last two decode steps
# and bench/gpu_decode.py writes OUT/gpu-decode.json from what ran (the small files it reads
# are then moved out of OUT, so what comes back is the summary, the logs and the main JSONs). Every phase is bounded
# by its own timeout; a phase that fails is recorded and the next one runs.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { printf 'gpu-decode: %s\n' "$*" >&2; }
python="${GANTRY_VENV:+$GANTRY_VENV/bin/}python3"
command -v "$python" >/dev/null 2>&1 || python=python3

case "${1:-}" in
pack)
  dir="${2:?usage: scripts/gpu-decode.sh pack DIR}"
  set -e
  mkdir -p "$dir"
  json="$(mktemp)"
  trap 'rm -f "$json"' EXIT
  export RUSTFLAGS="${RUSTFLAGS:--C target-cpu=x86-64-v3}"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/gpu-pack}"
  cargo build --release --locked -p gantry-engine-native --example decode_bench >&2
  cargo test --release --locked -p gantry-engine-native --test cuda --test cuda_sampling \
    --test speculation --no-run --message-format=json > "$json"
  for name in cuda cuda_sampling speculation; do
    exe="$("$python" -c '
import json, sys
for line in open(sys.argv[1]):
    try: m = json.loads(line)
    except ValueError: continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") == sys.argv[2] and "test" in t.get("kind", []):
        print(m["executable"]); break' "$json" "$name")"
    strip -o "$dir/$name" "$exe"
  done
  strip -o "$dir/decode_bench" "$CARGO_TARGET_DIR/release/examples/decode_bench"
  xz -f -T0 -6 "$dir/cuda" "$dir/cuda_sampling" "$dir/speculation" "$dir/decode_bench"
  { echo "commit: $(git rev-parse HEAD)$(git diff --quiet || echo ' (with local changes)')"
    echo "RUSTFLAGS: $RUSTFLAGS"; } > "$dir/BUNDLE.txt"
  ls -l "$dir" >&2
  exit 0
  ;;
run) ;;
*) echo "usage: scripts/gpu-decode.sh pack DIR | run DIR OUT [PHASES]" >&2; exit 2 ;;
esac

dir="${2:?usage: scripts/gpu-decode.sh run DIR OUT [PHASES]}"
out="${3:?usage: scripts/gpu-decode.sh run DIR OUT [PHASES]}"
phases="${4:-tests,gemma,gemvsplit,profile,nographs,nogemv,ncu,torch,llama8b}"
torch_modes="${GANTRY_TORCH_MODES:-graph,compiled}"
want() { [[ ",$phases," == *",$1,"* ]]; }
mkdir -p "$out"
work="${GANTRY_GPU_WORK:-${TMPDIR:-/tmp}/gantry-gpu-decode}"
mkdir -p "$work/bin"
if ! nvidia-smi -L > "$out/nvidia-smi.txt" 2>&1; then
  log "no NVIDIA GPU here: nothing was checked"; exit 2
fi
for f in cuda cuda_sampling speculation decode_bench; do
  [ -x "$work/bin/$f" ] || { xz -dc "$dir/$f.xz" > "$work/bin/$f" && chmod +x "$work/bin/$f"; }
done
cp "$dir/BUNDLE.txt" "$out/bundle.txt" 2>/dev/null || true
. "$root/scripts/cuda-libs.sh"
link_cuda_libs "$work"
bench="$work/bin/decode_bench"
status() { printf '%s %s\n' "$1" "$2" >> "$out/phases.txt"; log "$1: $2"; }
bounded() { local t="$1"; shift; timeout --signal=TERM --kill-after=10 "$t" "$@"; }

if want tests; then
  if bounded 150 "$work/bin/cuda" --include-ignored --nocapture --skip gemma_on_cuda_answers_paris \
       > "$out/tests.txt" 2>&1 \
     && bounded 150 "$work/bin/cuda_sampling" --include-ignored --nocapture --test-threads 1 \
       >> "$out/tests.txt" 2>&1 \
     && bounded 120 "$work/bin/speculation" --ignored --nocapture on_cuda \
       >> "$out/tests.txt" 2>&1; then
    status tests passed
  else
    status tests failed
  fi
fi
gemma="$work/models/gemma3-270m"
if want gemma || want gemvsplit || want nographs || want nogemv || want ncu || want profile; then
  [ -s "$gemma/model.safetensors" ] || "$bench" write --shape gemma3-270m "$gemma" 2>> "$out/bench.log"
fi
if want gemma; then
  if bounded 200 "$bench" run --model "$gemma" --batches 1,2,4,8,64,256 --prompt 128 --gen 128 \
       --out "$out/native-gemma.json" 2>> "$out/bench.log"; then
    status gemma passed
  else
    status gemma failed
  fi
fi
if want gemvsplit; then
  if GANTRY_NATIVE_CUDA_GEMV_SPLIT=1 bounded 90 "$bench" run --model "$gemma" --batches 1,2 \
       --prompt 128 --gen 128 --label native-gemv-unsplit --out "$out/native-gemma-gemvsplit.json" \
       2>> "$out/bench.log"; then
    status gemvsplit passed
  else
    status gemvsplit failed
  fi
fi
if want nographs; then
  if GANTRY_NATIVE_CUDA_GRAPHS=0 bounded 90 "$bench" run --model "$gemma" --batches 1,64 \
       --prompt 128 --gen 64 --label native-no-graphs --out "$out/native-gemma-nographs.json" \
       2>> "$out/bench.log"; then
    status nographs passed
  else
    status nographs failed
  fi
fi
if want nogemv; then
  if GANTRY_NATIVE_CUDA_GEMV=0 bounded 90 "$bench" run --model "$gemma" --batches 1,2,4,8 \
       --prompt 128 --gen 64 --label native-no-gemv --out "$out/native-gemma-nogemv.json" \
       2>> "$out/bench.log"; then
    status nogemv passed
  else
    status nogemv failed
  fi
fi
# Nsight Compute over one run of decode_bench (4 decode steps after the prompt): label, model
# directory, batch size.
ncu_run() {
  local exe
  exe="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
  [ -n "$exe" ] || { log "no ncu on this machine"; return 1; }
  GANTRY_NATIVE_CUDA_GRAPHS=0 bounded 120 "$exe" --clock-control none --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$bench" run --model "$2" --batches "$3" --prompt 128 --gen 4 --label ncu \
    --out "$work/ncu-$1.json" > "$out/ncu-$1.csv" 2>> "$out/bench.log"
}
if want ncu; then
  if ncu_run gemma-c1 "$gemma" 1 && ncu_run gemma-c64 "$gemma" 64; then
    status ncu passed
  else
    status ncu failed
  fi
fi
if want profile; then
  if GANTRY_NATIVE_CUDA_PROFILE=1 bounded 90 "$bench" run --model "$gemma" --batches 1,64,256 \
       --prompt 128 --gen 32 --label native-profile --out "$out/native-gemma-profile.json" \
       2>> "$out/bench.log"; then
    status profile passed
  else
    status profile failed
  fi
fi
if want torch; then
  if PYTHONUNBUFFERED=1 bounded 190 "$python" bench/torch_decode.py --shape gemma3-270m \
       --batches 1,8,64,256 --modes "$torch_modes" --context 128 --steps 128 --time-budget 150 \
       --out "$out/torch-gemma.json" >> "$out/bench.log" 2>&1; then
    status torch passed
  else
    status torch failed
  fi
fi
if want llama8b; then
  llama="$work/models/llama3-8b"
  [ -s "$llama/model.safetensors" ] || "$bench" write --shape llama3-8b "$llama" 2>> "$out/bench.log"
  if bounded 150 "$bench" run --model "$llama" --batches 1,64 --prompt 128 --gen 64 \
       --out "$out/native-llama8b.json" 2>> "$out/bench.log"; then
    status llama8b-native passed
  else
    status llama8b-native failed
  fi
  if want gemvsplit; then
    GANTRY_NATIVE_CUDA_GEMV_SPLIT=1 bounded 90 "$bench" run --model "$llama" --batches 1 \
      --prompt 128 --gen 64 --label native-gemv-unsplit --out "$out/native-llama8b-gemvsplit.json" \
      2>> "$out/bench.log" || log "the 8B run with unsplit gemv failed"
  fi
  if want nogemv; then
    GANTRY_NATIVE_CUDA_GEMV=0 bounded 90 "$bench" run --model "$llama" --batches 1 --prompt 128 \
      --gen 64 --label native-no-gemv --out "$out/native-llama8b-nogemv.json" 2>> "$out/bench.log" \
      || log "the 8B run without gemv failed"
  fi
  if want ncu; then
    ncu_run llama8b-c1 "$llama" 1 || log "the 8B ncu run failed"
  fi
  if want profile; then
    GANTRY_NATIVE_CUDA_PROFILE=1 bounded 90 "$bench" run --model "$llama" --batches 1,64 --prompt 128 \
      --gen 16 --label native-profile --out "$work/native-llama8b-profile.json" 2>> "$out/bench.log" \
      || log "the 8B profile run failed"
  fi
  rm -rf "$llama"
  if PYTHONUNBUFFERED=1 bounded 120 "$python" bench/torch_decode.py --shape llama3-8b --batches 1,64 \
       --modes graph --context 128 --steps 64 --time-budget 90 \
       --out "$out/torch-llama8b.json" >> "$out/bench.log" 2>&1; then
    status llama8b-torch passed
  else
    status llama8b-torch failed
  fi
fi
"$python" bench/gpu_decode.py "$out" "$out/gpu-decode.json" || log "no summary"
mkdir -p "$work/small"
for f in nvidia-smi.txt bundle.txt phases.txt native-gemma-nographs.json native-gemma-nogemv.json \
  native-gemma-gemvsplit.json \
  native-llama8b-gemvsplit.json native-llama8b-nogemv.json native-gemma-profile.json ncu-gemma-c1.csv ncu-gemma-c64.csv \
  ncu-llama8b-c1.csv; do
  [ -e "$out/$f" ] && mv "$out/$f" "$work/small/"
done
log "results in $out"
