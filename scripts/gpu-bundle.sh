#!/usr/bin/env bash
# Pack everything scripts/gpu-check.sh needs into one archive for a GPU machine that has the
# NVIDIA driver and CUDA 13's runtime libraries but no Rust toolchain, no compiler and no
# network (a cluster node, a rented GPU box):
#
#   scripts/gpu-bundle.sh OUT_DIR        # writes OUT_DIR/gantry-gpu-bundle.tar.xz
#
# and on the GPU machine, from a checkout of the same commit (for the scripts):
#
#   tar -xJf gantry-gpu-bundle.tar.xz -C /some/dir
#   GANTRY_GPU_BUNDLE=/some/dir/gantry-gpu-bundle GANTRY_GEMMA_GGUF=…/gemma-3-270m-q4_k_m.gguf \
#     scripts/gpu-check.sh RESULTS_DIR
#
# The archive holds (binaries stripped):
#   bin/gantry-node                the node, as scripts/build.sh builds it
#   tests/node-lib                 the node's unit tests (gpu-check step 2: devices)
#   tests/engine-host-lib          the engine host's unit tests (step 2: the CUDA probe)
#   tests/native-cuda              the native engine's CUDA tests (step 5)
#   engines/llama_cpp/cuda/        the llama.cpp CUDA plugin with its llama/ggml shared
#                                  libraries (scripts/check-cuda-build.sh)
#   engines/native/cuda/           the native engine's CUDA plugin (same script)
#   peer/llama-server              llama.cpp's own server from the same sources, built as shared
#                                  libraries (GANTRY_PEER_LINK=shared bench/build-llama-server.sh)
#                                  with the libraries it needs that the plugin directory lacks.
#                                  gpu-check runs it on the plugin directory's libllama/libggml,
#                                  so both sides run the very same ggml-cuda build
#   lib/libgomp.so.1               OpenMP's runtime, used only where the machine has none
#   wheels/gguf-*.whl              PyPI's gguf (pure Python), for making the bf16 model there
#   BUNDLE.txt                     the commit, the build flags and each file's sha256
#
# Builds what is missing (each step is cached and idempotent) and reuses what scripts/build.sh,
# scripts/test.sh and the two CUDA scripts already built. CPU code is built as those builds
# are (for this machine's CPU, .cargo/config.toml): set RUSTFLAGS="-C target-cpu=x86-64-v3"
# for a GPU machine whose CPU lacks what this one has.
set -euo pipefail
shopt -s extglob
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-}"
[ -n "$out" ] || { echo "usage: scripts/gpu-bundle.sh OUT_DIR" >&2; exit 2; }
log() { printf 'gpu-bundle: %s\n' "$*" >&2; }
python="${GANTRY_VENV:+$GANTRY_VENV/bin/}python3"
command -v "$python" >/dev/null 2>&1 || python=python3

log "building the node and its tests (reuses scripts/build.sh's build)"
scripts/build.sh serve --locked >&2
tests_json="$(mktemp)"
trap 'rm -f "$tests_json"' EXIT
cargo test --release --locked --workspace --no-run --message-format=json > "$tests_json"
test_exe() { # manifest target-kind target-name: the executable cargo reported for it
  "$python" - "$tests_json" "$root/$1" "$2" "$3" <<'EOF'
import json, sys
path, manifest, kind, name = sys.argv[1:]
for line in open(path):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m.get("manifest_path") == manifest and kind in t.get("kind", [])
            and t.get("name") == name):
        print(m["executable"])
        break
EOF
}
node_tests="$(test_exe node-pod/Cargo.toml lib gantry_node)"
host_tests="$(test_exe engine-host/Cargo.toml lib gantry_engine_host)"
native_tests="$(test_exe engines/native/Cargo.toml test cuda)"
[ -x "$node_tests" ] || { log "no unit-test binary for gantry-node"; exit 1; }
[ -x "$host_tests" ] || { log "no unit-test binary for gantry-engine-host"; exit 1; }
[ -x "$native_tests" ] || { log "no 'cuda' test binary for gantry-engine-native"; exit 1; }

