#!/usr/bin/env bash
# The whole device-side job for testdata/gguf/, in one go, on a machine with torch + transformers
# (the GPU machine; everything here runs on its CPUs) and no internet:
#   build llama.cpp's tools -> tiny HF MoE models + transformers goldens (make_fixtures.py) ->
#   convert_hf_to_gguf.py (bf16, f16) -> llama-imatrix -> llama-quantize -> llama-gguf-split ->
#   llama.cpp logits + KL vs transformers (llama-logits, llama_compare.py) -> dequant goldens ->
#   testdata/gguf layout + MANIFEST.txt -> tarballs in $OUT.
#
#   scripts/gguf/device-make-fixtures.sh [WORK_DIR]
# Needs .devcarry-gguf/llama-src.tar.gz (scripts/gguf/pack-llama-src.sh). If LLAMA_BIN names a
# folder of already-built tools (llama-quantize llama-imatrix llama-gguf-split llama-logits
# dequant-goldens) that run here, they are used; otherwise they are built from the tarball
# (scripts/gguf/build-llama.sh: CPU only, GGML_NATIVE=ON), in parallel with make_fixtures.py.
# Output: $OUT/testdata-gguf.tgz.part-* (cat them | tar xz: testdata/gguf/...) and $OUT/work-logs.tgz.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
W=${1:-/tmp/gguf-work}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT" "$W/logs"
W=$(cd "$W" && pwd)
L=$W/logs
NP=$(nproc)
T0=$SECONDS
step() { echo "[$((SECONDS - T0))s] $*"; }
fail=0
export PYTHONUNBUFFERED=1
# If the run is cut short (10-minute limit per command), whatever logs exist still come back.
( sleep "${WATCHDOG_S:-540}"; tar czf "$OUT/partial-logs.tgz" -C "$W" logs 2>/dev/null ) &
watchdog=$!

# 1. the tools, and the fixtures with transformers at the same time
SRC=$W/llama-src
BIN=""
if [ -n "${LLAMA_BIN:-}" ]; then
  LD_LIBRARY_PATH=$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$LLAMA_BIN/dequant-goldens" >/dev/null 2>&1; rc=$?
  if [ $rc -eq 2 ]; then BIN=$(cd "$LLAMA_BIN" && pwd); step "using prebuilt tools in $BIN"
  else step "prebuilt tools in $LLAMA_BIN do not run here (rc $rc): building"; fi
fi
if [ -n "$BIN" ]; then
  rm -rf "$SRC"; tar xzf "$repo/.devcarry-gguf/llama-src.tar.gz" -C "$W"
  build_pid=""
else
  step "building llama.cpp tools"
  "$here/build-llama.sh" "$repo/.devcarry-gguf/llama-src.tar.gz" "$W" > "$L/build.log" 2>&1 &
  build_pid=$!
  BIN=$SRC/build/bin
fi
step "make_fixtures.py"
python3 "$here/make_fixtures.py" "$W/fx" > "$L/make_fixtures.log" 2>&1 || { echo "make_fixtures failed"; tail -30 "$L/make_fixtures.log"; fail=1; }
tail -25 "$L/make_fixtures.log"
if [ -n "$build_pid" ]; then
  wait "$build_pid" || { echo "BUILD FAILED"; grep -m5 -B2 -A8 "error" "$L/build.log"; tail -20 "$L/build.log"; tar czf "$OUT/partial-logs.tgz" -C "$W" logs; exit 1; }
  step "build done"
  # the built tools, for a later run on this kind of machine (LLAMA_BIN=...)
  (cd "$BIN" && tar czf - llama-quantize llama-imatrix llama-gguf-split llama-logits dequant-goldens *.so*) \
    | split -b 15m - "$OUT/llama-bin.tgz.part-"
fi
export LD_LIBRARY_PATH=$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$SRC/gguf-py${PYTHONPATH:+:$PYTHONPATH}

