"""Tiny random-weight MoE models in Hugging Face format, at shapes where llama.cpp's K and IQ
quantization types apply (every quantized matrix's input dimension a multiple of 256), with
goldens computed by transformers itself. scripts/gguf/device-make-fixtures.sh then converts them
to GGUF with llama.cpp's own tools.

Run on a machine with torch + transformers + tokenizers (the device machine):
  python3 make_fixtures.py OUTDIR [--tokenizer tokenizer.json] [--archs qwen3_moe,...]

Writes, for each architecture, OUTDIR/hf/<arch>/ (the bf16 checkpoint, input of the converter;
not committed) and OUTDIR/fixtures/<arch>/{config.json, tokenizer.json, tokenizer_config.json,
golden.json}; OUTDIR/fixtures/golden_tokenize.json; OUTDIR/imatrix.txt (text for llama-imatrix);
OUTDIR/prompts.txt (the golden prompts, one per line, token ids).

Follows the fixtures' own generator: the same byte-level BPE tokenizer construction
(by default the already-trained testdata/tokenizer/tokenizer.json is reused, so that ids agree
with moeserve's other fixtures), the same golden.json format and prompts, and the same "every
parameter far from its default" initialisation.
"""
import argparse, json, os, shutil, sys

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, normalizers, Regex

QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TOKENIZE_CASES = [
    "Hello world", "Hello  world\n\nnew paragraph\n", "  leading spaces", "trailing spaces   ",
    "I'm sure they'll say it's fine; we've done it, you'd agree.", "DON'T SHOUT",
    "numbers: 3.14159, 2026-11-29, 1000000", "tabs\tand\r\nwindows lines",
    "混合专家模型在双卡上运行", "雙卡 RTX 5090 跑 Qwen：實測 75 t/s", "emoji 🚀🔥👍🏽 mix",
    "Ünïcödé façade naïve café", "e\u0301 combining (NFC)", "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x**2  # square\n", "", " ", "\n", "a" * 300,
]

PROMPT_TEXTS = ["Hello world", "混合专家模型在双卡上运行",
                "def f(x):\n    return x**2  # square\n" * 2,
                "The quick brown fox jumps over the lazy dog. " * 3]
EXTRA_PROMPTS = [[5]]  # a one-token prompt
MAX_NEW = 16
ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]


def corpus():
    import glob
    for f in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))[:400]:
        try:
            yield open(f, encoding="utf-8", errors="ignore").read()
        except Exception:
            pass
    yield "混合专家模型 在 双卡 上 运行。雙卡 跑 模型，實測 解碼 速度。" * 50
    yield "Ünïcödé façade naïve café — “quotes” … emojis 🚀🔥 and numbers 1234567890." * 50


def train_tokenizer(vocab):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def tokenizer_config():
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "chat_template": CHAT_TEMPLATE, "add_bos_token": False, "model_max_length": 4096}


def common(vocab):
    # hidden 256, head_dim 64 (4 heads, 2 kv heads: o_proj's input is 256 too), 2 layers.
    return dict(vocab_size=vocab, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6,
                tie_word_embeddings=False, initializer_range=0.08, torch_dtype="bfloat16")


def make(arch, vocab, seed):
    torch.manual_seed(seed)
    c = common(vocab)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**c, intermediate_size=512, moe_intermediate_size=256,
              num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**c, intermediate_size=512, moe_intermediate_size=256,
              shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
              norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**c, intermediate_size=256, num_local_experts=4,
              num_experts_per_tok=2, rope_theta=1000000.0, sliding_window=None)
        model = transformers.MixtralForCausalLM(cfg)
    elif arch == "glm4_moe":
        # n_group = topk_group = 1 (as in the real GLM-4.5/4.6 checkpoints): llama.cpp's GLM4_MOE
        # graph has no group-limited routing and the converter writes no expert group count, so a
        # GGUF could not carry n_group > 1 and llama.cpp would disagree with transformers.
        # num_nextn_predict_layers = 0: transformers builds no MTP layer, so there are no such
        # tensors for the converter to write.
        cfg = transformers.Glm4MoeConfig(**c, intermediate_size=512, moe_intermediate_size=256,
              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
              n_group=1, topk_group=1, routed_scaling_factor=2.5,
              first_k_dense_replace=1, norm_topk_prob=True, partial_rotary_factor=0.5,
              attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0, rope_theta=1000000.0)
        model = transformers.Glm4MoeForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Every parameter, biases and norms included, far from its default, so that a wrong or
    # missing term shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    model = model.to(torch.bfloat16)
    return cfg, model


