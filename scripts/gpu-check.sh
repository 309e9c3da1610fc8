#!/usr/bin/env bash
# On a GPU machine: the gpu tests, compute-sanitizer, then the benchmarks at the qwen3-30b-a3b
# 16-layer shape. BUNDLE_DIR holds bin/ (moeserve and the *cuda*_test binaries), lib/ (the shared
# libraries that machine lacks) and env.sh (their library path), as scripts/device-ctest.sh
# expects. Logs go to $LOGS (or ./gpu-logs); each phase has a time limit, so that a hung phase
# leaves the others their time.
#   scripts/gpu-check.sh BUNDLE_DIR [tests|experts|cpubackend|cputhreads|cpushared|cputests|cpu|sanitize|bench|hybrid|gpuexperts|prefill|serve|profile|fp8kv|defer|heldexperts|distributed|all ...]
set -uo pipefail
bundle=$(cd "$1" && pwd); shift
phases=" ${*:-all} "
want() { [[ $phases == *" $1 "* || $phases == *" all "* ]]; }
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${LOGS:-$repo/gpu-logs}; mkdir -p "$out"
source "$bundle/env.sh"
export MOE_TESTDATA_DIR="$repo/testdata"
model=/tmp/qwen3-30b-a3b-16l
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv,noheader
make_model() {
  [[ -d $model ]] && return
  /usr/bin/time -f "make-model: %e s" timeout 200 "$bundle/bin/moeserve" make-model \
    --preset qwen3-30b-a3b --layers 16 --vocab 32768 --out "$model" > "$out/make-model.log" 2>&1
  tail -2 "$out/make-model.log"
}
if want tests; then
  timeout 300 "$repo/scripts/device-ctest.sh" "$bundle" -L gpu -V > "$out/ctest-gpu.log" 2>&1
  grep -E "^[0-9]+: \[ tap \]" "$out/ctest-gpu.log" | awk '$NF+0 > 0.02' | head -20
  grep -E "tests passed|\(Failed\)|Not Run|Skipped|Total Test|FAILED  \]" "$out/ctest-gpu.log" | head -40
  grep -h -E "cuda goldens|GB/s|TFLOP/s|us a layer" "$out/ctest-gpu.log" | head -40
fi
if want experts; then
  timeout 200 "$bundle/bin/experts_test" > "$out/experts-test.log" 2>&1; echo "experts_test: exit $?"
  grep -E "PASSED|FAILED|SKIPPED" "$out/experts-test.log" | head -20
fi
if want cpubackend; then
  # The CPU backend's packed Linears on this machine's cores (AMX from 16 rows), and the whole
  # model on the CPU with int8 weights and experts against its read bound.
  timeout 120 "$bundle/bin/runtime_test" --gtest_filter='PackedLinear*:Backends/BackendTest.*/cpu' > "$out/runtime-test.log" 2>&1
  echo "runtime_test (CPU backend): exit $?"; grep -E "PASSED|FAILED" "$out/runtime-test.log" | head -5
  timeout 120 "$bundle/bin/goldens_test" --gtest_filter='*Quantized*:*Goldens*' > "$out/goldens-test.log" 2>&1
  echo "goldens_test: exit $?"; grep -E "quantized \]|PASSED|FAILED" "$out/goldens-test.log" | head -30
  make_model
  for wf in bf16 int8; do
    timeout 150 "$bundle/bin/moeserve" bench model --model "$model" --device cpu --weight-format $wf --expert-format int8 \
      --batches 1,8 --prompts 512 --decode-steps 16 > "$out/bench-cpu-$wf.log" 2>&1
    echo "bench model --device cpu --weight-format $wf: exit $?"
    grep -E "^(bandwidth|host read|decode|prefill|matrix)" "$out/bench-cpu-$wf.log"
  done
