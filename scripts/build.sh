#!/usr/bin/env bash
# Installs the Debian packages moeserve needs, then configures and builds it in ./build.
# CUDA is built when a CUDA compiler is found (MOE_ENABLE_CUDA=AUTO); set MOE_ENABLE_CUDA=OFF
# to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ENABLE_CUDA="${MOE_ENABLE_CUDA:-AUTO}"
cmake --build build -j"$(nproc)"
