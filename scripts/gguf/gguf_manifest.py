"""Lists GGUF files with llama.cpp's own gguf-py: size, sha256, key metadata and every tensor's
type and shape; flags tensor types that mainline llama.cpp does not have (ik_llama.cpp-only types).
  python3 gguf_manifest.py [--root DIR] [--check-convert] FILE.gguf...   (gguf-py on PYTHONPATH)
--check-convert: exit 1 unless each file has tokenizer.ggml.pre == "qwen2", a chat template,
rope.freq_base, and the expert counts.
"""
import argparse, hashlib, os, sys

import numpy as np
import gguf

# ggml type ids that mainline llama.cpp (ggml-org) also has
MAINLINE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                  10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
                  17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
                  23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
                  30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}

KEYS = ["general.architecture", "general.file_type", "general.quantization_version", "tokenizer.ggml.model",
        "tokenizer.ggml.pre", "split.no", "split.count", "split.tensors.count"]
ARCH_KEYS = ["block_count", "embedding_length", "feed_forward_length", "expert_feed_forward_length",
             "expert_shared_feed_forward_length", "expert_count", "expert_used_count", "expert_shared_count",
             "leading_dense_block_count", "expert_weights_scale", "expert_weights_norm", "expert_gating_func",
             "nextn_predict_layers", "attention.head_count", "attention.head_count_kv", "attention.key_length",
             "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
             "context_length", "vocab_size"]


def field_value(f):
    if f is None:
        return None
    t = f.types[0] if f.types else None
    if t == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    if t == gguf.GGUFValueType.ARRAY:
        return f"[array of {len(f.data)}]"
    v = f.parts[f.data[0]]
    return v.tolist()[0] if isinstance(v, np.ndarray) else v


def describe(path, root):
    r = gguf.GGUFReader(path)
    arch = field_value(r.fields.get("general.architecture"))
    kv = {k: field_value(r.fields.get(k)) for k in KEYS}
    for k in ARCH_KEYS:
        v = field_value(r.fields.get(f"{arch}.{k}"))
        if v is not None:
            kv[f"{arch}.{k}"] = v
    kv["tokenizer.chat_template present"] = "tokenizer.chat_template" in r.fields
    kv["tokenizer.ggml.tokens"] = len(r.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in r.fields else None
    kv["tokenizer.ggml.merges"] = len(r.fields["tokenizer.ggml.merges"].data) if "tokenizer.ggml.merges" in r.fields else None
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.add_bos_token"):
        if k in r.fields:
            kv[k] = field_value(r.fields[k])
    tensors = []
    for t in r.tensors:
        tid = int(t.tensor_type)
        tensors.append((t.name, gguf.GGMLQuantizationType(tid).name, tid, [int(x) for x in t.shape], int(t.n_bytes)))
    h = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return {"file": os.path.relpath(path, root) if root else path, "bytes": os.path.getsize(path), "sha256": h,
            "kv": kv, "tensors": tensors}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--root", default=None)
    ap.add_argument("--check-convert", action="store_true")
    a = ap.parse_args()
    bad = 0
    for p in a.files:
        d = describe(p, a.root)
        print(f"== {d['file']}  {d['bytes']} bytes  sha256 {d['sha256']}")
        for k, v in d["kv"].items():
            if v is not None:
                print(f"   {k} = {v}")
        counts = {}
        for name, tname, tid, shape, nb in d["tensors"]:
            counts[tname] = counts.get(tname, 0) + 1
        print("   tensor types: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
        nonmain = sorted({tname for _, tname, tid, _, _ in d["tensors"] if tid not in MAINLINE_TYPES})
        if nonmain:
            print(f"   !! tensor types that mainline llama.cpp lacks: {nonmain}")
            bad += 1
        for name, tname, tid, shape, nb in d["tensors"]:
            print(f"   {name:34s} {tname:8s} {str(shape):18s} {nb}")
        if a.check_convert:
            kv = d["kv"]
            arch = kv["general.architecture"]
            problems = []
            if kv.get("tokenizer.ggml.pre") != "qwen2":
                problems.append(f"tokenizer.ggml.pre = {kv.get('tokenizer.ggml.pre')}")
            if not kv["tokenizer.chat_template present"]:
                problems.append("no tokenizer.chat_template")
            for k in ("rope.freq_base", "expert_count", "expert_used_count"):
                if f"{arch}.{k}" not in kv:
                    problems.append(f"no {arch}.{k}")
            if problems:
                print("   !! convert check failed: " + "; ".join(problems))
                bad += 1
            else:
                print("   convert check: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