fi
if want cputhreads; then
  # What bounded CPU decode at batch 1 with two sets of threads (--shared-threads off): the pool's
  # sleeping between layers against lingering, and the cores split between the backend and the
  # pool; then the one shared set (the default) for comparison.
  make_model
  for cfg in "--shared-threads off --expert-linger-us 0" "--shared-threads off --expert-linger-us 2000" \
             "--shared-threads off --threads 4 --expert-threads 12 --expert-linger-us 2000" \
             "--shared-threads off --threads 8 --expert-threads 8 --expert-linger-us 2000" "--shared-threads on"; do
    timeout 100 "$bundle/bin/moeserve" bench model --model "$model" --device cpu --weight-format int8 --expert-format int8 \
      --batches 1 --prompts 64 --decode-steps 16 $cfg > "$out/bench-cpu-threads.log" 2>&1
    echo "bench model --device cpu $cfg: exit $?"; grep -E "^decode" "$out/bench-cpu-threads.log"
  done
fi
if want cpushared; then
  # One set of pinned threads for the CPU backend's operations and the expert pool (--shared-threads
  # on, the default) against the backend's own threads beside the pool's (off), and the blocked
  # attention: first the tests on this machine's cores (AMX from 16 rows), then paired rounds of the
  # whole model on the CPU (decode at batch 1 and 8 against the read bound, prefill of 512), and
  # decode at a 4096-token context, where attention reads 16 MB of KV cache a token.
  timeout 150 "$bundle/bin/runtime_test" \
    --gtest_filter='*PagedAttention*:CpuBackendThreads*:PackedLinear*:Backends/BackendTest.*/cpu*' \
    > "$out/runtime-test-shared.log" 2>&1
  echo "runtime_test (attention, lent threads): exit $?"; grep -E "PASSED|FAILED" "$out/runtime-test-shared.log" | head -8
  timeout 200 "$bundle/bin/goldens_test" \
    --gtest_filter='*TheBackendOnThePoolsThreads*:*LogitsAndGreedyIds*:*DecodeWithKvCache*:*BatchingSequences*:*ChunkedPrefill*' \
    > "$out/goldens-test-shared.log" 2>&1
  echo "goldens_test: exit $?"; grep -E "goldens \]|kv cache \]|PASSED|FAILED" "$out/goldens-test-shared.log" | head -16
  timeout 100 "$bundle/bin/experts_test" --gtest_filter='*LentThreads*:*Linger*' > "$out/experts-test-shared.log" 2>&1
  echo "experts_test (lent threads): exit $?"; grep -E "PASSED|FAILED" "$out/experts-test-shared.log" | head -5
  make_model
  # SHARED_ROUNDS paired rounds (default 2); SHARED_MORE=0 leaves out the linger, bf16 and long-context runs.
  for round in $(seq 1 "${SHARED_ROUNDS:-2}"); do
    for shared in on off; do
      timeout 150 "$bundle/bin/moeserve" bench model --model "$model" --device cpu --weight-format int8 \
        --expert-format int8 --batches 1,8 --prompts 512 --decode-steps 32 --shared-threads $shared \
        > "$out/bench-cpu-shared-$shared-$round.log" 2>&1
      echo "round $round, bench model --device cpu --weight-format int8 --shared-threads $shared: exit $?"
      grep -E "^(bandwidth|host read|decode|prefill)" "$out/bench-cpu-shared-$shared-$round.log"
    done
  done
  if [[ ${SHARED_MORE:-1} == 1 ]]; then
  # The threads awake between steps too (after a step they sleep by default).
  timeout 150 "$bundle/bin/moeserve" bench model --model "$model" --device cpu --weight-format int8 \
    --expert-format int8 --batches 1,8 --prompts 512 --decode-steps 32 --expert-linger-us 2000 \
    > "$out/bench-cpu-shared-linger.log" 2>&1
  echo "bench model --device cpu --weight-format int8 --expert-linger-us 2000: exit $?"
  grep -E "^(decode|prefill)" "$out/bench-cpu-shared-linger.log"
  for shared in on off; do
    timeout 150 "$bundle/bin/moeserve" bench model --model "$model" --device cpu --weight-format bf16 \
      --expert-format int8 --batches 1 --prompts 512 --decode-steps 16 --shared-threads $shared \
      > "$out/bench-cpu-shared-bf16-$shared.log" 2>&1
    echo "bench model --device cpu --weight-format bf16 --shared-threads $shared: exit $?"
    grep -E "^(decode|prefill)" "$out/bench-cpu-shared-bf16-$shared.log"
    timeout 200 "$bundle/bin/moeserve" bench model --model "$model" --device cpu --weight-format int8 \
      --expert-format int8 --batches 1 --decode-context 4096 --prompts 2048 --decode-steps 16 \
      --shared-threads $shared > "$out/bench-cpu-shared-long-$shared.log" 2>&1
    echo "bench model --decode-context 4096 --prompts 2048 --shared-threads $shared: exit $?"
    grep -E "^(decode|prefill)" "$out/bench-cpu-shared-long-$shared.log"
  done
  fi
