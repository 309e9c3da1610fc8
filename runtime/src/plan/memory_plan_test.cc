// Memory plans from a model's config and placement, without loading anything.
#include "moe/runtime/memory_plan.h"

#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
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

// The model's tensors (from its config alone), its routed experts on `where`.
Placement ExpertsOn(const ModelSpec& spec, Device::Kind where) {
  PlacementOptions o;
  o.cpu_moe = where == Device::Kind::kCpu;
  auto p = PlaceTensors(spec, ExpectedTensors(spec), o);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

constexpr int64_t kGiB = int64_t{1} << 30;

// The context a refusal names ("... the largest context that fits is 178,144 (--ctx)"), or -1.
int64_t LongestContextIn(const std::string& refusal) {
  const size_t at = refusal.find("fits is ");
  if (at == std::string::npos) return -1;
  std::string digits;
  for (char ch : refusal.substr(at + 8)) {
    if (ch == ',') continue;
    if (ch < '0' || ch > '9') break;
    digits += ch;
  }
  return digits.empty() ? -1 : std::stoll(digits);
}

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
  const int64_t longest = LongestContextIn(why);
  ASSERT_GT(longest, 0) << why;
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

// Real shapes, written here from their config.json, and the figures of each worked out by hand
// below (bf16 matrices, fp32 vectors on the GPU).
struct RealModel {
  std::string name;
  std::string config;
  int64_t experts;       // routed experts, bf16
  int64_t other;         // every other tensor on the GPU
  int64_t kv_per_token;  // K and V of every layer, bf16
  int64_t expert_int8;   // one routed expert in the pool's int8 arena
};

std::vector<RealModel> RealModels() {
  std::vector<RealModel> m;
  {
    // Qwen3-30B-A3B-Instruct-2507: 48 layers, hidden 2048, q 32 x 128, kv 4 x 128, 128 experts of 768.
    const int64_t L = 48, h = 2048, q = 4096, kv = 512, E = 128, I = 768, V = 151936;
    m.push_back({"Qwen3-30B-A3B",
                 R"({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
                    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
                    "norm_topk_prob": true, "tie_word_embeddings": false})",
                 L * E * 3 * h * I * 2,
                 2 * V * h * 2 + h * 4 + L * ((q + 2 * kv) * h * 2 + h * q * 2 + 2 * 128 * 4 + 2 * h * 4 + E * h * 2),
                 L * 2 * kv * 2, (2 * I * h + h * I) + (2 * I + h) * 4});
  }
  {
    // Qwen3-235B-A22B-Instruct-2507: 94 layers, hidden 4096, q 64 x 128, kv 4 x 128, 128 experts of 1536.
    const int64_t L = 94, h = 4096, q = 8192, kv = 512, E = 128, I = 1536, V = 151936;
    m.push_back({"Qwen3-235B-A22B",
                 R"({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 94,
                    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "intermediate_size": 12288,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
                    "norm_topk_prob": true, "tie_word_embeddings": false})",
                 L * E * 3 * h * I * 2,
                 2 * V * h * 2 + h * 4 + L * ((q + 2 * kv) * h * 2 + h * q * 2 + 2 * 128 * 4 + 2 * h * 4 + E * h * 2),
                 L * 2 * kv * 2, (2 * I * h + h * I) + (2 * I + h) * 4});
  }
  {
    // GLM-4.5-Air: 46 layers (the first dense, FFN 10944), hidden 4096, q 96 x 128 and kv 8 x 128
    // with biases, 128 experts of 1408 and one shared expert of 1408, a correction bias per expert.
    // (Its checkpoint's next-token-prediction layer 46 is not loaded and not counted.)
    const int64_t L = 46, h = 4096, q = 12288, kv = 1024, E = 128, I = 1408, V = 151552, F = 10944;
    m.push_back({"GLM-4.5-Air",
                 R"({"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "num_hidden_layers": 46,
                    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                    "intermediate_size": 10944, "first_k_dense_replace": 1, "attention_bias": true,
                    "use_qk_norm": false, "partial_rotary_factor": 0.5, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "norm_topk_prob": true, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": false})",
                 (L - 1) * E * 3 * h * I * 2,
                 2 * V * h * 2 + h * 4 + L * ((q + 2 * kv) * h * 2 + h * q * 2 + (q + 2 * kv) * 4 + 2 * h * 4) +
                     3 * h * F * 2 + (L - 1) * (E * h * 2 + E * 4 + 3 * h * I * 2),
                 L * 2 * kv * 2, (2 * I * h + h * I) + (2 * I + h) * 4});
  }
  {
    // Mixtral-8x7B: 32 layers, hidden 4096, q 32 x 128, kv 8 x 128, 8 experts of 14336.
    const int64_t L = 32, h = 4096, q = 4096, kv = 1024, E = 8, I = 14336, V = 32000;
    m.push_back({"Mixtral-8x7B",
                 R"({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                    "num_experts_per_tok": 2, "intermediate_size": 14336, "max_position_embeddings": 32768,
                    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": false})",
                 L * E * 3 * h * I * 2,
                 2 * V * h * 2 + h * 4 + L * ((q + 2 * kv) * h * 2 + h * q * 2 + 2 * h * 4 + E * h * 2), L * 2 * kv * 2,
                 (2 * I * h + h * I) + (2 * I + h) * 4});
  }
  return m;
}

