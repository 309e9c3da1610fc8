#!/usr/bin/env bash
# The expert-pool measurements on the GPU machine, from a bundle (scripts/device-ctest.sh has the
# tests): the kernel sweep against the read bandwidth, then loading a 10 GB arena and attaching.
#   scripts/device-bench.sh BUNDLE_DIR OUT_DIR
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2
source "$bundle/env.sh"
B="$bundle/bin/moeserve"
echo "== machine: $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GiB"
grep -o -w -E 'avx512_bf16|avx512_vnni|amx_bf16|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
echo "== bench experts"
"$B" bench experts --read-mb 4096 --json > "$out/bench_experts.json" 2> "$out/bench_experts.log"
cat "$out/bench_experts.log"
echo "== decode with 300 us of other work between calls (as a forward's attention), threads lingering, then sleeping"
for linger in 2000 0; do
  "$B" bench experts --formats int8,int4 --kernels vnni --batches 1,4 --gap-us 300 --linger-us $linger 2>&1 |
    sed -n '/against the best read/,$p' | sed "s/^  /  linger $linger us: /"
done
echo "== bench load (qwen3-30b-a3b, 8 layers: about 10 GB of bf16 experts)"
"$B" make-model --preset qwen3-30b-a3b --layers 8 --out /tmp/q30b8 --quiet
name=moeserve_bench_$$
echo "(the first load after the machine starts is slower, as the kernel hands out memory for the first time:)"
"$B" bench load --model /tmp/q30b8 --expert-format bf16 --json
for format in bf16 int8 int4; do
  "$B" bench load --model /tmp/q30b8 --expert-format $format --json
done
for format in int8 bf16; do  # a shared arena: the first run fills it, the second attaches
  "$B" bench load --model /tmp/q30b8 --expert-format $format --expert-shm "$name" --json
  "$B" bench load --model /tmp/q30b8 --expert-format $format --expert-shm "$name" --json --unlink
done
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "(page cache dropped)" && \
  "$B" bench load --model /tmp/q30b8 --expert-format bf16 --json
rm -f "/dev/shm/$name" "/dev/shm/$name".* "/dev/shm/$name"-bound*
