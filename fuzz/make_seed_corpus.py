#!/usr/bin/env python3
"""Writes the seed corpus under fuzz/corpus/: the fixtures' config.json files and edited copies,
small safetensors files and shard indexes (valid and broken), and serialized GenerateRequests.

Run from the repository root after a build (the GenerateRequest seeds need the Python stubs):
    PYTHONPATH=build/python /usr/bin/python3 fuzz/make_seed_corpus.py
The files are committed; rerun this only to change them.
"""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def model_configs():
    fixtures = os.path.join(ROOT, "testdata", "fixtures")
    configs = {}
    for arch in sorted(os.listdir(fixtures)):
        with open(os.path.join(fixtures, arch, "config.json")) as f:
            text = f.read()
        write("model_config", f"{arch}.json", text)
        configs[arch] = json.loads(text)

    def edited(name, base, **changes):
        c = dict(configs[base])
        for k, v in changes.items():
            if v is None:
                c.pop(k, None)
            else:
                c[k] = v
        write("model_config", name, json.dumps(c, indent=1))

    edited("missing_model_type.json", "qwen3_moe", model_type=None)
    edited("unsupported_model_type.json", "qwen3_moe", model_type="deepseek_v3")
    edited("hidden_size_string.json", "qwen3_moe", hidden_size="128")
    edited("kv_heads_do_not_group.json", "qwen3_moe", num_key_value_heads=3)
    edited("odd_head_dim.json", "mixtral", head_dim=33)
    edited("top_k_above_experts.json", "mixtral", num_experts_per_tok=99)
    edited("no_head_dim.json", "qwen2_moe", head_dim=None)
    edited("mlp_only_layers.json", "qwen3_moe", mlp_only_layers=[0, 2], decoder_sparse_step=2)
    edited("eos_list.json", "qwen3_moe", eos_token_id=[1, 2, 511])
    edited("glm_groups.json", "glm4_moe", n_group=4, topk_group=2, n_shared_experts=2)
    edited("glm_partial_rotary.json", "glm4_moe", partial_rotary_factor=0.25)
    edited("rope_scaling.json", "qwen2_moe", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    edited("large_values.json", "qwen3_moe", num_hidden_layers=2147483647, vocab_size=4294967296)
    write("model_config", "empty_object.json", "{}")
    write("model_config", "not_json.json", '{"model_type": "qwen3_moe", ')
    write("model_config", "array.json", "[1, 2, 3]")


def safetensors(tensors, metadata=None, tail=b"", header_len=None):
    """tensors: [(name, dtype, shape, bytes)] laid out back to back."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    n = len(text) if header_len is None else header_len
    return struct.pack("<Q", n) + text + data + tail


def raw_safetensors(header, data=b""):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
    t = "safetensors_header"
    write(t, "one_f32.safetensors", safetensors([("w", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4))]))
    write(t, "every_dtype.safetensors", safetensors([
        ("a.bf16", "BF16", [3], bytes(6)), ("b.f16", "F16", [2, 1], bytes(4)), ("c.f32", "F32", [1], bytes(4)),
        ("d.i8", "I8", [5], bytes(range(5))), ("e.i32", "I32", [2], bytes(8)), ("f.i64", "I64", [1], bytes(8))],
        metadata={"format": "pt"}))
    write(t, "scalar_and_empty.safetensors", safetensors([("s", "F32", [], bytes(4)), ("z", "BF16", [0, 4], b"")]))
    write(t, "header_only.safetensors", safetensors([]))
    write(t, "too_short.safetensors", b"\x10\x00\x00")
    write(t, "header_past_end.safetensors", safetensors([("w", "F32", [1], bytes(4))], header_len=4096))
    write(t, "huge_header_len.safetensors", struct.pack("<Q", 2**63 + 5) + b"{}")
    write(t, "truncated_data.safetensors", safetensors([("w", "F32", [4, 4], bytes(64))])[:-20])
    write(t, "offsets_mismatch.safetensors",
          raw_safetensors({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, bytes(16)))
    write(t, "offsets_reversed.safetensors",
          raw_safetensors({"w": {"dtype": "I8", "shape": [4], "data_offsets": [8, 4]}}, bytes(16)))
    write(t, "offsets_past_end.safetensors",
          raw_safetensors({"w": {"dtype": "I8", "shape": [4], "data_offsets": [100, 104]}}, bytes(16)))
    write(t, "unknown_dtype.safetensors",
          raw_safetensors({"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, bytes(4)))
    write(t, "negative_shape.safetensors",
          raw_safetensors({"w": {"dtype": "I8", "shape": [-4], "data_offsets": [0, 4]}}, bytes(4)))
    write(t, "missing_offsets.safetensors", raw_safetensors({"w": {"dtype": "I8", "shape": [4]}}, bytes(4)))
    write(t, "header_array.safetensors", raw_safetensors([1, 2], bytes(4)))
    write(t, "header_not_json.safetensors", struct.pack("<Q", 6) + b"{\"w\": ")


def index_seeds():
    t = "shard_index"
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    full = {"model.embed_tokens.weight": first, "model.layers.0.input_layernorm.weight": first,
            "model.norm.weight": second, "lm_head.weight": second, "model.layers.0.mlp.gate.weight": second}
    write(t, "both_shards.json", json.dumps({"metadata": {"total_size": 160}, "weight_map": full}, indent=2))
    write(t, "one_shard.json", json.dumps({"weight_map": {"model.norm.weight": second}}))
    write(t, "empty_weight_map.json", json.dumps({"weight_map": {}}))
    write(t, "wrong_shard.json", json.dumps({"weight_map": {"model.norm.weight": first}}))
    write(t, "missing_shard.json", json.dumps({"weight_map": {"model.norm.weight": "model-00003-of-00003.safetensors"}}))
    write(t, "shard_is_directory.json", json.dumps({"weight_map": {"model.norm.weight": "."}}))
    write(t, "shard_outside_dir.json", json.dumps({"weight_map": {"model.norm.weight": "../" + second}}))
    write(t, "file_not_string.json", json.dumps({"weight_map": {"model.norm.weight": 2}}))
    write(t, "no_weight_map.json", json.dumps({"metadata": {"total_size": 0}}))
    write(t, "not_json.json", '{"weight_map": {"lm_head.weight": "model-0000')


def request_seeds():
    sys.path.insert(0, os.path.join(ROOT, "build", "python"))
    from moeserve.v1 import generation_pb2 as pb

    t = "generate_request"

    def req(name, **kw):
        r = pb.GenerateRequest(**kw)
        write(t, name + ".pb", r.SerializeToString())

    stop = pb.StoppingParams
    req("greedy", token_ids=[1, 2, 3, 4], stopping=stop(max_new_tokens=8, ignore_eos=True))
    req("default_length", token_ids=[7])
    req("sampled", request_id="seeded", token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=7,
                                   repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5),
        stopping=stop(max_new_tokens=6, min_new_tokens=2, stop_token_ids=[3, 9]))
    req("logprobs", token_ids=[10, 11], logprobs=5, stopping=stop(max_new_tokens=3))
    req("fills_context", token_ids=list(range(1, 200)), stopping=stop(max_new_tokens=56, ignore_eos=True))
    req("empty_prompt", stopping=stop(max_new_tokens=4))
    req("token_out_of_vocab", token_ids=[1, 512])
    req("negative_token", token_ids=[-1, 2])
    req("past_context", token_ids=[1] * 250, stopping=stop(max_new_tokens=100))
    req("negative_max_new_tokens", token_ids=[1, 2], stopping=stop(max_new_tokens=-5))
    req("min_above_max", token_ids=[1, 2], stopping=stop(max_new_tokens=2, min_new_tokens=9))
    req("bad_top_p", token_ids=[1], sampling=pb.SamplingParams(top_p=0.0))
    req("nan_temperature", token_ids=[1], sampling=pb.SamplingParams(temperature=float("nan")))
    req("too_many_logprobs", token_ids=[1], logprobs=21)
    req("text_prompt", text="hello")
    req("chat_prompt", messages=[pb.ChatMessage(role="user", content="hi")])
    write(t, "not_a_request.bin", b"\xff\xff\xff\xff\x0f")


def gguf(kv, tensors, version=3, alignment=32):
    """A GGUF file: kv is [(key, type, packed value bytes)], tensors [(name, ne, ggml type, bytes)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for key, t, value in kv:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", t) + value
    offset, infos, blob = 0, b"", b""
    for name, ne, t, data in tensors:
        infos += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(ne))
        infos += b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", t, offset)
        pad = (-len(data)) % alignment
        blob += data + b"\0" * pad
        offset += len(data) + pad
    out += infos
    out += b"\0" * ((-len(out)) % alignment)
    return out + blob


def gguf_seeds():
    def s(v):
        return struct.pack("<Q", len(v.encode())) + v.encode()

    def u32(v):
        return struct.pack("<I", v)

    def f32(v):
        return struct.pack("<f", v)

    def strings(values):
        return u32(8) + struct.pack("<Q", len(values)) + b"".join(s(v) for v in values)

    def i32s(values):
        return u32(5) + struct.pack("<Q", len(values)) + b"".join(struct.pack("<i", v) for v in values)

    a = "qwen3moe"
    h, ff, experts, vocab, heads, kv_heads, hd = 8, 8, 2, 6, 2, 1, 4
    kv = [("general.architecture", 8, s(a)), (a + ".block_count", 4, u32(1)), (a + ".context_length", 4, u32(64)),
          (a + ".embedding_length", 4, u32(h)), (a + ".feed_forward_length", 4, u32(ff)),
          (a + ".attention.head_count", 4, u32(heads)), (a + ".attention.head_count_kv", 4, u32(kv_heads)),
          (a + ".attention.key_length", 4, u32(hd)), (a + ".rope.freq_base", 6, f32(10000.0)),
          (a + ".rope.dimension_count", 4, u32(hd)), (a + ".attention.layer_norm_rms_epsilon", 6, f32(1e-6)),
          (a + ".expert_count", 4, u32(experts)), (a + ".expert_used_count", 4, u32(1)),
          (a + ".expert_feed_forward_length", 4, u32(ff)),
          ("tokenizer.ggml.model", 8, s("gpt2")), ("tokenizer.ggml.pre", 8, s("qwen2")),
          ("tokenizer.ggml.tokens", 9, strings(["a", "b", "ab", "\u0120", "<|im_end|>", "c"])),
          ("tokenizer.ggml.token_type", 9, i32s([1, 1, 1, 1, 3, 1])),
          ("tokenizer.ggml.merges", 9, strings(["a b"])), ("tokenizer.ggml.eos_token_id", 4, u32(4)),
          ("tokenizer.chat_template", 8, s("{{ messages }}"))]

    def f32s(*ne):
        n = 1
        for d in ne:
            n *= d
        return ("", list(ne), 0, b"".join(f32(0.01 * (i % 7)) for i in range(n)))

    def t(name, *ne):
        x = f32s(*ne)
        return (name, x[1], x[2], x[3])

    tensors = [t("token_embd.weight", h, vocab), t("output_norm.weight", h), t("output.weight", h, vocab),
               t("blk.0.attn_norm.weight", h), t("blk.0.ffn_norm.weight", h),
               t("blk.0.attn_q.weight", h, heads * hd), t("blk.0.attn_k.weight", h, kv_heads * hd),
               t("blk.0.attn_v.weight", h, kv_heads * hd), t("blk.0.attn_output.weight", heads * hd, h),
               t("blk.0.attn_q_norm.weight", hd), t("blk.0.attn_k_norm.weight", hd),
               t("blk.0.ffn_gate_inp.weight", h, experts), t("blk.0.ffn_gate_exps.weight", h, ff, experts),
               t("blk.0.ffn_up_exps.weight", h, ff, experts), t("blk.0.ffn_down_exps.weight", ff, h, experts)]
    write("gguf_header", "qwen3moe-tiny.gguf", gguf(kv, tensors))
    write("gguf_header", "metadata-only.gguf", gguf(kv, []))
    # A Q8_0 tensor (34 bytes per 32 values) and an alignment of 64.
    q8 = [("q.weight", [32, 2], 8, bytes(range(68)))]
    write("gguf_header", "q8_0-aligned64.gguf",
          gguf(kv + [("general.alignment", 4, u32(64))], tensors[:3] + q8, alignment=64))
    # Broken: a cut file, a misaligned offset, a string beyond the file, an unknown value type.
    whole = gguf(kv, tensors)
    write("gguf_header", "truncated.gguf", whole[: len(whole) // 2])
    write("gguf_header", "long-string.gguf", b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 60))
    write("gguf_header", "bad-value-type.gguf", gguf([("k", 13, b"")], []))
    write("gguf_header", "nested-arrays.gguf",
          gguf([("k", 9, u32(9) + struct.pack("<Q", 1) + u32(0) + struct.pack("<Q", 2) + b"\x01\x02")], []))


if __name__ == "__main__":
    model_configs()
    safetensors_seeds()
    index_seeds()
    request_seeds()
    gguf_seeds()