int64_t LineBytes(const DevicePlan& d, const std::string& prefix) {
  int64_t total = 0;
  for (const MemoryLine& line : d.lines) {
    if (line.what.rfind(prefix, 0) == 0) total += line.bytes;
  }
  return total;
}

// MLA caches one latent row a position per layer, whatever the heads: DeepSeek-V3's 61 layers x
// (512 + 64) values, 2 bytes in bf16 = 70,272 bytes a position (a GQA cache of its 128 heads of
// 192 would take 61 x 2 x 128 x 192 x 2 = 5,996,544); fp8 adds a 4-byte scale a row; the CPU
// backend's fp32 cache doubles bf16; a tensor split's ranks each keep the whole latent.
TEST(MemoryPlanTest, MlaKvBytesAreTheLatentRowsWorkedOutByHand) {
  auto spec = ParseModelSpec(R"({"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": true,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}})",
                             "deepseek-v3");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const Range all{0, 61};
  const CachePlan bf16 = PlanCache(*spec, all, CacheOptions{16, core::DType::kBF16});
  ASSERT_EQ(bf16.groups.size(), 1u);
  EXPECT_EQ(bf16.groups[0].kind, CacheKind::kPagedLatent);
  EXPECT_EQ(bf16.BytesPerToken(), 70272);
  EXPECT_EQ(bf16.BlockBytes(), 16 * 70272);
  EXPECT_EQ(PlanCache(*spec, all, CacheOptions{16, core::DType::kF8E4M3}).BytesPerToken(), 61 * (576 + 4));
  EXPECT_EQ(PlanCache(*spec, all, CacheOptions{16, core::DType::kF32}).BytesPerToken(), 140544);
  ModelSpec rank = *spec;  // a rank of a tensor split of 8: 16 query heads, the same latent
  rank.num_heads = rank.num_kv_heads = 16;
  EXPECT_EQ(PlanCache(rank, all, CacheOptions{16, core::DType::kBF16}).BytesPerToken(), 70272);
  EXPECT_EQ(PlanCache(*spec, Range{0, 16}, CacheOptions{16, core::DType::kBF16}).BytesPerToken(), 16 * 576 * 2);

  MemoryPlanOptions o;
  o.context = 32768;
  o.max_seqs = 4;
  o.gpu_free_bytes = 80 * kGiB;
  o.host_format = experts::ExpertFormat::kInt8;
  auto plan = PlanMemory(*spec, ExpertsOn(*spec, Device::Kind::kCpu), o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kv_bytes_per_token, 70272);
  EXPECT_EQ(LineBytes(plan->gpu, "KV cache"), (4 * (32768 / 16) + 1) * 16 * int64_t{70272});
}

