#!/usr/bin/env bash
# Runs bundled test binaries under CTest on a machine without this build tree (the GPU machine):
#   scripts/device-ctest.sh BUNDLE_DIR [ctest args, e.g. -L gpu]
# BUNDLE_DIR holds moeserve and the *_test binaries with the libraries they need (a device bundle).
# Test binaries whose name holds "cuda" get the label gpu, the others cpu.
set -euo pipefail
bundle=$(cd "$1" && pwd); shift
repo=$(cd "$(dirname "$0")/.." && pwd)
source "$bundle/env.sh"
export MOE_TESTDATA_DIR="$repo/testdata" MOE_BINARY_DIR="$bundle/bin"
dir="$bundle/ctest"
rm -rf "$dir"; mkdir -p "$dir"
for t in "$bundle"/bin/*_test; do
  name=$(basename "$t")
  label=cpu; [[ $name == *cuda* ]] && label=gpu
  echo "add_test($name \"$t\" --gtest_brief=1)" >> "$dir/CTestTestfile.cmake"
  echo "set_tests_properties($name PROPERTIES LABELS $label ENVIRONMENT \"MOE_TESTDATA_DIR=$MOE_TESTDATA_DIR;MOE_BINARY_DIR=$MOE_BINARY_DIR\")" >> "$dir/CTestTestfile.cmake"
done
cd "$dir" && ctest --output-on-failure "$@"
