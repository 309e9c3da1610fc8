"""Runs llama.cpp's convert_hf_to_gguf.py on our tiny fixture checkpoints, with the few patches
they need; everything else is the converter's own code:
  python3 convert_hf_to_gguf_fixture.py LLAMA_SRC_DIR [convert_hf_to_gguf.py arguments...]
(with LLAMA_SRC_DIR/gguf-py on PYTHONPATH, or it is added here).

1. Pre-tokenizer: our byte-level BPE tokenizer is custom-trained, so the converter's hash check of
   its output does not recognise it. It uses exactly Qwen2's split regex (and NFC, byte-level), so
   the converter is made to report "qwen2" (tokenizer.ggml.pre = qwen2).
2. transformers 5 writes config.json with rope_theta inside rope_parameters, and Qwen3-MoE's
   expert count as num_local_experts; this converter reads the top-level rope_theta (without it
   the GGUF has no rope.freq_base and llama.cpp falls back to 10000) and num_experts. Both are
   copied to the top level of the hparams the converter reads (the config.json on disk is left
   as transformers wrote it).
3. GLM-4.5's vocab code looks up GLM's own special tokens ([gMASK], <|user|>...), which our
   tokenizer does not have: GLM4_MOE uses the converter's standard GPT-2 BPE vocab path instead.
4. ik_llama.cpp 8337e4cd3's LlamaModel.set_gguf_parameters (used for Mixtral) carries lines from
   Cohere2Moe: it reads hparams["prefix_dense_intermediate_size"] (KeyError) and pops
   num_experts_per_tok so that expert_used_count is never written. Where that bug is present,
   the key is supplied and expert_used_count written.
"""
import inspect, os, sys
from pathlib import Path

src = Path(sys.argv[1]).resolve()
sys.argv = [str(src / "convert_hf_to_gguf.py")] + sys.argv[2:]
sys.path.insert(0, str(src / "gguf-py"))
sys.path.insert(0, str(src))

import gguf  # noqa: E402
import convert_hf_to_gguf as c  # noqa: E402

Model = c.Model if hasattr(c, "Model") else c.ModelBase

# 1
Model.get_vocab_base_pre = lambda self, tokenizer: "qwen2"

# 2
_load_hparams = Model.load_hparams


def _patched_load_hparams(dir_model, *args, **kwargs):
    h = _load_hparams(dir_model, *args, **kwargs)
    rp = h.get("rope_parameters")
    if "rope_theta" not in h and isinstance(rp, dict) and "rope_theta" in rp:
        h["rope_theta"] = rp["rope_theta"]
    if h.get("model_type") == "qwen3_moe" and "num_experts" not in h and "num_local_experts" in h:
        h["num_experts"] = h.pop("num_local_experts")
    return h


Model.load_hparams = staticmethod(_patched_load_hparams)

# 3
if hasattr(c, "Glm4MoeModel"):
    c.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()

# 4
_llama_sgp = c.LlamaModel.set_gguf_parameters
if "prefix_dense_intermediate_size" in inspect.getsource(_llama_sgp):
    def _fixed_llama_sgp(self):
        self.hparams.setdefault("prefix_dense_intermediate_size", self.hparams.get("intermediate_size"))
        _llama_sgp(self)
        key = gguf.Keys.LLM.EXPERT_USED_COUNT.format(arch=self.gguf_writer.arch)
        if "num_experts_per_tok" in self.hparams and not any(key in kv for kv in self.gguf_writer.kv_data):
            self.gguf_writer.add_expert_used_count(self.hparams["num_experts_per_tok"])
    c.LlamaModel.set_gguf_parameters = _fixed_llama_sgp
    print("convert_hf_to_gguf_fixture: patched LlamaModel.set_gguf_parameters (Cohere2Moe lines)", file=sys.stderr)

sys.exit(c.main())
