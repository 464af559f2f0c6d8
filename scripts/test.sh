#!/usr/bin/env bash
# Run every Gantry test: setup, one release build of the workspace (llama.cpp
# is compiled once and shared by tests and binaries), the Rust tests, then the
# OpenAI-compatibility suite with the official `openai` Python client.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
eval "$(scripts/setup.sh)"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Plugins are cdylibs that tests load at run time: build them before testing.
cargo build --release --workspace --all-targets
cargo test --release --workspace
"$GANTRY_VENV/bin/python" -m pytest -q tests/python
