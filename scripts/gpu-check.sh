#!/usr/bin/env bash
# On a GPU machine: the gpu tests, compute-sanitizer, then the model benchmark at the
# qwen3-30b-a3b 16-layer shape. BUNDLE_DIR holds bin/ (moeserve and the *cuda*_test binaries),
# lib/ (the shared libraries that machine lacks) and env.sh (their library path), as
# scripts/device-ctest.sh expects. Logs go to $OUT (or ./gpu-logs).
#   scripts/gpu-check.sh BUNDLE_DIR [tests|sanitize|bench|all]
set -uo pipefail
bundle=$(cd "$1" && pwd); what=${2:-all}
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu-logs}; mkdir -p "$out"
source "$bundle/env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv,noheader
if [[ $what == tests || $what == all ]]; then
  "$repo/scripts/device-ctest.sh" "$bundle" -L gpu 2>&1 | tee "$out/ctest-gpu.log" | grep -E "tests passed|Failed|Skipped|Total Test" 
  # The per-test details of every gpu binary, for the figures they print.
  for t in "$bundle"/bin/*cuda*_test; do "$t" --gtest_brief=1 > "$out/$(basename "$t").log" 2>&1; done
  grep -h -E "^\[ cuda goldens|GB/s|TFLOP/s|us a layer" "$out"/*_test.log | head -60
fi
if [[ $what == sanitize || $what == all ]]; then
  # A whole-model prefill step and decode steps (eager and replayed from graphs) of the tiny
  # qwen3_moe and glm4_moe, under memcheck and racecheck.
  export MOE_TESTDATA_DIR="$repo/testdata"
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 99 "$bundle/bin/cuda_goldens_test" \
      --gtest_filter='Fixtures/CudaGoldensTest.GraphsGiveTheTokensOfEagerMode/*' > "$out/sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -c -E '^========= (Invalid|Race|Error)' "$out/sanitizer-$tool.log") findings)"
    tail -3 "$out/sanitizer-$tool.log"
  done
fi
if [[ $what == bench || $what == all ]]; then
  model=/tmp/qwen3-30b-a3b-16l
  [[ -d $model ]] || /usr/bin/time -f "make-model: %e s" "$bundle/bin/moeserve" make-model --preset qwen3-30b-a3b \
    --layers 16 --vocab 32768 --out "$model" > "$out/make-model.log" 2>&1
  tail -2 "$out/make-model.log"
  "$bundle/bin/moeserve" bench model --model "$model" --device cuda --batches 1,8,32 --prompts 512,2048 \
    2>&1 | tee "$out/bench-model.log"
  "$bundle/bin/moeserve" bench model --model "$model" --device cuda --eager --batches 1,32 --prompts 512 \
    2>&1 | tee "$out/bench-model-eager.log" | grep -E "decode|prefill"
fi