def goldens(model, prompts, max_new):
    m = model.float().eval()
    cases = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = m(x, output_hidden_states=True)
            logits = out.logits[0]
            gen = m.generate(x, max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new,
                             pad_token_id=0, eos_token_id=None)
            new = gen[0, len(ids):].tolist()
            srt = torch.sort(logits[-1], descending=True).values
            cases.append({"prompt_ids": ids,
                          # every position for short prompts, the last 4 for long ones
                          "logits_from_position": max(0, len(ids) - 4) if len(ids) > 40 else 0,
                          "logits": [[round(v, 5) for v in row] for row in
                                     (logits[-4:] if len(ids) > 40 else logits).tolist()],
                          "final_hidden_last": [round(v, 6) for v in out.hidden_states[-1][0, -1].tolist()],
                          "greedy_ids": new,
                          "top1_margin_last": float(srt[0] - srt[1])})
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                        "../../testdata/tokenizer/tokenizer.json"),
                    help="a trained tokenizer.json to reuse; 'train' trains a new one as gen_fixtures.py does")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--seed", type=int, default=100)
    a = ap.parse_args()

    fx = os.path.join(a.out, "fixtures")
    os.makedirs(fx, exist_ok=True)
    tok = train_tokenizer(512) if a.tokenizer == "train" else Tokenizer.from_file(a.tokenizer)
    tok_json = os.path.join(a.out, "tokenizer.json")
    tok.save(tok_json)
    tok_cfg = os.path.join(a.out, "tokenizer_config.json")
    json.dump(tokenizer_config(), open(tok_cfg, "w"), indent=1)
    cases = []
    for s in TOKENIZE_CASES:
        ids = tok.encode(s).ids
        cases.append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    json.dump({"tokenizer": "tokenizer.json", "cases": cases}, open(os.path.join(fx, "golden_tokenize.json"), "w"),
              ensure_ascii=False, indent=1)

    vocab = tok.get_vocab_size()
    prompts = [tok.encode(t).ids for t in PROMPT_TEXTS] + EXTRA_PROMPTS
    with open(os.path.join(a.out, "prompts.txt"), "w") as f:
        for p in prompts:
            f.write(" ".join(map(str, p)) + "\n")
    # Text for llama-imatrix: the prompts and the tokenizer cases, repeated (it needs at least
    # 2 x its context of tokens).
    with open(os.path.join(a.out, "imatrix.txt"), "w", encoding="utf-8") as f:
        for _ in range(12):
            f.write("\n".join(PROMPT_TEXTS + TOKENIZE_CASES) + "\n")

    summary = {"transformers": transformers.__version__, "torch": torch.__version__, "vocab": vocab, "models": {}}
    for i, arch in enumerate(a.archs.split(",")):
        try:
            cfg, model = make(arch, vocab, seed=a.seed + i)
            d = os.path.join(a.out, "hf", arch)
            model.save_pretrained(d, safe_serialization=True)
            shutil.copy(tok_json, d)
            shutil.copy(tok_cfg, d)
            # Goldens as a user gets them: reloaded by from_pretrained in fp32, so RoPE's
            # inv_freq is fp32 (model.to(bfloat16) above had cast it to bf16).
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
            gcases = goldens(reloaded, prompts, MAX_NEW)
            fd = os.path.join(fx, arch)
            os.makedirs(fd, exist_ok=True)
            for fn in ("config.json", "tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(d, fn), fd)
            json.dump({"weights_dtype": "bfloat16", "compute_dtype": "float32", "cases": gcases},
                      open(os.path.join(fd, "golden.json"), "w"))
            summary["models"][arch] = {"params": sum(p.numel() for p in model.parameters()),
                                       "min_margin": min(c["top1_margin_last"] for c in gcases),
                                       "prompt_lengths": [len(p) for p in prompts]}
        except Exception as e:  # keep going; report what failed
            import traceback; traceback.print_exc()
            summary["models"][arch] = {"error": repr(e)}
    json.dump(summary, open(os.path.join(a.out, "SUMMARY.json"), "w"), indent=1)
    print(json.dumps(summary, indent=1))
    return 0 if all("error" not in v for v in summary["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