fi
if want cpu; then
  # The CPU kernels on this machine's cores (AMX among them), the expert pool against the read
  # bandwidth, and the whole model on the CPU backend.
  timeout 200 "$bundle/bin/experts_test" > "$out/experts-test.log" 2>&1; echo "experts_test: exit $?"
  grep -E "PASSED|FAILED|SKIPPED|tests ran" "$out/experts-test.log" | head -20
  timeout 120 "$bundle/bin/moeserve" bench experts --formats int8,int4 --batches 1,16,512 --layers 8 \
    > "$out/bench-experts.log" 2>&1; echo "bench experts: exit $?"
  grep -v "^loading" "$out/bench-experts.log" | tail -40
  make_model
  timeout 200 "$bundle/bin/moeserve" bench model --model "$model" --device cpu --expert-format int8 --batches 1,8 \
    --prompts 512 --decode-steps 16 > "$out/bench-model-cpu.log" 2>&1; echo "bench model cpu: exit $?"
  grep -v "^loading" "$out/bench-model-cpu.log" | tail -40
fi
if want bench; then
  make_model
  timeout 200 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --batches 1,8,32 \
    --prompts 512,2048 > "$out/bench-model.log" 2>&1; echo "bench model: exit $?"
  grep -v "^loading" "$out/bench-model.log" | tail -80
  timeout 100 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --eager --batches 1,32 \
    --prompts 512 > "$out/bench-model-eager.log" 2>&1; echo "bench model --eager: exit $?"
  grep -E "decode|prefill" "$out/bench-model-eager.log"
fi
if want hybrid; then
  # Every routed expert in the CPU pool beside the GPU: int8 and int4 decode, prefill; and the pool
  # alone at the model's shape, back to back and with a forward's gap between calls.
  make_model
  for gap in 0 100; do
    timeout 60 "$bundle/bin/moeserve" bench experts --formats int8 --batches 1 --layers 16 --gap-us $gap \
      --stream-tokens 0 > "$out/bench-experts-gap$gap.log" 2>&1; echo "bench experts --gap-us $gap: exit $?"
    grep -E "batch     1|read bandwidth" "$out/bench-experts-gap$gap.log" | head -8
  done
  for fmt in int8 int4; do
    batches=1,4,16; prompts=512,2048
    [[ $fmt == int4 ]] && batches=1,4 && prompts=512
    timeout 200 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --cpu-moe --expert-format $fmt \
      --batches $batches --prompts $prompts --decode-steps 32 > "$out/bench-hybrid-$fmt.log" 2>&1
    echo "bench model --cpu-moe --expert-format $fmt: exit $?"
    grep -E "^(moeserve|model|bandwidth|host read|decode|prefill)|per MoE layer|per layer|  by |^    (operations|eager|graphs)" \
      "$out/bench-hybrid-$fmt.log" | head -40
  done
  # Prefill with the experts kept on the CPU, for the streamed path's comparison.
  timeout 100 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --cpu-moe --expert-format int8 \
    --batches 1 --decode-steps 8 --prompts 2048 --prefill-offload-tokens 0 > "$out/bench-hybrid-cpu-prefill.log" 2>&1
  echo "bench model --prefill-offload-tokens 0: exit $?"; grep -E "^prefill" "$out/bench-hybrid-cpu-prefill.log"
