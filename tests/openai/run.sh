#!/usr/bin/env bash
# Runs openai.test.mjs (the official openai npm client) against `moeserve serve`. Exit 77 (a skip
# for CTest) when node or the installed client is missing: `npm ci` in tests/openai installs it
# (scripts/test.sh does).
# Usage: run.sh MOESERVE_BINARY MODEL_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if ! command -v node > /dev/null; then
  echo "skipped: node is not installed (scripts/install-deps.sh installs it)"
  exit 77
fi
if [[ ! -d "$here/node_modules/openai" ]]; then
  echo "skipped: the openai client is not installed; run 'npm ci' in $here"
  exit 77
fi
export MOESERVE="$1" MODEL_DIR="$2"
cd "$here"
exec node --test openai.test.mjs
