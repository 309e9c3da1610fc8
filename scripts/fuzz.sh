#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang (coverage, ASan, UBSan) in ./build-fuzz, runs
# each for FUZZ_SECONDS (default 60) on a copy of its seed corpus, and prints one line per target
# with its executions per second. Exits non-zero on any finding (a crash, a sanitizer report, a
# broken invariant, a hang past -timeout, memory past -rss_limit_mb); the input that caused it is
# saved under build-fuzz/findings/<target>/ and the end of the target's log is printed.
#
#   FUZZ_SECONDS=60   how long each target runs
#   FUZZ_TARGETS="…"  which targets (default: all of them)
#   FUZZ_JOBS=N       targets run at once (default: the number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"
jobs="${FUZZ_JOBS:-$(nproc)}"
# Every fuzz/<target>_fuzzer.cc is a target (fuzz/CMakeLists.txt builds the same list).
all_targets=$(cd fuzz && ls ./*_fuzzer.cc | sed 's#^\./##; s#_fuzzer\.cc$##' | tr '\n' ' ')
read -r -a targets <<<"${FUZZ_TARGETS:-$all_targets}"
out=build-fuzz

# Per target: the largest input, the time one input may take, and the memory it may use. A file
# header or config fits in a few KB; a request in 1 KB. A request may run for its 2 s deadline
# plus the wait for the engine to go idle; a parser has no reason to take more than a second.
max_len() { case "$1" in generate_request) echo 1024 ;; safetensors_header | gguf_header) echo 8192 ;; *) echo 4096 ;; esac; }
timeout_s() { case "$1" in generate_request) echo 30 ;; *) echo 10 ;; esac; }
rss_mb() { case "$1" in generate_request) echo 3072 ;; *) echo 2048 ;; esac; }

build_start=$SECONDS
CC=clang CXX=clang++ cmake -S . -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ -DMOE_BUILD_FUZZERS=ON -DMOE_ENABLE_CUDA=OFF -DMOE_BUILD_TESTS=OFF >/dev/null
cmake --build "$out" -j"$(nproc)" --target $(printf 'fuzz_%s ' "${targets[@]}")
echo "fuzz: built ${#targets[@]} targets in $((SECONDS - build_start)) s"

# Runs one target; its log, corpus and scratch files live under build-fuzz/run/<target>/.
run_target() {
  local t="$1" dir="$out/run/$1"
  rm -rf "$dir"
  mkdir -p "$dir/corpus" "$dir/tmp" "$out/findings/$t"
  cp fuzz/corpus/"$t"/* "$dir/corpus/"
  if [[ -d fuzz/regressions/$t ]]; then find "fuzz/regressions/$t" -maxdepth 1 -type f -exec cp {} "$dir/corpus/" \;; fi
  local dict=()
  [[ -f fuzz/dicts/$t.dict ]] && dict=("-dict=fuzz/dicts/$t.dict")
  local start=$SECONDS rc=0
  TMPDIR="$PWD/$dir/tmp" "$out/fuzz/fuzz_$t" "$dir/corpus" "${dict[@]}" -max_total_time="$seconds" \
    -max_len="$(max_len "$t")" -timeout="$(timeout_s "$t")" -rss_limit_mb="$(rss_mb "$t")" \
    -print_final_stats=1 -artifact_prefix="$out/findings/$t/" >"$dir/log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - start))" >"$dir/result"
}

run_start=$SECONDS
running=0
for t in "${targets[@]}"; do
  run_target "$t" &
  running=$((running + 1))
  if ((running >= jobs)); then
    wait -n || true
    running=$((running - 1))
  fi
done
wait

failed=0
for t in "${targets[@]}"; do
  dir="$out/run/$t"
  read -r rc elapsed <"$dir/result"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log" | tail -1)
  execs=${execs:-0}
  ((elapsed > 0)) || elapsed=1
  if [[ "$rc" == 0 ]]; then
    printf 'fuzz: %-20s %9d runs in %3d s: %7d exec/s, corpus %s files, ok\n' "$t" "$execs" "$elapsed" \
      $((execs / elapsed)) "$(find "$dir/corpus" -type f | wc -l)"
  else
    failed=1
    printf 'fuzz: %-20s FINDING (exit %s) after %d runs; input in %s:\n' "$t" "$rc" "$execs" "$out/findings/$t/"
    ls -1 "$out/findings/$t/" | sed 's/^/  /'
    tail -n 40 "$dir/log" | sed 's/^/  | /'
  fi
done
echo "fuzz: runs took $((SECONDS - run_start)) s, all in all $((SECONDS - build_start)) s"
exit "$failed"