# 2. convert (the converter's own outtypes): bf16 for every arch, f16 for qwen3_moe, and f32 (only
#    for llama-imatrix, not kept)
G=$W/gguf
ARCHS="qwen3_moe qwen2_moe mixtral glm4_moe"
step "convert_hf_to_gguf.py"
pids=()
for a in $ARCHS; do
  mkdir -p "$G/$a"
  outs="bf16 f32"; [ $a = qwen3_moe ] && outs="bf16 f16 f32"
  for o in $outs; do
    O=$(echo $o | tr a-z A-Z)
    python3 "$here/convert_hf_to_gguf_fixture.py" "$SRC" "$W/fx/hf/$a" --outtype $o --no-lazy \
      --outfile "$G/$a/$a-$O.gguf" > "$L/convert-$a-$O.log" 2>&1 &
    pids+=($!)
  done
done
for p in "${pids[@]}"; do wait $p || fail=1; done
for f in "$L"/convert-*.log; do grep -q "successfully exported" "$f" || { echo "== $f"; tail -25 "$f"; }; done
python3 "$here/gguf_manifest.py" --check-convert "$G"/*/*-BF16.gguf "$G"/qwen3_moe/qwen3_moe-F16.gguf > "$L/convert-check.txt" 2>&1 \
  || { echo "CONVERT CHECK FAILED"; fail=1; }
grep -E "^==|convert check|!!|tokenizer.ggml.pre|rope.freq_base|expert_count|expert_used_count|expert_gating|expert_weights|rope.dimension_count" "$L/convert-check.txt"

# 3. importance matrices, over the prompts' and tokenizer cases' text, from the F32 GGUF (the same
#    values as the BF16 one): ik_llama.cpp's llama-imatrix aborts ("free(): invalid next size") on
#    BF16 and F16 MoE GGUFs at this commit.
step "llama-imatrix"
pids=()
for a in $ARCHS; do
  "$BIN/llama-imatrix" -m "$G/$a/$a-F32.gguf" -f "$W/fx/imatrix.txt" -o "$G/$a/$a.imatrix" \
    -c 64 -b 64 -t 4 --no-ppl > "$L/imatrix-$a.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p; done
for a in $ARCHS; do [ -s "$G/$a/$a.imatrix" ] || { echo "imatrix $a failed"; tail -20 "$L/imatrix-$a.log"; fail=1; }; done

# 4. quantize (IQ types with the imatrix), with mainline llama.cpp's per-tensor type choices
#    (mainline_mix.py -> --custom-q): ik_llama.cpp's own mixes use ik-only types for a few tensors.
#    IQ2_M, not IQ2_S: llama.cpp's "IQ2_S" file type is mostly IQ2_XS tensors; IQ2_M's are IQ2_S.
step "llama-quantize"
jobs_file=$W/quant-jobs.txt; : > "$jobs_file"
for a in $ARCHS; do
  types="Q8_0 Q4_K_M IQ3_XXS"
  [ $a = qwen3_moe ] && types="Q8_0 Q6_K Q5_K_M Q4_K_M Q4_0 Q5_0 IQ4_XS IQ3_XXS IQ3_S IQ2_M"
  for t in $types; do echo "$a $t" >> "$jobs_file"; done
done
quant_one() {
  a=$1; t=$2
  im=(); mi=(); case $t in IQ*) im=(--imatrix "$G/$a/$a.imatrix"); mi=(--imatrix);; esac
  rules=$(python3 "$HERE/mainline_mix.py" "$G/$a/$a-BF16.gguf" $t "${mi[@]}") || { echo "mainline_mix $a $t failed"; return; }
  echo "--custom-q $rules" > "$L/quantize-$a-$t.rules"
  "$BIN/llama-quantize" "${im[@]}" --custom-q "$rules" "$G/$a/$a-BF16.gguf" "$G/$a/$a-$t.gguf" $t 2 > "$L/quantize-$a-$t.log" 2>&1 \
    || { echo "quantize $a $t failed"; tail -15 "$L/quantize-$a-$t.log"; }
}
export -f quant_one; export G L BIN HERE=$here
xargs -P "$NP" -L 1 bash -c 'quant_one $0 $1' < "$jobs_file"
grep -h -iE "substitut|fallback|falling back|cannot|not divisible|converting to|requires" "$L"/quantize-*.log | sort | uniq -c | head -40

# 5. split: qwen3_moe Q4_K_M into parts of at most 12 tensors
step "llama-gguf-split"
mkdir -p "$G/qwen3_moe/split"
"$BIN/llama-gguf-split" --split --split-max-tensors 12 "$G/qwen3_moe/qwen3_moe-Q4_K_M.gguf" \
  "$G/qwen3_moe/split/qwen3_moe-Q4_K_M" > "$L/split.log" 2>&1 || { echo "split failed"; tail -20 "$L/split.log"; fail=1; }
ls -l "$G/qwen3_moe/split"

# 6. llama.cpp logits on every file, compared with transformers' (1 thread each, files in parallel)
step "llama-logits + KL"
find "$G" -name '*.gguf' ! -name '*-0000[2-9]-of-*' ! -name '*-F32.gguf' | sort > "$W/logit-jobs.txt"
cmp_one() {
  f=$1
  a=$(basename "$(dirname "$f")"); [ "$a" = split ] && a=$(basename "$(dirname "$(dirname "$f")")")
  python3 "$HERE/llama_compare.py" --bin "$BIN/llama-logits" --golden "$FX/fixtures/$a/golden.json" \
    --tokenize "$FX/fixtures/golden_tokenize.json" "$f" > "$f.llama.summary.json" 2> "$f.llama.log" \
    || { echo "compare $f failed"; tail -20 "$f.llama.log"; }
}
export -f cmp_one; export FX=$W/fx
xargs -P "$NP" -L 1 bash -c 'cmp_one $0' < "$W/logit-jobs.txt"

# 7. dequant goldens
step "dequant-goldens"
mkdir -p "$G/dequant"
"$BIN/dequant-goldens" "$G/dequant" > "$L/dequant.log" 2>&1 || { echo "dequant-goldens failed"; fail=1; }
cat "$L/dequant.log"

# 8. testdata/gguf layout, MANIFEST.txt
step "finish"
{
  echo "llama.cpp source: ik_llama.cpp $(cat "$repo/.devcarry-gguf/llama-src.describe" 2>/dev/null)"
  echo "tools: ${LLAMA_BIN:+prebuilt (scripts/gguf/build-llama.sh $(cat "$BIN/BUILD_FLAGS" 2>/dev/null))}${LLAMA_BIN:-built here by scripts/gguf/build-llama.sh (GGML_NATIVE=ON, CPU only)}"
  echo "llama-logits system info: $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['settings'])" "$G/qwen3_moe/qwen3_moe-Q8_0.gguf.llama.json" 2>/dev/null)"
  python3 -c "import torch, transformers, tokenizers, numpy, sys; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, numpy {numpy.__version__}')"
  echo "gguf-py: $(python3 -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $NP cores; made $(date -u +%Y-%m-%dT%H:%MZ)"
} > "$W/toolinfo.txt"
rm -rf "$W/testdata"; mkdir -p "$W/testdata/gguf"
python3 "$here/finish_fixtures.py" "$W" "$W/testdata/gguf" --info "$W/toolinfo.txt" || fail=1
du -sh "$W/testdata/gguf"; du -a "$W/testdata/gguf" | sort -k2 | awk '{print $1"K", $2}' | sed "s|$W/||" | head -80

# 9. tarballs for the way back (files of at most 15 MiB)
step "tar"
rm -f "$OUT"/testdata-gguf.tgz.part-*
tar czf - -C "$W" testdata | split -b 15m - "$OUT/testdata-gguf.tgz.part-"
tar czf "$OUT/work-logs.tgz" -C "$W" logs toolinfo.txt kl_table.md fx/SUMMARY.json fx/prompts.txt \
  $(cd "$W" && ls gguf/*/*.imatrix gguf/*/*.llama.summary.json gguf/*/*.llama.log gguf/*/*-BF16.gguf.llama.json 2>/dev/null) \
  $(cd "$W" && ls fx/hf/*/config.json 2>/dev/null)
kill $watchdog 2>/dev/null; rm -f "$OUT/partial-logs.tgz"
ls -l "$OUT"
step "done (fail=$fail)"
exit $fail
