#include "model_bench.h"

#include "gtest/gtest.h"
#include "moe/runtime/model_spec.h"

namespace moe::bench {
namespace {

// DeepSeek-V3's decode at batch 1 reads its MLA projections (q LoRA 7168x1536 and 1536 x 128x192,
// the compressed KV 7168x576, kv_b 512 x 128x256, o 128x128 x 7168, their norms), 3 dense layers,
// and in each of 58 MoE layers the router, the shared expert and 8 routed experts, plus the LM
// head: 36,625,603,584 parameters, worked out by hand, 2 bytes each in bf16.
TEST(ModelBenchTest, DecodeReadsOfAnMlaModelCountItsLatentProjections) {
  auto spec = runtime::ParseModelSpec(R"({"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "max_position_embeddings": 163840})",
                                      "deepseek-v3");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const DecodeReads reads = DecodeWeightReads(*spec, 1, 2.0, {}, 0);
  EXPECT_DOUBLE_EQ(reads.backend, 2.0 * 36625603584.0);
  EXPECT_EQ(reads.host, 0);
  // Prefill of 1000 tokens: twice the parameters a token uses, the LM head once, and the expanded
  // attention (keys of 192 and values of 128 for 128 heads) over the causal triangle, per layer.
  const double attention = 61 * 2.0 * 128 * (192 + 128) * 1000.0 * 1001 / 2;
  const double per_token = 36625603584.0 - 129280.0 * 7168 - 7168;  // the decode reads less the head
  EXPECT_NEAR(PrefillFlops(*spec, 1000), 2 * per_token * 1000 + attention + 2.0 * 129280 * 7168, 1e6);
}

}  // namespace
}  // namespace moe::bench
