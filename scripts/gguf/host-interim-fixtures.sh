#!/usr/bin/env bash
# INTERIM testdata/gguf/, made on a machine WITHOUT torch/transformers (this C++ machine), for use
# until scripts/gguf/device-make-fixtures.sh can run on the device machine:
#   scripts/gguf/host-interim-fixtures.sh WORK_DIR LLAMA_BIN DEST
# LLAMA_BIN: llama-quantize, llama-imatrix, llama-gguf-split, llama-logits, dequant-goldens
#   (scripts/gguf/build-llama.sh SRC_TGZ DIR -> DIR/llama-src/build/bin), with gguf-py of the same
#   source tree on PYTHONPATH, and a python3 with numpy.
# DEST: the testdata/gguf folder to fill (README.md there is left alone).
# Differences from the device run: the models are written straight to F32 GGUF by llama.cpp's
# gguf-py (make_gguf_direct.py), not converted from a transformers checkpoint, and BF16/F16 are
# made by llama-quantize; the reference is llama.cpp's own logits on the F32 file
# (<arch>/reference.json), not transformers'; prompt ids are llama.cpp's tokenization.
# Quantization, imatrix, split, logits and dequant goldens are the same steps as the device run.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
W=$1; BIN=$(cd "$2" && pwd); DEST=$3
PY=${PYTHON:-python3}
mkdir -p "$W/logs" "$DEST"; W=$(cd "$W" && pwd); L=$W/logs
export LD_LIBRARY_PATH=$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
NP=$(nproc); T0=$SECONDS; fail=0
step() { echo "[$((SECONDS - T0))s] $*"; }
G=$W/gguf
ARCHS="qwen3_moe qwen2_moe mixtral glm4_moe"

step "make_gguf_direct.py + reference logits"
$PY "$here/make_gguf_direct.py" "$G" || exit 1
$PY "$here/interim_reference.py" "$W" --bin "$BIN/llama-logits" || exit 1
for a in $ARCHS; do cp "$repo/testdata/tokenizer/tokenizer.json" "$repo/testdata/tokenizer/tokenizer_config.json" "$W/fx/fixtures/$a/"; done

step "BF16 / F16 with llama-quantize"
for a in $ARCHS; do
  outs="BF16"; [ $a = qwen3_moe ] && outs="BF16 F16"
  for o in $outs; do
    "$BIN/llama-quantize" "$G/$a/$a-F32.gguf" "$G/$a/$a-$o.gguf" $o "$NP" > "$L/quantize-$a-$o.log" 2>&1 || { echo "quantize $a $o failed"; fail=1; }
  done
done

# from the F32 file: ik_llama.cpp's llama-imatrix aborts ("free(): invalid next size") on BF16 and
# F16 MoE GGUFs at this commit; the weights are the same values.
step "llama-imatrix"
for a in $ARCHS; do
  "$BIN/llama-imatrix" -m "$G/$a/$a-F32.gguf" -f "$W/fx/imatrix.txt" -o "$G/$a/$a.imatrix" \
    -c 64 -b 64 -t "$NP" --no-ppl > "$L/imatrix-$a.log" 2>&1 || { echo "imatrix $a failed"; tail -5 "$L/imatrix-$a.log"; fail=1; }
done

step "llama-quantize (mainline mixes)"
for a in $ARCHS; do
  types="Q8_0 Q4_K_M IQ3_XXS"
  [ $a = qwen3_moe ] && types="Q8_0 Q6_K Q5_K_M Q4_K_M Q4_0 Q5_0 IQ4_XS IQ3_XXS IQ3_S IQ2_M"
  for t in $types; do
    im=(); mi=(); case $t in IQ*) im=(--imatrix "$G/$a/$a.imatrix"); mi=(--imatrix);; esac
    rules=$($PY "$here/mainline_mix.py" "$G/$a/$a-BF16.gguf" $t "${mi[@]}") || { echo "mainline_mix $a $t failed"; fail=1; continue; }
    echo "--custom-q $rules" > "$L/quantize-$a-$t.rules"
    "$BIN/llama-quantize" "${im[@]}" --custom-q "$rules" "$G/$a/$a-BF16.gguf" "$G/$a/$a-$t.gguf" $t "$NP" \
      > "$L/quantize-$a-$t.log" 2>&1 || { echo "quantize $a $t failed"; tail -5 "$L/quantize-$a-$t.log"; fail=1; }
  done
done

step "llama-gguf-split"
mkdir -p "$G/qwen3_moe/split"
"$BIN/llama-gguf-split" --split --split-max-tensors 12 "$G/qwen3_moe/qwen3_moe-Q4_K_M.gguf" \
  "$G/qwen3_moe/split/qwen3_moe-Q4_K_M" > "$L/split.log" 2>&1 || { echo "split failed"; fail=1; }

step "llama-logits + KL vs the F32 reference"
find "$G" -name '*.gguf' ! -name '*-0000[2-9]-of-*' ! -name '*-F32.gguf' | sort | while read -r f; do
  a=$(basename "$(dirname "$f")"); [ "$a" = split ] && a=qwen3_moe
  $PY "$here/llama_compare.py" --bin "$BIN/llama-logits" --golden "$W/fx/fixtures/$a/reference.json" \
    --ref-name "llama.cpp on the F32 GGUF" --tokenize "$W/fx/fixtures/golden_tokenize.json" "$f" \
    > "$f.llama.summary.json" 2> "$f.llama.log" || { echo "compare $f failed"; tail -5 "$f.llama.log"; fail=1; }
done

step "dequant-goldens"
mkdir -p "$G/dequant"
"$BIN/dequant-goldens" "$G/dequant" > "$L/dequant.log" 2>&1 || { echo "dequant-goldens failed"; fail=1; }

step "finish"
{
  echo "INTERIM set, made on a CPU machine without torch/transformers by scripts/gguf/host-interim-fixtures.sh"
  echo "llama.cpp source: ik_llama.cpp $(cat "$repo/.devcarry-gguf/llama-src.describe" 2>/dev/null)"
  echo "tools: scripts/gguf/build-llama.sh ${BUILD_FLAGS:-}"
  echo "llama-logits settings: $($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['settings'])" "$G/qwen3_moe/qwen3_moe-Q8_0.gguf.llama.json" 2>/dev/null)"
  echo "python $($PY -c 'import sys, numpy; print(sys.version.split()[0], "numpy", numpy.__version__)')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $NP cores; made $(date -u +%Y-%m-%dT%H:%MZ)"
} > "$W/toolinfo.txt"
$PY "$here/finish_fixtures.py" "$W" "$DEST" --info "$W/toolinfo.txt" --interim || fail=1
step "done (fail=$fail)"
exit $fail
