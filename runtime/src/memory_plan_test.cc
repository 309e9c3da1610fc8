// Memory plans from a model's config and placement, without loading anything.
#include "moe/runtime/memory_plan.h"

#include <iostream>
#include <string>

#include "gtest/gtest.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_spec.h"

namespace moe::runtime {
namespace {

// The qwen3-30b-a3b shape at 16 layers: 128 experts of 768, top-8, hidden 2048, 4 KV heads of 128.
ModelSpec Qwen3Shape() {
  auto spec = ParseModelSpec(R"({
    "model_type": "qwen3_moe", "vocab_size": 32768, "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "norm_topk_prob": true, "tie_word_embeddings": false})",
                             "test");
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// One routed expert matrix per (layer, expert) is enough to weigh the experts: 3 x 2048 x 768.
Placement ExpertsOn(const ModelSpec& spec, Device::Kind where) {
  Placement p;
  for (int l = 0; l < spec.num_layers; ++l) {
    for (int e = 0; e < spec.routing.num_experts; ++e) {
      TensorPlace t;
      t.name = "model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".fused";
      t.kind = ClassifyTensor("model.layers.0.mlp.experts.0.up_proj.weight");
      t.elements = 3 * 2048 * 768;
      t.bytes = t.elements * 2;
      t.device = Device{where, 0};
      p.tensors.push_back(t);
    }
  }
  return p;
}

constexpr int64_t kGiB = int64_t{1} << 30;

TEST(MemoryPlanTest, CountsTheKvCacheTheArenaAndTheWeights) {
  const ModelSpec spec = Qwen3Shape();
  MemoryPlanOptions o;
  o.context = 4096;
  o.max_seqs = 8;
  o.gpu_free_bytes = 80 * kGiB;
  auto plan = PlanMemory(spec, ExpertsOn(spec, Device::Kind::kCuda), o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // 16 layers x K and V x 4 heads x 128 x 2 bytes.
  EXPECT_EQ(plan->kv_bytes_per_token, 16 * 2 * 4 * 128 * 2);
  int64_t kv = 0, experts = 0, arena = 0;
  for (const MemoryLine& line : plan->gpu.lines) {
    if (line.what.rfind("KV cache", 0) == 0) kv = line.bytes;
    if (line.what == "weights: routed expert") experts = line.bytes;
    if (line.what.rfind("step activations", 0) == 0) arena = line.bytes;
  }
  EXPECT_EQ(kv, (8 * (4096 / 16) + 1) * 16 * plan->kv_bytes_per_token);
  EXPECT_EQ(experts, int64_t{16} * 128 * 3 * 2048 * 768 * 2);
  EXPECT_EQ(arena, Model::StepArenaBytes(spec, core::DType::kBF16, 2048, 256, 4096).total);
  EXPECT_TRUE(plan->gpu.fits());
  EXPECT_TRUE(plan->refusal.empty());
}

TEST(MemoryPlanTest, ALongContextThatDoesNotFitIsRefusedWithTheLongestThatDoes) {
  const ModelSpec spec = Qwen3Shape();
  MemoryPlanOptions o;
  o.context = 262144;
  o.max_seqs = 4;
  o.gpu_free_bytes = 24 * kGiB;  // the experts (19.3 GB) alone nearly fill it
  auto on_gpu = PlanMemory(spec, ExpertsOn(spec, Device::Kind::kCuda), o);
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  EXPECT_FALSE(on_gpu->gpu.fits());
  EXPECT_NE(on_gpu->refusal.find("largest context that fits is"), std::string::npos) << on_gpu->refusal;

  // With the experts in host memory the same GPU holds a longer context, and the plan says how
  // long: that context must itself fit, and 16 positions more must not.
  auto hybrid = PlanMemory(spec, ExpertsOn(spec, Device::Kind::kCpu), o);
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  EXPECT_GT(hybrid->host.total, int64_t{16} * 128 * 3 * 2048 * 768 * 2 - 1);
  ASSERT_FALSE(hybrid->gpu.fits()) << "262144 x 4 positions of KV are 16 GiB";
  const std::string& why = hybrid->refusal;
  std::cout << "refused: " << why << "\n";
  const size_t at = why.find("fits is ");
  ASSERT_NE(at, std::string::npos) << why;
  std::string digits;
  for (char ch : why.substr(at + 8)) {
    if (ch == ',') continue;
    if (ch < '0' || ch > '9') break;
    digits += ch;
  }
  const int64_t longest = std::stoll(digits);
  EXPECT_EQ(longest % 16, 0);
  MemoryPlanOptions fit = o;
  fit.context = longest;
  auto at_longest = PlanMemory(spec, ExpertsOn(spec, Device::Kind::kCpu), fit);
  ASSERT_TRUE(at_longest.ok());
  EXPECT_TRUE(at_longest->gpu.fits()) << at_longest->refusal;
  fit.context = longest + 16;
  auto over = PlanMemory(spec, ExpertsOn(spec, Device::Kind::kCpu), fit);
  ASSERT_TRUE(over.ok());
  EXPECT_FALSE(over->gpu.fits());
  EXPECT_NE(why.find("sequences at 262,144 (--max-seqs)"), std::string::npos) << why;
}

TEST(MemoryPlanTest, WeightsAloneTooLargeSayWhatToMove) {
  const ModelSpec spec = Qwen3Shape();
  MemoryPlanOptions o;
  o.context = 4096;
  o.gpu_free_bytes = 8 * kGiB;
  auto plan = PlanMemory(spec, ExpertsOn(spec, Device::Kind::kCuda), o);
  ASSERT_TRUE(plan.ok());
  EXPECT_NE(plan->refusal.find("--cpu-moe"), std::string::npos) << plan->refusal;
}

TEST(MemoryPlanTest, BadSizesAreErrors) {
  const ModelSpec spec = Qwen3Shape();
  MemoryPlanOptions o;
  o.context = 300000;
  auto above = PlanMemory(spec, Placement{}, o);
  ASSERT_FALSE(above.ok());
  EXPECT_NE(above.status().message().find("max_position_embeddings (262144)"), std::string::npos) << above.status();
  o.context = 1024;
  o.max_seqs = 0;
  EXPECT_FALSE(PlanMemory(spec, Placement{}, o).ok());
}

}  // namespace
}  // namespace moe::runtime
