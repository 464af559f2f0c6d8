#!/usr/bin/env bash
# The one build both README commands use (scripts/serve.sh and scripts/test.sh):
# the whole workspace, every target, release profile. Keeping a single cargo
# invocation means one feature set for every dependency, so llama.cpp and the
# dependency tree compile once whichever command a new user runs first.
#
# Expects the environment of scripts/setup.sh (the caller evals it first).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Plugins are cdylibs that tests and `gantry-node` load at run time: they are
# workspace members, so this builds them too.
exec cargo build --release --workspace --all-targets
