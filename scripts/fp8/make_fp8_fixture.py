"""Makes FP8 fixtures with transformers' own fine-grained FP8 quantization, and their goldens.

Run on a machine with a GPU of compute capability 8.9 or more (transformers quantizes and runs
FP8 there), torch and transformers installed:

  python3 scripts/fp8/make_fp8_fixture.py testdata/fixtures OUTDIR qwen3_moe,glm4_moe

For each fixture it writes OUTDIR/<arch>_fp8/: the model quantized at load by
FineGrainedFP8Config (e4m3 weights, one fp32 scale per 32 x 32 block: the fixtures' matrices are
64 to 256 wide, and 32 divides them all; the real releases use 128 x 128, which the C++ tests
write themselves) and saved as the FP8 releases are (weight + weight_scale_inv, quantization_config
in config.json); and two goldens in the format of the bf16 fixtures' golden.json:

  golden.json              the checkpoint's values (code times scale) computed in fp32: what
                           moeserve computes, checked at the CPU rule (5e-5);
  golden_fp8_kernels.json  transformers' FP8 kernels as they run (activations quantized to fp8
                           per 128 values), for the GPU rule of cuda_goldens_test.

Copy the small folders into testdata/fixtures/ and commit them with this script.
"""
import json
import os
import shutil
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

BLOCK = [32, 32]


def goldens(model, cases, device):
    out = []
    with torch.no_grad():
        for c in cases:
            ids = c["prompt_ids"]
            x = torch.tensor([ids], device=device)
            o = model(x, output_hidden_states=True)
            logits = o.logits[0].float()
            start = c["logits_from_position"]
            n_new = len(c["greedy_ids"])
            gen = model.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            top = torch.sort(logits[-1], descending=True).values
            out.append({"prompt_ids": ids, "logits_from_position": start,
                        "logits": [[round(v, 5) for v in r] for r in logits[start:].tolist()],
                        "final_hidden_last": [round(v, 6) for v in o.hidden_states[-1][0, -1].float().tolist()],
                        "greedy_ids": gen[0, len(ids):].tolist(),
                        "top1_margin_last": float(top[0] - top[1])})
    return out


def main():
    src, out_dir, archs = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    torch.manual_seed(0)
    summary = {"transformers": transformers.__version__, "torch": torch.__version__, "block": BLOCK, "models": {}}
    for arch in archs:
        d = os.path.join(src, arch)
        dst = os.path.join(out_dir, arch + "_fp8")
        os.makedirs(dst, exist_ok=True)
        cases = json.load(open(os.path.join(d, "golden.json")))["cases"]
        # Quantized at load, on the GPU, and saved as an FP8 release.
        q = AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.bfloat16, device_map="cuda",
            quantization_config=FineGrainedFP8Config(weight_block_size=BLOCK))
        q.save_pretrained(dst)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if os.path.exists(os.path.join(d, f)):
                shutil.copy(os.path.join(d, f), dst)
        kernels = goldens(q.eval(), cases, "cuda")
        json.dump({"weights_dtype": "float8_e4m3fn", "compute": "transformers FP8 kernels", "cases": kernels},
                  open(os.path.join(dst, "golden_fp8_kernels.json"), "w"))
        del q
        # The saved checkpoint's values in fp32, on the CPU.
        v = AutoModelForCausalLM.from_pretrained(
            dst, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
        v = v.float()
        values = goldens(v, cases, "cpu")
        json.dump({"weights_dtype": "float8_e4m3fn (dequantized)", "compute_dtype": "float32",
                   "rope_inv_freq": "float32", "cases": values}, open(os.path.join(dst, "golden.json"), "w"))
        worst = max(abs(a - b) for c1, c2 in zip(values, kernels)
                    for r1, r2 in zip(c1["logits"], c2["logits"]) for a, b in zip(r1, r2))
        summary["models"][arch] = {"kernels_vs_values_worst_logit": worst,
                                   "min_margin": min(c["top1_margin_last"] for c in values)}
        print(arch, summary["models"][arch], flush=True)
    json.dump(summary, open(os.path.join(out_dir, "SUMMARY-fp8.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
