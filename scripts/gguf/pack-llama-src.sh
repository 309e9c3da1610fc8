#!/usr/bin/env bash
# Host side: packs the llama.cpp sources that the GGUF fixtures need (ik_llama.cpp, a llama.cpp fork
# with the same GGUF converter, quantizer and standard quant types) into .devcarry-gguf/ for the
# device machine, which has no internet:
#   scripts/gguf/pack-llama-src.sh [GIT_DIR] [COMMIT]
# GIT_DIR defaults to the mirror /work/.mirror/ikawrakow+ik_llama.cpp/repo, COMMIT to its HEAD.
# Leaves out the server (one of its blobs is missing from the mirror), the tests, the model vocab
# files and the other examples: scripts/gguf/device-make-fixtures.sh writes its own
# examples/CMakeLists.txt with just quantize, imatrix, gguf-split and our two tools.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
git_dir=${1:-/work/.mirror/ikawrakow+ik_llama.cpp/repo}
commit=$(git -C "$git_dir" rev-parse "${2:-HEAD}")
out="$repo/.devcarry-gguf"
mkdir -p "$out"
paths=(CMakeLists.txt LICENSE cmake ggml src include common
       vendor/cpp-httplib vendor/nlohmann vendor/sheredom
       examples/CMakeLists.txt examples/quantize examples/imatrix examples/gguf-split
       convert_hf_to_gguf.py gguf-py)
git -C "$git_dir" archive --format=tar --prefix=llama-src/ "$commit" "${paths[@]}" | gzip -9 > "$out/llama-src.tar.gz"
echo "$commit" > "$out/llama-src.commit"
git -C "$git_dir" log -1 --format='%H %cd %s' "$commit" > "$out/llama-src.describe"
ls -l "$out/llama-src.tar.gz"; cat "$out/llama-src.describe"
