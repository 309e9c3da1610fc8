#!/usr/bin/env bash
# The embedded default, on any Linux machine without a GPU: build, make the tiny random-weight
# Qwen3-MoE model, and generate from it on the CPU backend, printing tokens and speed.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
model=build/models/tiny
if [ ! -f "$model/config.json" ]; then
  build/moeserve make-model --arch qwen3_moe --preset tiny --out "$model"
fi
build/moeserve generate --model "$model" --prompt-ids 1,2,3,4,5,6,7,8 --max-new-tokens 32
