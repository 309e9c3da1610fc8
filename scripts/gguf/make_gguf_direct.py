"""INTERIM fixtures, for when no machine with torch/transformers is at hand: writes the four tiny
MoE models straight to F32 GGUF files with llama.cpp's own gguf-py (random weights, every value
bf16-representable, same shapes, init and metadata as make_fixtures.py + convert_hf_to_gguf.py
would give), for llama.cpp's quantizer and logits to work on. There is no HF checkpoint and no
transformers golden: the reference is llama.cpp's own logits on the F32 file.
  python3 make_gguf_direct.py OUTDIR [--tokenizer tokenizer.json] [--tokenizer-config tokenizer_config.json]
(gguf-py and numpy importable). Writes OUTDIR/<arch>/<arch>-F32.gguf.
"""
import argparse, json, os, sys

import numpy as np
import gguf

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]
H, L, NH, NKV, HD, E, K, FF = 256, 2, 4, 2, 64, 4, 2, 256


def bf16_round(a):
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default=os.path.join(here, "../../testdata/tokenizer/tokenizer.json"))
    ap.add_argument("--tokenizer-config", default=os.path.join(here, "../../testdata/tokenizer/tokenizer_config.json"))
    ap.add_argument("--seed", type=int, default=100)
    a = ap.parse_args()

    tj = json.load(open(a.tokenizer, encoding="utf-8"))
    tc = json.load(open(a.tokenizer_config, encoding="utf-8"))
    vocab = dict(tj["model"]["vocab"])
    added = {t["content"]: t["id"] for t in tj["added_tokens"]}
    vocab.update(added)
    V = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(V)]
    types = [gguf.TokenType.UNUSED] * V
    for t, i in vocab.items():
        tokens[i] = t
        types[i] = gguf.TokenType.NORMAL
    for t, i in added.items():
        types[i] = gguf.TokenType.CONTROL  # all three are special (<|...|>)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]

    for ai, arch in enumerate(ARCHS):
        rng = np.random.default_rng(a.seed + ai)

        def mat(*shape):  # [out, in] (numpy order; ggml ne is reversed)
            return bf16_round(rng.standard_normal(shape) / np.sqrt(shape[-1]))

        def norm(n):
            return bf16_round(1.0 + 0.2 * rng.standard_normal(n))

        def bias(n):
            return bf16_round(0.1 * rng.standard_normal(n))

        gname = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "glm4_moe": "glm4moe"}[arch]
        d = os.path.join(a.out, arch)
        os.makedirs(d, exist_ok=True)
        w = gguf.GGUFWriter(os.path.join(d, f"{arch}-F32.gguf"), gname)
        w.add_name(f"moeserve fixture {arch} (interim, direct)")
        w.add_block_count(L)
        w.add_context_length(2048)
        w.add_embedding_length(H)
        w.add_feed_forward_length({"mixtral": FF}.get(arch, 512))
        w.add_head_count(NH)
        w.add_head_count_kv(NKV)
        w.add_rope_freq_base(1000000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_expert_count(E)
        w.add_expert_used_count(K)
        w.add_key_length(HD)
        w.add_value_length(HD)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        if arch in ("qwen3_moe", "qwen2_moe"):
            w.add_expert_feed_forward_length(FF)
        if arch == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(FF)
        if arch == "mixtral":
            w.add_vocab_size(V)
            w.add_rope_dimension_count(HD)
        if arch == "glm4_moe":
            w.add_rope_dimension_count(HD // 2)
            w.add_expert_feed_forward_length(FF)
            w.add_expert_shared_count(1)
            w.add_leading_dense_block_count(1)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            w.add_expert_weights_scale(2.5)
            w.add_expert_weights_norm(True)
            w.add_nextn_predict_layers(0)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(added[tc["eos_token"]])
        w.add_pad_token_id(added[tc["pad_token"]])
        w.add_add_bos_token(bool(tc.get("add_bos_token", False)))
        w.add_chat_template(tc["chat_template"])

        w.add_tensor("token_embd.weight", mat(V, H))
        for i in range(L):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", norm(H))
            w.add_tensor(p + "attn_q.weight", mat(NH * HD, H))
            w.add_tensor(p + "attn_k.weight", mat(NKV * HD, H))
            w.add_tensor(p + "attn_v.weight", mat(NKV * HD, H))
            if arch in ("qwen2_moe", "glm4_moe"):
                w.add_tensor(p + "attn_q.bias", bias(NH * HD))
                w.add_tensor(p + "attn_k.bias", bias(NKV * HD))
                w.add_tensor(p + "attn_v.bias", bias(NKV * HD))
            w.add_tensor(p + "attn_output.weight", mat(H, NH * HD))
            if arch == "qwen3_moe":
                w.add_tensor(p + "attn_q_norm.weight", norm(HD))
                w.add_tensor(p + "attn_k_norm.weight", norm(HD))
            w.add_tensor(p + ("post_attention_norm.weight" if arch == "glm4_moe" else "ffn_norm.weight"), norm(H))
            if arch == "glm4_moe" and i == 0:  # the leading dense layer
                w.add_tensor(p + "ffn_gate.weight", mat(512, H))
                w.add_tensor(p + "ffn_up.weight", mat(512, H))
                w.add_tensor(p + "ffn_down.weight", mat(H, 512))
                continue
            w.add_tensor(p + "ffn_gate_inp.weight", mat(E, H))
            if arch == "glm4_moe":
                w.add_tensor(p + "exp_probs_b.bias", bias(E))
            w.add_tensor(p + "ffn_gate_exps.weight", mat(E, FF, H))
            w.add_tensor(p + "ffn_up_exps.weight", mat(E, FF, H))
            w.add_tensor(p + "ffn_down_exps.weight", mat(E, H, FF))
            if arch == "qwen2_moe":
                w.add_tensor(p + "ffn_gate_inp_shexp.weight", bf16_round(rng.standard_normal(H) / np.sqrt(H)))
            if arch in ("qwen2_moe", "glm4_moe"):
                w.add_tensor(p + "ffn_gate_shexp.weight", mat(FF, H))
                w.add_tensor(p + "ffn_up_shexp.weight", mat(FF, H))
                w.add_tensor(p + "ffn_down_shexp.weight", mat(H, FF))
        w.add_tensor("output_norm.weight", norm(H))
        w.add_tensor("output.weight", mat(V, H))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        print(f"{arch}: {os.path.join(d, f'{arch}-F32.gguf')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
