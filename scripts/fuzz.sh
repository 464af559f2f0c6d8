#!/usr/bin/env bash
# Fuzz the untrusted-input parsers (crate gantry-formats) for a bounded time:
# each target in fuzz/ runs GANTRY_FUZZ_SECONDS (default 20) from its seed
# corpus in fuzz/seeds/. A crash (panic, failed assertion, overflow), an input
# slower than 10 s, or RSS above 1 GiB fails the run; libFuzzer saves the input
# under fuzz/artifacts/<target>/ and prints how to reproduce it.
#
# cargo-fuzz passes nightly `-Z` flags; the stable toolchain accepts them with
# RUSTC_BOOTSTRAP=1. No sanitizer: gantry-formats forbids `unsafe`, so Rust's
# own checks (bounds, overflow with debug assertions on) already catch what
# ASan would, and the build and run stay fast on two cores. The build goes to
# target/fuzz so its instrumentation flags never invalidate the main build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
seconds="${GANTRY_FUZZ_SECONDS:-20}"
cargo_fuzz="$(command -v cargo-fuzz || true)"
if [ -z "$cargo_fuzz" ]; then
  echo "fuzz: cargo-fuzz not found; run scripts/setup.sh (it installs it)" >&2
  exit 1
fi
export RUSTC_BOOTSTRAP=1
flags=(--sanitizer none --target-dir "$root/target/fuzz")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

t0=$SECONDS
"$cargo_fuzz" build "${flags[@]}"
echo "fuzz: targets built in $((SECONDS - t0)) s"
for target in gguf_header metadata_json; do
  # New inputs go to a scratch directory (the first corpus), so the checked-in
  # seeds stay as they are.
  mkdir -p "$work/$target"
  t1=$SECONDS
  timeout --kill-after=10 $((seconds + 120)) \
    "$cargo_fuzz" run "${flags[@]}" "$target" "$work/$target" "fuzz/seeds/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 -max_len=65536 \
    -print_final_stats=1 2> "$work/$target.log" || {
      status=$?
      tail -n 60 "$work/$target.log" >&2
      echo "fuzz: $target FAILED (exit $status)" >&2
      exit 1
    }
  runs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$target.log" | grep -o '[0-9]*$' || echo '?')"
  echo "fuzz: $target ok: $runs inputs in $((SECONDS - t1)) s, no crash or hang"
done
