#!/usr/bin/env bash
# Installs, builds and runs every test (GPU tests skip where no GPU is visible).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
