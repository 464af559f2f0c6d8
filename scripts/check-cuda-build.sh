#!/usr/bin/env bash
# Prove that Gantry's CUDA code compiles, on a machine without a GPU or a CUDA installation:
# the llama.cpp plugin's `cuda` feature (llama.cpp's ggml-cuda, for one architecture) and
# the node's device probe (cudarc, which the default build already compiles). Not part of
# scripts/test.sh: ggml-cuda is large (see docs/engines.md for the measured time).
#
# The CUDA toolkit comes from NVIDIA's PyPI wheels (nvcc, the runtime, cuBLAS and CCCL's
# headers), pinned below and installed once into ${GANTRY_CACHE}/cuda-toolkit-<version>.
# CMake's FindCUDAToolkit wants one toolkit tree, so the wheels are assembled into one with
# symlinks, plus a stub libcuda.so (the driver library, which only a GPU machine has; the
# plugin is a shared library, so its driver symbols resolve when it is loaded there).
#
#   scripts/check-cuda-build.sh            # sm_90 (H100); CUDA_ARCH=89 for L4/L40S, ...
#
# Builds into target/cuda-check (its own target dir: the default build is not touched) and
# prints the plugin library's path and the time taken. Idempotent: a second run reuses the
# toolkit and the cargo build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cache="${GANTRY_CACHE:-$HOME/.cache/gantry}"
arch="${CUDA_ARCH:-90}"
log() { printf 'check-cuda-build: %s\n' "$*" >&2; }

cuda_version=12.8
pins=(
  "nvidia-cuda-nvcc-cu12==12.8.93"
  "nvidia-cuda-runtime-cu12==12.8.90"
  "nvidia-cuda-cccl-cu12==12.8.90"
  "nvidia-cublas-cu12==12.8.4.1"
  "nvidia-nvjitlink-cu12==12.8.93"
)
venv="$cache/cuda-toolkit-$cuda_version/venv"
toolkit="$cache/cuda-toolkit-$cuda_version/root"
stamp="$cache/cuda-toolkit-$cuda_version/.complete"
want="$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-16)"

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing the CUDA $cuda_version toolkit wheels into $venv"
  rm -rf "$cache/cuda-toolkit-$cuda_version"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" >&2
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
  mkdir -p "$toolkit/bin" "$toolkit/include" "$toolkit/lib64/stubs"
  for pkg in cuda_nvcc cuda_runtime cuda_cccl cublas nvjitlink; do
    [ -d "$site/$pkg" ] || { log "missing $site/$pkg"; exit 1; }
    for d in include lib; do
      [ -d "$site/$pkg/$d" ] || continue
      dest="$toolkit/$d"; [ "$d" = lib ] && dest="$toolkit/lib64"
      for f in "$site/$pkg/$d"/*; do ln -sfn "$f" "$dest/$(basename "$f")"; done
    done
  done
  # nvcc finds nvvm/ and its nvcc.profile beside its real path; link the whole bin/ and nvvm/.
  for f in "$site/cuda_nvcc/bin"/*; do ln -sfn "$f" "$toolkit/bin/$(basename "$f")"; done
  ln -sfn "$site/cuda_nvcc/nvvm" "$toolkit/nvvm"
  # Unversioned names for the linker.
  for lib in cudart cublas cublasLt nvJitLink; do
    real="$(ls "$toolkit/lib64/lib$lib.so."* 2>/dev/null | head -n1 || true)"
    [ -n "$real" ] && ln -sfn "$real" "$toolkit/lib64/lib$lib.so"
  done
  # The driver library's stub: an empty shared object named libcuda.so.
  echo 'void gantry_cuda_stub(void) {}' > "$toolkit/lib64/stubs/stub.c"
  cc -shared -fPIC -o "$toolkit/lib64/stubs/libcuda.so" "$toolkit/lib64/stubs/stub.c"
  ln -sfn stubs/libcuda.so "$toolkit/lib64/libcuda.so"
  "$toolkit/bin/nvcc" --version >&2
  echo "$want" > "$stamp"
fi

export CUDA_PATH="$toolkit" CUDAToolkit_ROOT="$toolkit" CUDA_HOME="$toolkit"
export PATH="$toolkit/bin:$PATH"
export LIBRARY_PATH="$toolkit/lib64:$toolkit/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$toolkit/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# llama-cpp-sys-2 forwards CMAKE_* and GGML_* variables to CMake.
export CMAKE_CUDA_ARCHITECTURES="$arch" CMAKE_CUDA_COMPILER="$toolkit/bin/nvcc"
export CARGO_TARGET_DIR="$root/target/cuda-check"

log "building the llama.cpp plugin with --features cuda for sm_$arch into $CARGO_TARGET_DIR"
start=$(date +%s)
cargo build --release --locked -p gantry-engine-llama-cpp --features cuda --lib >&2
secs=$(( $(date +%s) - start ))
lib="$CARGO_TARGET_DIR/release/libgantry_engine_llama_cpp.so"
[ -f "$lib" ] || { log "the build finished but $lib is missing"; exit 1; }
# The library must really hold ggml-cuda, not a CPU build under another name.
if ! nm -D --defined-only "$lib" 2>/dev/null | grep -q ggml_backend_cuda_init; then
  log "$lib has no ggml_backend_cuda_init: not a CUDA build"; exit 1
fi
log "built in ${secs} s on $(nproc) cores: $lib"
echo "$lib"
