#!/usr/bin/env bash
# Builds ggml's ggml-quants.c (from a ggml or llama.cpp checkout: GGML_SOURCE_DIR holds src/ and
# include/, as ggml/ in llama.cpp) with dequant_goldens.c and writes the dequantization goldens
# into OUT_DIR (testdata/gguf/dequant).
set -euo pipefail
src=${1:?GGML_SOURCE_DIR}
out=${2:?OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
gcc -O2 -march=native -c -I"$src/include" -I"$src/src" "$src/src/ggml-quants.c" -o "$tmp/q.o"
gcc -O2 -I"$src/include" -I"$src/src" "$here/dequant_goldens.c" "$here/dequant_goldens_stubs.c" "$tmp/q.o" -lm \
  -o "$tmp/goldens"
mkdir -p "$out"
"$tmp/goldens" "$out"