fi
if want gpuexperts; then
  # A routing profile over random-id prompts, then decode with each CPU layer's 32 most used
  # experts held on the GPU too, against none, every routed expert on the CPU (int8).
  make_model
  awk 'BEGIN { srand(1); for (p = 0; p < 64; p++) { s = ""; for (i = 0; i < 128; i++) s = s (i ? "," : "") int(rand() * 32768); print s } }' \
    > /tmp/prompt-ids.txt
  timeout 120 "$bundle/bin/moeserve" profile-experts --model "$model" --prompt-ids-file /tmp/prompt-ids.txt \
    --out /tmp/profile.json --device cuda --cpu-moe --expert-format int8 > "$out/profile-experts.log" 2>&1
  echo "profile-experts: exit $?"; grep -v "^loading" "$out/profile-experts.log" | tail -3
  for n in 0 32; do
    extra=(); [[ $n -gt 0 ]] && extra=(--gpu-experts-per-layer $n --expert-profile /tmp/profile.json)
    timeout 150 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --cpu-moe --expert-format int8 \
      --batches 1,4 --prompts 512 --decode-steps 32 "${extra[@]}" > "$out/bench-gpu-experts-$n.log" 2>&1
    echo "bench model --gpu-experts-per-layer $n: exit $?"
    grep -E "^(moeserve|decode|prefill)|per MoE layer|per layer" "$out/bench-gpu-experts-$n.log" | head -12
  done
fi
if want prefill; then
  # Hybrid prefill at both lengths with the threshold measured at load (int8 experts).
  make_model
  timeout 120 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --cpu-moe --expert-format int8 \
    --batches 1 --decode-steps 8 --prompts 512,2048 > "$out/bench-hybrid-prefill.log" 2>&1
  echo "bench model prefill: exit $?"; grep -E "^prefill|^decode" "$out/bench-hybrid-prefill.log"
fi
if want serve; then
  make_model
  timeout 150 "$bundle/bin/moeserve" bench serve --model "$model" --device cuda --concurrency 1,32 \
    --prompt-len 128 --output-len 128 > "$out/bench-serve.log" 2>&1; echo "bench serve: exit $?"
  tail -12 "$out/bench-serve.log"
fi
if want profile; then
  # Nsight Compute on the decode kernels of one token (the MoE layer's, then the GEMVs): time,
  # DRAM bytes and DRAM throughput per kernel, the clocks as the card has them.
  timeout 150 ncu --clock-control none --target-processes all \
    -k regex:'SingleToken|DecodeExpert|GroupByExpert|CombineSlots|Gemv' -c 24 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
    "$bundle/bin/runtime_cuda_test" --gtest_filter='MoeRealShapeTest.PrintsBandwidthAndThroughput:LinearTimingTest.*' \
    > "$out/ncu.log" 2>&1
  echo "ncu: exit $?"
  grep -E "SingleToken|DecodeExpert|GroupByExpert|Gemv|gpu__time_duration|dram__|launch__grid" "$out/ncu.log" | head -60
fi
if want fp8kv; then
  # The fp8 KV cache: its kernels under memcheck, then decode at a long context with the bf16 and
  # the fp8 cache (attention reads half the bytes), all on the GPU.
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 "$bundle/bin/runtime_cuda_test" \
    --gtest_filter='*Fp8*' > "$out/sanitizer-fp8.log" 2>&1
  echo "compute-sanitizer memcheck (fp8 kernels): exit $? ($(grep -c -E '^========= (Invalid|Error)' "$out/sanitizer-fp8.log") findings)"
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/sanitizer-fp8.log" | tail -3
  make_model
  for kv in bf16 fp8; do
    timeout 150 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --kv-cache-dtype $kv --batches 1,32 \
      --decode-context 8192 --decode-steps 32 --prompts 2048 > "$out/bench-kv-$kv.log" 2>&1
    echo "bench model --kv-cache-dtype $kv --decode-context 8192: exit $?"
    grep -E "^(decode|prefill)" "$out/bench-kv-$kv.log"
  done
fi
if want defer; then
  # Expert deferral beside the GPU: batch-1 decode with 0, 1 and 2 of each token's experts deferred.
  make_model
  for n in 0 1 2; do
    timeout 120 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --cpu-moe --expert-format int8 \
      --batches 1,4 --prompts 512 --decode-steps 32 --defer-experts $n > "$out/bench-defer-$n.log" 2>&1
    echo "bench model --cpu-moe --defer-experts $n: exit $?"
    grep -E "^(bandwidth|host read|decode)|per MoE layer|per layer" "$out/bench-defer-$n.log" | head -8
  done
