#!/usr/bin/env bash
# Installs, builds and runs every test (GPU tests skip where no GPU is visible), then builds the
# fuzz targets with clang and runs each for FUZZ_SECONDS (default 60; FUZZ_SECONDS=0 skips them).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
# The openai npm client for the openai_node_client test (it skips without it).
if command -v npm > /dev/null; then
  (cd tests/openai && npm ci --no-audit --no-fund --loglevel=error > /dev/null) ||
    echo "warning: npm ci in tests/openai failed; the openai client test will skip" >&2
fi
ctest --test-dir build --output-on-failure -j"$(nproc)"
if [[ "${FUZZ_SECONDS:-60}" != 0 ]]; then
  ./scripts/fuzz.sh
fi
