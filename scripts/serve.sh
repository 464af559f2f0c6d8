#!/usr/bin/env bash
# Serve Gemma 3 270M (Q4_K_M, CPU) through the OpenAI API on port 8080.
# Sets the machine up first (idempotent, cached), builds the node and the
# llama.cpp plugin once, then runs `gantry-node serve`. Extra arguments go to
# `gantry-node serve` (e.g. --listen 127.0.0.1:9000 --threads 4).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
eval "$(scripts/setup.sh)"
cargo build --release -p gantry-node -p gantry-engine-llama-cpp
exec target/release/gantry-node serve --model "$GANTRY_GEMMA_GGUF" --model-id gemma-3-270m "$@"
