"""INTERIM fixtures (no transformers at hand): the prompts, the reference logits and the tokenizer
golden, from llama.cpp itself.
  python3 interim_reference.py WORK --bin LLAMA_LOGITS [--tokenizer-golden testdata/tokenizer/golden_tokenize.json]
WORK/gguf/<arch>/<arch>-F32.gguf (make_gguf_direct.py) -> WORK/fx/fixtures/<arch>/reference.json
(golden.json's format: cases[i].prompt_ids, logits_from_position, logits; computed by llama.cpp on
the F32 file, whose weights are the exact values the BF16 file holds), WORK/fx/fixtures/
golden_tokenize.json (the Hugging Face ids of testdata/tokenizer/golden_tokenize.json),
WORK/fx/imatrix.txt, WORK/fx/prompts.txt.
"""
import argparse, json, os, subprocess, sys, tempfile

# as in make_fixtures.py
PROMPT_TEXTS = ["Hello world", "混合专家模型在双卡上运行",
                "def f(x):\n    return x**2  # square\n" * 2,
                "The quick brown fox jumps over the lazy dog. " * 3]
EXTRA_PROMPTS = [[5]]
ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]


def run_logits(binary, model, prompts, texts, td):
    pf, tf, out = (os.path.join(td, n) for n in ("p.txt", "t.hex", "o.json"))
    with open(pf, "w") as f:
        for p in prompts:
            f.write(" ".join(map(str, p)) + "\n")
    with open(tf, "w") as f:
        for t in texts:
            f.write(t.encode("utf-8").hex() + "\n")
    cmd = [binary, "--model", model, "--prompts", pf, "--out", out, "--threads", "1"]
    if texts:
        cmd += ["--tokenize", tf]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.load(open(out))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--bin", required=True)
    ap.add_argument("--tokenizer-golden", default=os.path.join(here, "../../testdata/tokenizer/golden_tokenize.json"))
    a = ap.parse_args()
    W = a.work
    fx = os.path.join(W, "fx", "fixtures")
    os.makedirs(fx, exist_ok=True)
    tg = json.load(open(a.tokenizer_golden, encoding="utf-8"))
    json.dump({"tokenizer": "tokenizer.json", "cases": tg["cases"]},
              open(os.path.join(fx, "golden_tokenize.json"), "w"), ensure_ascii=False, indent=1)

    with tempfile.TemporaryDirectory() as td:
        q3 = os.path.join(W, "gguf", "qwen3_moe", "qwen3_moe-F32.gguf")
        r = run_logits(a.bin, q3, [[5]], PROMPT_TEXTS, td)
        prompts = [t["ids"] for t in r["tokenize"]] + EXTRA_PROMPTS
        with open(os.path.join(W, "fx", "prompts.txt"), "w") as f:
            for p in prompts:
                f.write(" ".join(map(str, p)) + "\n")
        with open(os.path.join(W, "fx", "imatrix.txt"), "w", encoding="utf-8") as f:
            for _ in range(12):
                f.write("\n".join(PROMPT_TEXTS + [c["text"] for c in tg["cases"]]) + "\n")
        for arch in ARCHS:
            r = run_logits(a.bin, os.path.join(W, "gguf", arch, f"{arch}-F32.gguf"), prompts, [], td)
            cases = []
            for c in r["cases"]:
                ids = c["prompt_ids"]
                p0 = max(0, len(ids) - 4) if len(ids) > 40 else 0
                cases.append({"prompt_ids": ids, "logits_from_position": p0,
                              "logits": [[round(v, 5) for v in row] for row in c["logits"][p0:]]})
            d = os.path.join(fx, arch)
            os.makedirs(d, exist_ok=True)
            json.dump({"reference": "llama.cpp logits on the F32 GGUF (INTERIM: no transformers golden)",
                       "settings": r["settings"], "cases": cases}, open(os.path.join(d, "reference.json"), "w"))
            print(arch, [len(p) for p in prompts])
    return 0


if __name__ == "__main__":
    sys.exit(main())