// Each real model on a 24 GB and an 80 GB GPU, all on the GPU and with --cpu-moe (int8 experts),
// at a 32768-token context (or the model's) for 4 sequences: the plan's lines are the figures
// above, and it fits exactly when their sum does.
TEST(MemoryPlanTest, RealModelsOnA24And80GbGpuMatchTheFiguresWorkedOutByHand) {
  for (const RealModel& m : RealModels()) {
    auto spec = ParseModelSpec(m.config, m.name);
    ASSERT_TRUE(spec.ok()) << m.name << ": " << spec.status();
    for (const int64_t gib : {24, 80}) {
      for (const bool cpu_moe : {false, true}) {
        MemoryPlanOptions o;
        o.context = std::min(32768, spec->max_position_embeddings);
        o.max_seqs = 4;
        o.gpu_free_bytes = gib * kGiB;
        o.host_format = experts::ExpertFormat::kInt8;
        auto plan = PlanMemory(*spec, ExpertsOn(*spec, cpu_moe ? Device::Kind::kCpu : Device::Kind::kCuda), o);
        ASSERT_TRUE(plan.ok()) << m.name << ": " << plan.status();
        const std::string at = absl::StrCat(m.name, " on ", gib, " GiB", cpu_moe ? " --cpu-moe" : "");
        EXPECT_EQ(plan->kv_bytes_per_token, m.kv_per_token) << at;
        EXPECT_EQ(LineBytes(plan->gpu, "weights: routed expert"), cpu_moe ? 0 : m.experts) << at;
        EXPECT_EQ(LineBytes(plan->gpu, "weights: "), m.other + (cpu_moe ? 0 : m.experts)) << at;
        const int64_t experts_count = m.experts / (3 * spec->hidden_size * spec->moe_intermediate_size * 2);
        EXPECT_EQ(LineBytes(plan->host, "routed experts on the CPU"), cpu_moe ? experts_count * m.expert_int8 : 0)
            << at;
        const int64_t kv = (o.max_seqs * (o.context / 16) + 1) * 16 * m.kv_per_token;
        const int64_t arena = Model::StepArenaBytes(*spec, core::DType::kBF16, 2048, 256, o.context).total;
        // With the experts on the CPU, long prefills stream them: two layers of int8 experts and
        // one of bf16 on the GPU.
        const int64_t e = spec->routing.num_experts;
        const int64_t streaming = cpu_moe ? 2 * e * m.expert_int8 + m.experts / experts_count * e : 0;
        EXPECT_EQ(LineBytes(plan->gpu, "prefill streaming"), streaming) << at;
        const int64_t total = m.other + (cpu_moe ? 0 : m.experts) + kv + arena + kGpuHeadroomBytes + streaming;
        EXPECT_EQ(plan->gpu.total, total) << at;
        EXPECT_EQ(plan->gpu.fits(), total <= gib * kGiB) << at;
        EXPECT_EQ(plan->refusal.empty(), total <= gib * kGiB) << at;
        if (cpu_moe && plan->refusal.find("weights and buffers alone") != std::string::npos) {
          // The experts are on the CPU already: what would fit is dropping the streaming buffers.
          EXPECT_EQ(plan->refusal.find("--cpu-moe or"), std::string::npos) << plan->refusal;
          EXPECT_NE(plan->refusal.find("--prefill-offload-tokens 0 frees the"), std::string::npos) << plan->refusal;
        }
        std::cout << "[ plan ] " << at << ": GPU " << FormatGiB(plan->gpu.total) << " of " << gib << " GiB"
                  << (plan->gpu.fits() ? " fits" : ": " + plan->refusal) << "\n";
      }
    }
  }
}

// The seeds' trap: Qwen3-30B-A3B with --cpu-moe on a 24 GB GPU at its full 262144 context is
// refused, and the longest context it names is what the memory left for the KV cache holds.
TEST(MemoryPlanTest, TheFullContextOnA24GbGpuIsRefusedWithWhatFits) {
  const RealModel m = RealModels()[0];
  auto spec = ParseModelSpec(m.config, m.name);
  ASSERT_TRUE(spec.ok());
  MemoryPlanOptions o;
  o.context = 262144;
  o.max_seqs = 1;
  o.gpu_free_bytes = 24 * kGiB;
  auto plan = PlanMemory(*spec, ExpertsOn(*spec, Device::Kind::kCpu), o);
  ASSERT_TRUE(plan.ok());
  ASSERT_FALSE(plan->gpu.fits());
  // 262144 positions of 98304 bytes are 24 GiB of KV cache on their own.
  EXPECT_NE(plan->refusal.find("ctx 262,144 x 1 sequence needs 24.0 GiB of KV cache"), std::string::npos)
      << plan->refusal;
  const int64_t longest = LongestContextIn(plan->refusal);
  ASSERT_GT(longest, 0) << plan->refusal;
  // By hand: what the GPU has left after the weights, the prefill streaming buffers (three layers
  // of bf16 experts: 128 x 3 x 2048 x 768 x 2 bytes each), the step arena (its block tables sized
  // for that context) and the headroom, in whole 16-position blocks, one of them the cache's scratch.
  const int64_t streaming = 3 * int64_t{128} * 3 * 2048 * 768 * 2;
  const int64_t left = 24 * kGiB - m.other - streaming - kGpuHeadroomBytes -
                       Model::StepArenaBytes(*spec, core::DType::kBF16, 2048, 256, static_cast<int>(longest)).total;
  EXPECT_EQ(longest, (left / (16 * m.kv_per_token) - 1) * 16) << plan->refusal;
  EXPECT_GT(longest, 160000);  // about 15.4 GiB of 96 KiB positions
  std::cout << "[ plan ] " << plan->refusal << "\n";
}

}  // namespace
}  // namespace moe::runtime