fi
if want heldexperts; then
  # Each CPU layer's 32 experts held on the GPU, chosen while serving (refreshed every 16 steps),
  # against none.
  make_model
  # Two rows at batch 1: the second is timed after the first's steps, once the held experts settled.
  for n in 0 32; do
    extra=(); [[ $n -gt 0 ]] && extra=(--gpu-experts-per-layer $n --gpu-experts-refresh-steps 64)
    timeout 200 "$bundle/bin/moeserve" bench model --model "$model" --device cuda --cpu-moe --expert-format int8 \
      --batches 1,1 --prompts 512 --decode-steps 400 "${extra[@]}" > "$out/bench-held-$n.log" 2>&1
    echo "bench model --gpu-experts-per-layer $n (chosen while serving): exit $?"
    grep -E "^decode|held on the GPU" "$out/bench-held-$n.log" | head -8
  done
fi
if want cputests; then
  # Every CPU test binary the bundle holds, on this machine's cores (AMX among them).
  for t in experts_test runtime_test goldens_test; do
    timeout 200 "$bundle/bin/$t" --gtest_brief=1 > "$out/$t-all.log" 2>&1; echo "$t: exit $?"
    grep -E "PASSED|FAILED|tests ran" "$out/$t-all.log" | head -5
  done
fi
if want distributed; then
  # One-rank NCCL communicators, a GPU worker behind the control stream against the in-process GPU
  # path, the control plane's cost a step on this machine, and Gloo's all-reduce on its cores.
  timeout 120 "$bundle/bin/comm_gpu_test" > "$out/comm-gpu-test.log" 2>&1; echo "comm_gpu_test: exit $?"
  grep -E "OK \]|SKIPPED|FAILED|PASSED" "$out/comm-gpu-test.log" | head -12
  MOE_BINARY_DIR="$bundle/bin" timeout 150 "$bundle/bin/cuda_cluster_test" > "$out/cuda-cluster-test.log" 2>&1
  echo "cuda_cluster_test: exit $?"
  grep -E "OK \]|FAILED|PASSED|Failure" "$out/cuda-cluster-test.log" | head -6
  for dev in cpu cuda; do
    timeout 120 "$bundle/bin/moeserve" bench control --model "$MOE_TESTDATA_DIR/fixtures/qwen3_moe" --device $dev \
      --steps 500 > "$out/bench-control-$dev.log" 2>&1; echo "bench control --device $dev: exit $?"
    grep -E "^(decode|control)" "$out/bench-control-$dev.log"
  done
  timeout 60 "$bundle/bin/moeserve" bench comm > "$out/bench-comm.log" 2>&1; echo "bench comm: exit $?"
  tail -4 "$out/bench-comm.log"
fi
if want sanitize; then
  # A prefill, a decode and a mixed step of each fixture (op by op), and graph replays of qwen3_moe,
  # under memcheck; the qwen3_moe steps under racecheck (slow: it checks every shared access).
  for tool in memcheck racecheck; do
    filter='Fixtures/CudaGoldensTest.EveryTensor*/*:Fixtures/CudaGoldensTest.GraphsGiveTheTokensOfEagerMode/qwen3_moe:Fixtures/CudaGoldensTest.HybridExecution*/qwen3_moe:Fixtures/CudaGoldensTest.StreamedExperts*/qwen3_moe:Fixtures/CudaGoldensTest.Fp8*/qwen3_moe:Fixtures/CudaGoldensTest.HeldExperts*/qwen3_moe:Fixtures/CudaGoldensTest.ExpertDeferral*/qwen3_moe'
    [[ $tool == racecheck ]] && filter='Fixtures/CudaGoldensTest.EveryTensor*/qwen3_moe'
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 "$bundle/bin/cuda_goldens_test" \
      --gtest_filter="$filter" > "$out/sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -c -E '^========= (Invalid|Race|Error)' "$out/sanitizer-$tool.log") findings)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/sanitizer-$tool.log" | tail -3
  done
fi