log "building the CUDA plugins (scripts/check-cuda-build.sh, cached)"
scripts/check-cuda-build.sh >&2
plugins="$root/target/cuda-check/release/engines"

log "building the peer llama-server as shared libraries (cached)"
peer="$(GANTRY_PEER_LINK=shared bench/build-llama-server.sh)"

stage="$(mktemp -d)"
trap 'rm -rf "$stage" "$tests_json"' EXIT
b="$stage/gantry-gpu-bundle"
mkdir -p "$b/bin" "$b/tests" "$b/engines/llama_cpp/cuda" "$b/engines/native/cuda" "$b/peer" "$b/wheels"
strip -o "$b/bin/gantry-node" target/release/gantry-node
strip -o "$b/tests/node-lib" "$node_tests"
strip -o "$b/tests/engine-host-lib" "$host_tests"
strip -o "$b/tests/native-cuda" "$native_tests"
# Copy a library directory's entries into the bundle: each real file once (stripped), the
# other names as the symlinks they are here.
copy_libs() { # from-dir to-dir [skip-pattern]
  local f name real
  for f in "$1"/*; do
    [ -e "$f" ] || continue
    name="$(basename "$f")"
    if [ -n "${3:-}" ] && [[ "$name" == $3 ]]; then continue; fi
    case "$name" in
      *.so|*.so.*)
        real="$(readlink -f "$f")"
        [ -e "$2/$(basename "$real")" ] || strip -o "$2/$(basename "$real")" "$real"
        [ "$name" = "$(basename "$real")" ] || ln -sfn "$(basename "$real")" "$2/$name"
        ;;
      *) cp -L "$f" "$2/" ;;
    esac
  done
}
copy_libs "$plugins/llama_cpp/cuda" "$b/engines/llama_cpp/cuda"
# The native plugin without the CUDA 12 libraries linked beside it here: the GPU machine's
# own cuBLAS and NVRTC are found on its library path (gpu-check.sh sets it).
strip -o "$b/engines/native/cuda/libgantry_engine_native.so" "$plugins/native/cuda/libgantry_engine_native.so"
cp "$plugins/native/cuda/manifest.json" "$b/engines/native/cuda/"
strip -o "$b/peer/llama-server" "$peer"
# The peer's own shared libraries that the plugin directory does not provide (libmtmd,
# libllama-common, the server's implementation); libllama and libggml* come from the plugin's.
copy_libs "$(dirname "$peer")" "$b/peer" "@(libggml*|libllama.so*|llama-server|*.a)"
# The C/C++ runtime libraries the plugin and the peer link that a slim GPU image may lack
# (OpenMP's libgomp): gpu-check.sh puts them last on the library path, after the machine's own.
mkdir -p "$b/lib"
for soname in libgomp.so.1; do
  f="$(ldconfig -p | awk -v n="$soname" '$1 == n { print $NF; exit }')"
  [ -n "$f" ] && cp -L "$f" "$b/lib/$soname"
done
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  -d "$b/wheels" "$(grep -E '^gguf==' scripts/requirements-test.txt)" >&2
{
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet || echo ' (with local changes)')"
  echo "built on: $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "RUSTFLAGS: ${RUSTFLAGS:-(none: .cargo/config.toml)}"
  echo "peer: $peer"
  echo "files:"
  (cd "$b" && find . -type f ! -name BUNDLE.txt | sort | xargs sha256sum | sed 's/^/  /')
} > "$b/BUNDLE.txt"
mkdir -p "$out"
tar -cJf "$out/gantry-gpu-bundle.tar.xz" -C "$stage" gantry-gpu-bundle
log "wrote $out/gantry-gpu-bundle.tar.xz ($(du -h "$out/gantry-gpu-bundle.tar.xz" | cut -f1))"
echo "$out/gantry-gpu-bundle.tar.xz"
