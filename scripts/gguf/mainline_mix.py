"""Per-tensor quantization types as MAINLINE llama.cpp's llama-quantize would choose them, for
ik_llama.cpp's llama-quantize to apply with --custom-q.
  python3 mainline_mix.py BF16.gguf FTYPE [--imatrix]      (gguf-py on PYTHONPATH)
prints a --custom-q argument: "^(name|name...)$=TYPE,..." covering every tensor that mainline
quantizes.

Why: ik_llama.cpp's quantization mixes put some tensors in types that only ik_llama.cpp has
(IQ4_K, IQ5_K, IQ3_K... e.g. attn_v of an IQ3_XXS or IQ4_XS file), which mainline llama.cpp and
moeserve cannot read. This is a port of llama_tensor_get_type_impl() from ggml-org/llama.cpp
src/llama-quant.cpp (commit 007dbbf3fd17), restricted to the file types used here, so the
fixtures have mainline's standard-type mixes.
"""
import re, sys

import gguf

T = gguf.GGMLQuantizationType
FTYPES = {  # llama-quantize name -> default ggml type (llama_ftype_get_default_type)
    "Q4_0": T.Q4_0, "Q5_0": T.Q5_0, "Q8_0": T.Q8_0, "Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K, "Q6_K": T.Q6_K,
    "IQ2_S": T.IQ2_XS, "IQ2_M": T.IQ2_S, "IQ3_XXS": T.IQ3_XXS, "IQ3_S": T.IQ3_S, "IQ4_XS": T.IQ4_XS,
}
IQ_LOW = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")


def category(name):
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def allows_quantization(name, n_dims):
    return (n_dims >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix(tensors, ftype, n_expert, n_gqa, n_layer, has_imatrix):
    """tensors: [(name, ne0, n_dims)] in the loader's (sorted-by-name) order -> {name: type}"""
    default = FTYPES[ftype]
    n_attention_wv = sum(1 for n, _, _ in tensors if category(n) in ("attn_v", "attn_qkv", "attn_kv_b"))
    n_ffn_down = n_layer
    i_wv = i_ffn_down = 0
    out = {}
    for name, ne0, nd in sorted(tensors):
        if not allows_quantization(name, nd):
            continue
        cat = category(name)
        t = default
        if cat == "output":
            if ne0 % gguf.GGML_QUANT_SIZES[default][0]:
                t = T.Q8_0
            elif ftype in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
                t = T.Q5_K
            elif default != T.Q8_0:
                t = T.Q6_K
        elif cat == "token_embd":
            if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
                t = T.Q2_K
            elif ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
                t = T.IQ3_S
        elif ftype in IQ_LOW:
            if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
                if n_gqa >= 4 or n_expert >= 4:
                    t = T.Q4_K
                else:
                    t = T.IQ3_S if ftype in ("IQ2_S", "IQ2_M") else T.Q2_K
                i_wv += 1
            elif n_expert == 8 and cat == "attn_k":
                t = T.Q4_K
            elif cat == "ffn_down":
                if i_ffn_down < n_ffn_down // 8:
                    t = T.IQ3_S if ftype in ("IQ2_S", "IQ2_M") else T.Q2_K
                i_ffn_down += 1
            elif cat == "attn_output":
                if n_expert == 8:
                    t = T.Q5_K
                elif ftype in ("IQ1_S", "IQ1_M"):
                    t = T.IQ2_XXS
                elif ftype in ("IQ2_S", "IQ2_M"):
                    t = T.IQ3_S
        elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if ftype == "IQ3_XXS":
                t = T.Q4_K if n_gqa >= 4 else (T.IQ3_S if not has_imatrix else T.IQ3_XXS)
            elif ftype == "IQ3_S" and n_gqa >= 4:
                t = T.Q4_K
            elif ftype == "IQ4_XS" and n_gqa >= 4:
                t = T.Q5_K
            elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_wv, n_attention_wv):
                t = T.Q6_K
            if n_expert == 8:
                t = T.Q8_0
            i_wv += 1
        elif cat == "attn_k":
            if n_expert == 8:
                t = T.Q8_0
            elif ftype == "IQ3_XXS":
                t = T.IQ2_S
        elif cat == "attn_q":
            if ftype == "IQ3_XXS":
                t = T.IQ2_S
        elif cat == "ffn_down":
            m = re.match(r"blk\.(\d+)\.", name)
            i_layer = int(m.group(1)) if (m and n_expert > 1) else i_ffn_down
            n = n_ffn_down
            if ftype == "IQ3_XXS" and not has_imatrix:
                t = T.Q4_K if i_layer < n // 8 else T.Q3_K
            elif ftype == "Q4_K_M":
                if use_more_bits(i_layer, n):
                    t = T.Q6_K
            elif i_layer < n // 8 and ftype == "IQ4_XS" and not has_imatrix:
                t = T.Q5_K
            elif ftype == "Q5_K_M" and use_more_bits(i_layer, n):
                t = T.Q6_K
            elif ftype in ("Q4_0", "Q5_0") and has_imatrix and i_layer < n // 8:
                t = T.Q4_1 if ftype == "Q4_0" else T.Q5_1
            i_ffn_down += 1
        elif cat == "attn_output":
            if n_expert == 8:
                if ftype in ("IQ3_XXS", "Q4_K_M", "IQ3_S", "IQ4_XS"):
                    t = T.Q5_K
            elif ftype == "IQ3_XXS":
                t = T.IQ3_S
        # shape fallback (tensor_type_fallback)
        if ne0 % gguf.GGML_QUANT_SIZES[t][0]:
            fb = {T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL, T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL,
                  T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
            t = fb.get(t, t)
            if ne0 % gguf.GGML_QUANT_SIZES[t][0]:
                t = T.F16
        out[name] = t
    return out


def ggml_name(t):
    """ggml_type_name() spelling, which llama-quantize's --custom-q parser matches: q4_K, iq3_xxs, f16"""
    s = t.name.lower()
    return s[:-2] + "_K" if s.endswith("_k") else s


def main():
    path, ftype = sys.argv[1], sys.argv[2]
    has_imatrix = "--imatrix" in sys.argv[3:]
    r = gguf.GGUFReader(path)

    def kv(key, default=None):
        f = r.fields.get(key)
        return default if f is None else int(f.parts[f.data[0]][0])

    arch = bytes(r.fields["general.architecture"].parts[r.fields["general.architecture"].data[0]]).decode()
    n_expert = kv(f"{arch}.expert_count", 0)
    n_head = kv(f"{arch}.attention.head_count")
    n_head_kv = kv(f"{arch}.attention.head_count_kv", n_head)
    n_layer = kv(f"{arch}.block_count")
    tensors = [(t.name, int(t.shape[0]), len(t.shape)) for t in r.tensors]
    m = mix(tensors, ftype, n_expert, n_head // n_head_kv, n_layer, has_imatrix)
    by_type = {}
    for name, t in m.items():
        by_type.setdefault(ggml_name(t), []).append(re.escape(name))
    print(",".join(f"^({'|'.join(names)})$={t}" for t, names in sorted(by_type.items())))


if __name__ == "__main__":
    main()
