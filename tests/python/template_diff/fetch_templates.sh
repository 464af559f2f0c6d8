#!/usr/bin/env bash
# Fetch the chat-template corpus for node-pod/tests/template_diff.rs and print
# its directory on stdout (everything else goes to stderr).
#
# The corpus is llama.cpp's collection of real model templates
# (models/templates/*.jinja), which the llama-cpp-python source distribution on
# PyPI vendors; the version is pinned so every machine tests the same files.
# Idempotent and cached under $GANTRY_CACHE/templates (default
# ~/.cache/gantry): a second run only prints the directory.
#
#   GANTRY_TEMPLATES_DIR="$(tests/python/template_diff/fetch_templates.sh)"
set -euo pipefail

version="0.3.36"
cache="${GANTRY_CACHE:-$HOME/.cache/gantry}/templates"
dest="$cache/llama-cpp-python-$version"
stamp="$dest/.complete"
log() { printf 'fetch_templates: %s\n' "$*" >&2; }

if [ ! -f "$stamp" ]; then
  python="${GANTRY_VENV:+$GANTRY_VENV/bin/python}"
  python="${python:-python3}"
  work="$(mktemp -d "${TMPDIR:-/tmp}/gantry-templates.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  log "downloading llama-cpp-python==$version (source distribution, ~77 MB)"
  "$python" -m pip download --quiet --disable-pip-version-check \
    --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work" >&2
  sdist="$work/llama_cpp_python-$version.tar.gz"
  [ -f "$sdist" ] || { log "pip did not leave $sdist"; exit 1; }
  tar -xzf "$sdist" -C "$work" --wildcards \
    "llama_cpp_python-$version/vendor/llama.cpp/models/templates/*"
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp"
  cp "$work/llama_cpp_python-$version/vendor/llama.cpp/models/templates/"* "$dest.tmp/"
  count="$(find "$dest.tmp" -name '*.jinja' | wc -l)"
  [ "$count" -gt 0 ] || { log "no templates in $sdist"; exit 1; }
  touch "$dest.tmp/.complete"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
  log "$count templates in $dest"
fi

echo "$dest"
