"""Runs llama.cpp (our llama-logits tool, CPU, 1 thread) on a GGUF for every golden prompt and
writes <file>.llama.json beside it: llama.cpp's logits at the positions golden.json holds, and
how far they are from transformers' fp32 logits.
  python3 llama_compare.py --bin LLAMA_LOGITS --golden golden.json --tokenize golden_tokenize.json \
      [--out OUT.json] [--name NAME] FILE.gguf
Per case: prompt_ids, logits_from_position, logits (rounded to 4 decimals), kl_mean and kl_max
over positions of KL(softmax(transformers) || softmax(llama)) in nats, argmax (llama.cpp's greedy
token at each position), top1_margin (its gap to the second best), argmax_agrees (with
transformers, per position). Top level: kl_mean (over all positions of all cases), kl_max,
argmax_agreement (fraction of positions), tokenize_matches_hf and the mismatching texts.
Prints one JSON summary line.
"""
import argparse, json, os, subprocess, sys, tempfile

import numpy as np


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--bin", required=True)
    ap.add_argument("--golden", required=True)
    ap.add_argument("--tokenize", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ref-name", default="transformers fp32",
                    help="what --golden holds (INTERIM fixtures: llama.cpp on the F32 GGUF)")
    a = ap.parse_args()
    out_path = a.out or a.gguf + ".llama.json"
    golden = json.load(open(a.golden))
    tcases = json.load(open(a.tokenize))["cases"] if a.tokenize else []

    with tempfile.TemporaryDirectory() as td:
        pf = os.path.join(td, "prompts.txt")
        with open(pf, "w") as f:
            for c in golden["cases"]:
                f.write(" ".join(map(str, c["prompt_ids"])) + "\n")
        tf = os.path.join(td, "texts.hex")
        with open(tf, "w") as f:
            for c in tcases:
                f.write(c["text"].encode("utf-8").hex() + "\n")
        raw = os.path.join(td, "raw.json")
        cmd = [a.bin, "--model", a.gguf, "--prompts", pf, "--out", raw, "--threads", str(a.threads)]
        if tcases:
            cmd += ["--tokenize", tf]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stderr[-4000:])
            print(json.dumps({"file": a.name or a.gguf, "error": f"llama-logits exit {p.returncode}"}))
            return 1
        r = json.load(open(raw))

    cases = []
    all_kl, agree = [], []
    for g, l in zip(golden["cases"], r["cases"]):
        assert g["prompt_ids"] == l["prompt_ids"]
        p0 = g["logits_from_position"]
        lt = np.array(g["logits"], dtype=np.float64)
        ll = np.array(l["logits"][p0:], dtype=np.float64)
        assert lt.shape == ll.shape, (lt.shape, ll.shape)
        lpt, lpl = log_softmax(lt), log_softmax(ll)
        kl = (np.exp(lpt) * (lpt - lpl)).sum(axis=-1)
        srt = np.sort(ll, axis=-1)
        am = ll.argmax(axis=-1)
        ag = am == lt.argmax(axis=-1)
        all_kl += kl.tolist()
        agree += ag.tolist()
        cases.append({"prompt_ids": g["prompt_ids"], "logits_from_position": p0,
                      "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                      "argmax": am.tolist(), "top1_margin": [round(float(x), 5) for x in srt[:, -1] - srt[:, -2]],
                      "argmax_agrees": ag.tolist(),
                      "logits": [[round(float(v), 4) for v in row] for row in ll]})

    mism = []
    for c, lt in zip(tcases, r.get("tokenize", [])):
        if c["ids"] != lt["ids"]:
            mism.append({"text": c["text"], "hf": c["ids"], "llama": lt["ids"]})
    res = {"file": a.name or os.path.basename(a.gguf), "desc": r.get("desc"), "meta": r.get("meta"),
           "settings": r.get("settings"),
           "reference": a.ref_name,
           "kl_definition": f"KL(softmax({a.ref_name}) || softmax(llama.cpp on this file)) in nats, per position",
           "kl_mean": float(np.mean(all_kl)), "kl_max": float(np.max(all_kl)),
           "argmax_agreement": float(np.mean(agree)), "positions": len(all_kl),
           "tokenize_matches_hf": (not mism) if tcases else None, "tokenize_mismatches": mism,
           "cases": cases}
    with open(out_path, "w") as f:
        json.dump(res, f, ensure_ascii=False, separators=(",", ":"))
    summ = {k: res[k] for k in ("file", "kl_mean", "kl_max", "argmax_agreement", "positions", "tokenize_matches_hf")}
    summ["llama_tokenize"] = r.get("tokenize")
    print(json.dumps(summ, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
