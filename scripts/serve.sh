#!/usr/bin/env bash
# Serve Gemma 3 270M (Q4_K_M, CPU) through the OpenAI API on port 8080.
# Sets the machine up first (idempotent, cached), runs the build scripts/test.sh
# uses too (scripts/build.sh: one build, llama.cpp compiled once whichever
# command runs first), then runs `gantry-node serve`. Extra arguments go to
# `gantry-node serve` (e.g. --listen 127.0.0.1:9000 --threads 4).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
eval "$(scripts/setup.sh)"
scripts/build.sh
exec target/release/gantry-node serve --model "$GANTRY_GEMMA_GGUF" --model-id gemma-3-270m "$@"
