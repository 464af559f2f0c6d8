#!/usr/bin/env bash
# The build both README commands use:
#
#   scripts/build.sh serve   what scripts/serve.sh runs: the node and the engine plugins it
#                            loads (llama.cpp, native), release profile
#   scripts/build.sh [all]   what scripts/test.sh runs: every target of the workspace (tests,
#                            benches, the operator, the gateway, the fault plugins)
#
# The serve build is a subset of the full one, unit for unit: build-pins/ asks for the
# workspace's features of every dependency serve compiles (scripts/feature_pins.py), so
# whichever command a new user runs first, the second compiles only what the first did not,
# and llama.cpp once. tests/python/test_build_shared.py checks it with cargo's own
# fingerprints. Further arguments go to cargo (e.g. --message-format=json).
#
# Expects the environment of scripts/setup.sh (the caller evals it first).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
scope=all
case "${1:-}" in
  serve | all) scope="$1"; shift ;;
esac
if [ "$scope" = serve ]; then
  # Keep this list and scripts/feature_pins.py's SERVE_PACKAGES the same. Plugins are cdylibs
  # the node loads at run time; their build scripts lay out target/release/engines/.
  exec cargo build --release -p gantry-node -p gantry-engine-llama-cpp -p gantry-engine-native "$@"
fi
exec cargo build --release --workspace --all-targets "$@"
