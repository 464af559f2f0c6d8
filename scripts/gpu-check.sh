#!/usr/bin/env bash
# The GPU check: run on a machine with an NVIDIA GPU and nothing from the network, it runs the
# GPU tests and the GPU benchmarks and writes every result as JSON into OUT_DIR.
#
#   scripts/gpu-check.sh OUT_DIR
#
# Two ways to run it:
#   - from a checkout where Gantry was built (cargo on the machine), as described below;
#   - from a bundle made elsewhere by scripts/gpu-bundle.sh (no Rust toolchain needed):
#     GANTRY_GPU_BUNDLE names the unpacked bundle, which supplies the node, the CUDA plugins,
#     the peer llama-server, the test binaries and the gguf wheel.
# The CUDA runtime, cuBLAS and NVRTC are looked up on the machine (CUDA_HOME, /usr/local/cuda,
# Python's nvidia-* wheels, the toolkit scripts/check-cuda-build.sh installs) and linked, under
# the names the plugins open, into a directory put first on the library path.
# When GANTRY_GEMMA_ST_DIR / GANTRY_GEMMA_BF16_GGUF are not given, the bf16 test model is made
# from GANTRY_GEMMA_GGUF with testkit/python/gemma_bf16.py (needs numpy and gguf) under
# GANTRY_GPU_WORK (default ${TMPDIR:-/tmp}/gantry-gpu-check). Each step is bounded by
# GANTRY_GPU_STEP_TIMEOUT seconds (default 900); GANTRY_GPU_STEPS=devices,tests,... runs only
# the steps it names (for a short first look at a machine before the benchmarks).
#
# What it needs on the machine (all local; nothing is downloaded):
#   - nvidia-smi and the NVIDIA driver;
#   - Gantry built (target/release/gantry-node) and the llama.cpp plugin built with
#     --features cuda: GANTRY_CUDA_PLUGINS_DIR names its plugin directory (default:
#     target/cuda-check/release/engines, what scripts/check-cuda-build.sh builds);
#   - the test model, GANTRY_GEMMA_GGUF (default: the one scripts/setup.sh installs);
#   - optionally GANTRY_PEER_CUDA, llama.cpp's own llama-server built with GGML_CUDA=ON from
#     the same sources (bench/build-llama-server.sh with GANTRY_PEER_GPU=cuda builds it
#     where nvcc is present); without it the benchmark against the peer is skipped and the
#     summary says so.
#
# Steps, each writing OUT_DIR/<step>.json (or .csv/.txt for raw readings):
#   1. devices:  `gantry-node devices --json` vs nvidia-smi (bench/gpu_check.py compare-devices)
#   2. tests:    the node's device tests on real hardware (cargo test, devices and probe)
#   3. vram:     a node with the CUDA plugin loads the model; /v1/status vs nvidia-smi's
#                per-process memory (bench/gpu_check.py compare-vram)
#   4. bench:    bench/node_vs_llama_server.py, CUDA node vs CUDA llama-server, c = 1,8,32,64
#   5. native-tests: the native engine's CUDA tests (engines/native/tests/cuda.rs, with
#                --include-ignored: CUDA vs CPU logits on every tiny architecture, Gemma 3
#                270M answers " Paris" on the GPU), with CUDA 12's cuBLAS and NVRTC from
#                ${GANTRY_CACHE}/cuda-runtime-12 (scripts/check-cuda-build.sh installs them)
#   6. native-bench: bench/native_vs_llama_cpp.py on the GPU, the native CUDA plugin vs the
#                llama.cpp CUDA plugin on the same bf16 values (GANTRY_GEMMA_ST_DIR and
#                GANTRY_GEMMA_BF16_GGUF), c = 1,8,32,64
# and OUT_DIR/summary.json with each step's outcome. Exits 2 when there is no GPU (say so,
# never pretend), 1 when a step failed, 0 when all ran and passed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-}"
[ -n "$out" ] || { echo "usage: scripts/gpu-check.sh OUT_DIR" >&2; exit 2; }
mkdir -p "$out"
log() { printf 'gpu-check: %s\n' "$*" >&2; }
python="${GANTRY_VENV:+$GANTRY_VENV/bin/}python3"
command -v "$python" >/dev/null 2>&1 || python=python3

