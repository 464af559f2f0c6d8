# The CUDA libraries of a GPU machine, for scripts that run Gantry's CUDA code there
# (scripts/gpu-check.sh, scripts/gpu-decode.sh): source this file, then
#   link_cuda_libs WORK_DIR
# links each library under the names the plugins open into WORK_DIR/cuda-libs, puts that
# directory first on LD_LIBRARY_PATH and exports GANTRY_NVRTC_LIB where NVRTC was found.
#
# The llama.cpp plugin links libcudart/libcublas of the toolkit it was built with (13 for
# scripts/check-cuda-build.sh); the native engine opens cuBLAS and NVRTC by name at run time
# (libcublas.so, libnvrtc.so, then versioned names). Candidates: CUDA_HOME, /usr/local/cuda,
# the toolkits scripts/check-cuda-build.sh installs, Python's nvidia-* wheels.
link_cuda_libs() {
  local work="$1" py="${python:-python3}" d f lib major
  cuda_libs="$work/cuda-libs"
  rm -rf "$cuda_libs"; mkdir -p "$cuda_libs"
  local cuda_dirs=()
  for d in "${CUDA_HOME:-}/lib64" "${CUDA_PATH:-}/lib64" /usr/local/cuda/lib64 \
           /usr/local/cuda/targets/x86_64-linux/lib \
           "${GANTRY_CACHE:-$HOME/.cache/gantry}/cuda-toolkit-13.0/root/lib64" \
           "${GANTRY_CACHE:-$HOME/.cache/gantry}/cuda-runtime-12/lib"; do
    [ -d "$d" ] && cuda_dirs+=("$d")
  done
  while IFS= read -r d; do cuda_dirs+=("$d"); done < <("$py" - <<'PYEOF' 2>/dev/null
import glob, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for d in sorted(glob.glob(f"{r}/nvidia/cu*/lib")) + sorted(glob.glob(f"{r}/nvidia/*/lib")):
        print(d)
PYEOF
)
  local lib_path=""
  for major in 12 13; do
    for lib in libcudart libcublas libcublasLt libnvrtc libnvrtc-builtins; do
      f=""
      for d in "${cuda_dirs[@]}"; do
        [ -e "$d/$lib.so.$major" ] && { f="$(readlink -f "$d/$lib.so.$major")"; break; }
      done
      [ -n "$f" ] || continue
      ln -sfn "$f" "$cuda_libs/$lib.so.$major"
      # The first major found (12: the native plugin's bindings are CUDA 12.8's; else 13) also
      # answers to the unversioned name cudarc tries first.
      [ -e "$cuda_libs/$lib.so" ] || ln -sfn "$f" "$cuda_libs/$lib.so"
      # Their directories too: a library opens its companions (NVRTC's builtins, cuBLASLt) there.
      case ":$lib_path:" in *":$(dirname "$f"):"*) ;; *) lib_path="$lib_path:$(dirname "$f")" ;; esac
    done
  done
  export LD_LIBRARY_PATH="$cuda_libs$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [ -z "${GANTRY_NVRTC_LIB:-}" ] && [ -e "$cuda_libs/libnvrtc.so" ]; then
    export GANTRY_NVRTC_LIB="$cuda_libs/libnvrtc.so"
  fi
}
