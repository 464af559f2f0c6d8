#!/usr/bin/env bash
# Prove that Gantry's CUDA code compiles, on a machine without a GPU or a CUDA installation:
# the llama.cpp plugin's `cuda` feature (llama.cpp's ggml-cuda, for one architecture) and
# the node's device probe (cudarc, which the default build already compiles). Not part of
# scripts/test.sh: ggml-cuda is large (see docs/engines.md for the measured time).
#
# The CUDA toolkit comes from NVIDIA's PyPI wheels (nvcc, the runtime, cuBLAS and CCCL's
# headers), pinned below and installed once into ${GANTRY_CACHE}/cuda-toolkit-<version>.
# CMake's FindCUDAToolkit wants a lib64/ with unversioned names, so a small tree of symlinks
# is laid over the wheels' files, plus a stub libcuda.so (the driver library, which only a GPU machine has; the
# plugin is a shared library, so its driver symbols resolve when it is loaded there).
#
#   scripts/check-cuda-build.sh            # sm_90 (H100); CUDA_ARCH=89 for L4/L40S, ...
#   CUDA_TOOLKIT_ONLY=1 scripts/check-cuda-build.sh   # only install the toolkit, print its root
#
# Builds into target/cuda-check (its own target dir: the default build is not touched) and
# prints the plugin library's path and the time taken. The result is a development check, not
# the shipped image: the image builds the same feature in NVIDIA's devel image (Dockerfile). Idempotent: a second run reuses the
# toolkit and the cargo build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cache="${GANTRY_CACHE:-$HOME/.cache/gantry}"
arch="${CUDA_ARCH:-90}"
log() { printf 'check-cuda-build: %s\n' "$*" >&2; }

cuda_version=13.0
# CUDA 13's wheels hold the whole nvcc (CUDA 12's nvcc wheel has only ptxas), all under
# site-packages/nvidia/cu13 in the toolkit's own layout.
pins=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cuda-cccl==13.0.85"
  "nvidia-cublas==13.0.2.14"
  "nvidia-nvjitlink==13.0.88"
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
  cu="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13"
  [ -x "$cu/bin/nvcc" ] || { log "no nvcc in $cu/bin"; exit 1; }
  mkdir -p "$toolkit/lib64/stubs"
  for d in "$cu"/*; do
    case "$(basename "$d")" in lib|lib64) continue ;; esac
    ln -sfn "$d" "$toolkit/$(basename "$d")"
  done
  for f in "$cu"/lib/*; do ln -sfn "$f" "$toolkit/lib64/$(basename "$f")"; done
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

if [ "${CUDA_TOOLKIT_ONLY:-0}" = 1 ]; then
  echo "$toolkit"
  exit 0
fi

export CUDA_PATH="$toolkit" CUDAToolkit_ROOT="$toolkit" CUDA_HOME="$toolkit"
export PATH="$toolkit/bin:$PATH"
export LIBRARY_PATH="$toolkit/lib64:$toolkit/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$toolkit/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# llama-cpp-sys-2 forwards CMAKE_* and GGML_* variables to CMake.
export CMAKE_CUDA_ARCHITECTURES="$arch" CMAKE_CUDA_COMPILER="$toolkit/bin/nvcc"
export CARGO_TARGET_DIR="$root/target/cuda-check"
# The wheels carry the CUDA runtime and cuBLAS as shared libraries only (no static archives,
# which llama-cpp-sys-2's static build links), so llama.cpp is built as shared libraries
# here: ggml-cuda lands in libggml-cuda.so, linked against libcudart/libcublas.
export LLAMA_BUILD_SHARED_LIBS=1

log "building the llama.cpp plugin with --features cuda for sm_$arch into $CARGO_TARGET_DIR"
start=$(date +%s)
cargo build --release --locked -p gantry-engine-llama-cpp --features cuda --lib >&2
secs=$(( $(date +%s) - start ))
plugin_dir="$CARGO_TARGET_DIR/release/engines/llama_cpp/cuda"
lib="$plugin_dir/libgantry_engine_llama_cpp.so"
# The plugin's build links llama.cpp's shared libraries into its directory (engines/llama-cpp/build.rs).
cuda_lib="$plugin_dir/libggml-cuda.so.0"
[ -f "$lib" ] || { log "the build finished but $lib is missing"; exit 1; }
# ggml-cuda must really be there and compiled for the asked architecture.
if ! nm -D --defined-only "$cuda_lib" 2>/dev/null | grep ggml_backend_cuda_init >/dev/null; then
  log "$cuda_lib has no ggml_backend_cuda_init: not a CUDA build"; exit 1
fi
# The CUDA 13 wheels have no cuobjdump; the fat binary names its targets in the clear.
if ! strings -a "$cuda_lib" | grep "sm_$arch" >/dev/null; then
  log "$cuda_lib holds no sm_$arch code"; exit 1
fi
for needed in libllama.so.0 libggml.so.0 libggml-base.so.0; do
  [ -e "$plugin_dir/$needed" ] || { log "$plugin_dir lacks $needed"; exit 1; }
done
log "built in ${secs} s on $(nproc) cores: $lib ($(du -hL "$cuda_lib" | cut -f1) of ggml-cuda for sm_$arch)"
echo "$lib"