summary() { # step outcome detail
  "$python" - "$out/summary.json" "$1" "$2" "$3" <<'EOF'
import json, sys
from pathlib import Path
p = Path(sys.argv[1])
s = json.loads(p.read_text()) if p.exists() else {"steps": {}}
s["steps"][sys.argv[2]] = {"outcome": sys.argv[3], "detail": sys.argv[4]}
p.write_text(json.dumps(s, indent=2) + "\n")
EOF
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L > "$out/nvidia-smi-L.txt" 2>&1; then
  log "no NVIDIA GPU here (nvidia-smi missing or failing): nothing was checked"
  summary gpu "not-run" "no NVIDIA GPU: nvidia-smi missing or failing"
  exit 2
fi

bundle="${GANTRY_GPU_BUNDLE:-}"
work="${GANTRY_GPU_WORK:-${TMPDIR:-/tmp}/gantry-gpu-check}"
step_timeout="${GANTRY_GPU_STEP_TIMEOUT:-900}"
mkdir -p "$work"
if [ -n "$bundle" ]; then
  [ -f "$bundle/BUNDLE.txt" ] || { log "GANTRY_GPU_BUNDLE=$bundle is not an unpacked gpu bundle"; exit 2; }
  cp "$bundle/BUNDLE.txt" "$out/bundle.txt"
  node="${GANTRY_NODE:-$bundle/bin/gantry-node}"
  plugins="${GANTRY_CUDA_PLUGINS_DIR:-$bundle/engines}"
  GANTRY_PEER_CUDA="${GANTRY_PEER_CUDA:-$bundle/peer/llama-server}"
  for whl in "$bundle"/wheels/*.whl; do
    [ -e "$whl" ] && export PYTHONPATH="$whl${PYTHONPATH:+:$PYTHONPATH}"
  done
else
  node="${GANTRY_NODE:-$root/target/release/gantry-node}"
  plugins="${GANTRY_CUDA_PLUGINS_DIR:-$root/target/cuda-check/release/engines}"
fi
model="${GANTRY_GEMMA_GGUF:-${GANTRY_CACHE:-$HOME/.cache/gantry}/models/gemma-3-270m-q4_k_m.gguf}"

# The CUDA libraries, linked into one directory first on the library path.
. "$root/scripts/cuda-libs.sh"
link_cuda_libs "$work"
# The bundle's fallback runtime libraries, only for those the machine lacks.
if [ -n "$bundle" ] && [ -d "$bundle/lib" ]; then
  for f in "$bundle"/lib/*; do
    [ -e "$f" ] || continue
    ldconfig -p 2>/dev/null | grep -q "^[[:space:]]*$(basename "$f") " && continue
    mkdir -p "$work/fallback-libs"; ln -sfn "$f" "$work/fallback-libs/$(basename "$f")"
  done
  [ -d "$work/fallback-libs" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$work/fallback-libs"
fi
ls -l "$cuda_libs" > "$out/cuda-libs.txt" 2>&1
# The peer llama-server of a bundle runs on the plugin's own llama/ggml libraries.
peer_env=()
if [ -n "$bundle" ]; then
  peer_env=(env "LD_LIBRARY_PATH=$plugins/llama_cpp/cuda:$bundle/peer:$LD_LIBRARY_PATH")
fi
# GANTRY_GPU_STEPS=devices,tests,... runs only those steps (default: all six).
want() { [ -z "${GANTRY_GPU_STEPS:-}" ] || [[ ",$GANTRY_GPU_STEPS," == *",$1,"* ]]; }
bounded() { timeout --signal=TERM --kill-after=10 "$step_timeout" "$@"; }
get() { "$python" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"; }
failed=0

# 1. devices ---------------------------------------------------------------------------------
if want devices; then
nvidia-smi --query-gpu=index,uuid,name,compute_cap,memory.total,memory.used,memory.free \
  --format=csv,noheader,nounits > "$out/nvidia-smi-gpus.csv"
"$node" devices --json > "$out/devices-snapshot.json"
if "$python" bench/gpu_check.py compare-devices "$out/devices-snapshot.json" "$out/nvidia-smi-gpus.csv" "$out/devices.json"; then
  summary devices passed "$out/devices.json"
else
  summary devices failed "$out/devices.json"; failed=1
fi
fi

# 2. tests -----------------------------------------------------------------------------------
if want tests; then
# The memory policy's device tests (the node) and the CUDA probe's (the engine host).
if [ -n "$bundle" ]; then
  node_tests=(bounded "$bundle/tests/node-lib" devices::)
  host_tests=(bounded "$bundle/tests/engine-host-lib" cuda::)
else
  node_tests=(bounded cargo test --release --offline -p gantry-node --lib -- devices::)
  host_tests=(bounded cargo test --release --offline -p gantry-engine-host --lib -- cuda::)
fi
if { "${node_tests[@]}" && "${host_tests[@]}"; } > "$out/tests.txt" 2>&1; then
  summary tests passed "$out/tests.txt"
else
  summary tests failed "$out/tests.txt"; failed=1
fi
fi

# 3. vram ------------------------------------------------------------------------------------
if want vram; then
if [ ! -f "$plugins/llama_cpp/cuda/manifest.json" ]; then
  log "no CUDA plugin under $plugins (run scripts/check-cuda-build.sh first)"
  summary vram not-run "no CUDA plugin under $plugins"; failed=1
elif [ ! -s "$model" ]; then
  summary vram not-run "no model at $model"; failed=1
else
  port=$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "$node" serve --model "$model" --model-id gemma --backend cuda --plugins-dir "$plugins" \
    --listen "127.0.0.1:$port" > "$out/node.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    get "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
    sleep 0.1
  done
  get "http://127.0.0.1:$port/v1/status" > "$out/status.json" || true
  get "http://127.0.0.1:$port/metrics" > "$out/metrics.txt" || true
  # The device's own reading with the model loaded (beside the per-process one below, which
  # a sandboxed machine may not report).
  nvidia-smi --query-gpu=index,uuid,name,compute_cap,memory.total,memory.used,memory.free \
    --format=csv,noheader,nounits > "$out/nvidia-smi-gpus-loaded.csv"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits > "$out/nvidia-smi-apps.csv"
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  if "$python" bench/gpu_check.py compare-vram "$out/status.json" "$out/nvidia-smi-apps.csv" "$pid" "$out/vram.json"; then
    summary vram passed "$out/vram.json"
  else
    summary vram failed "$out/vram.json"; failed=1
  fi
fi
fi

# 4. bench -----------------------------------------------------------------------------------
if want bench; then
if [ -z "${GANTRY_PEER_CUDA:-}" ] || [ ! -x "${GANTRY_PEER_CUDA:-}" ]; then
  log "GANTRY_PEER_CUDA is not a CUDA llama-server binary: benchmark not run"
  summary bench not-run "GANTRY_PEER_CUDA not set"; failed=1
elif [ -f "$plugins/llama_cpp/cuda/manifest.json" ] && [ -s "$model" ]; then
  if bounded "${peer_env[@]}" "$python" bench/node_vs_llama_server.py --node "$node" --peer "$GANTRY_PEER_CUDA" --model "$model" \
      --out "$out/bench-cuda.json" --concurrency 1,8,32,64 --parallel 64 --threads "$(nproc)" \
      --node-arg=--backend --node-arg=cuda --node-arg=--plugins-dir --node-arg="$plugins" \
      --peer-arg=-ngl --peer-arg=999 > "$out/bench.txt" 2>&1; then
    summary bench passed "$out/bench-cuda.json"
  else
    summary bench failed "$out/bench.txt"; failed=1
  fi
fi
fi

# The bf16 model of steps 5 and 6 (made here from the GGUF when not given).
st="${GANTRY_GEMMA_ST_DIR:-}"
bf16="${GANTRY_GEMMA_BF16_GGUF:-}"
if { [ ! -d "$st" ] || [ ! -s "$bf16" ]; } && [ -s "$model" ] && { want native-tests || want native-bench; }; then
  st="$work/models/gemma-3-270m-bf16"; bf16="$work/models/gemma-3-270m-bf16.gguf"
  if [ ! -s "$bf16" ]; then
    log "making the bf16 test model from $model"
    mkdir -p "$work/models"
    bounded "$python" testkit/python/gemma_bf16.py "$model" "$st" "$bf16" > "$out/bf16-model.txt" 2>&1 \
      || log "could not make the bf16 model (see $out/bf16-model.txt)"
  fi
fi
export GANTRY_GEMMA_ST_DIR="$st"

# 5. native-tests ----------------------------------------------------------------------------
if want native-tests; then
if [ -n "$bundle" ]; then
  native_tests=(bounded "$bundle/tests/native-cuda" --include-ignored --nocapture)
else
  native_tests=(bounded cargo test --release --offline -p gantry-engine-native --test cuda -- --include-ignored --nocapture)
fi
# Without the real model, the tiny architectures still run; the summary says what was left out.
native_note=""
if [ ! -d "$st" ]; then
  native_tests+=(--skip gemma_on_cuda_answers_paris)
  native_note=" (gemma_on_cuda_answers_paris not run: no bf16 model)"
fi
if [ -z "${GANTRY_NVRTC_LIB:-}" ]; then
  summary native-tests not-run "no NVRTC found (CUDA_HOME, /usr/local/cuda, nvidia-* wheels)"; failed=1
elif "${native_tests[@]}" > "$out/native-tests.txt" 2>&1; then
  summary native-tests passed "$out/native-tests.txt$native_note"
else
  summary native-tests failed "$out/native-tests.txt$native_note"; failed=1
fi
fi

# 6. native-bench ----------------------------------------------------------------------------
if want native-bench; then
if [ ! -f "$plugins/native/cuda/manifest.json" ] || [ ! -f "$plugins/llama_cpp/cuda/manifest.json" ]; then
  summary native-bench not-run "the native and llama.cpp CUDA plugins are not both under $plugins"; failed=1
elif [ ! -d "$st" ] || [ ! -s "$bf16" ]; then
  summary native-bench not-run "no bf16 test model (GANTRY_GEMMA_ST_DIR / GANTRY_GEMMA_BF16_GGUF, or GANTRY_GEMMA_GGUF to make it)"; failed=1
elif (cd bench && bounded "$python" native_vs_llama_cpp.py --node "$node" --st "$st" --gguf "$bf16" \
      --out "$out/native-bench-cuda.json" --concurrency 1,8,32,64 --parallel 64 --threads "$(nproc)" \
      --node-arg=--backend --node-arg=cuda --node-arg=--plugins-dir --node-arg="$plugins" \
      --machine-note "GPU check: $(head -n1 "$out/nvidia-smi-L.txt")") > "$out/native-bench.txt" 2>&1; then
  summary native-bench passed "$out/native-bench-cuda.json"
else
  summary native-bench failed "$out/native-bench.txt"; failed=1
fi
fi

log "results in $out (summary.json)"
exit "$failed"
