// Routing profiles: written and read back, the most used experts, and what a wrong file says.
#include "moe/runtime/routing_profile.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "moe/runtime/model_spec.h"

namespace moe::runtime {
namespace {

ModelSpec Spec() {
  auto spec = ParseModelSpec(R"({
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "intermediate_size": 256,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": true})",
                             "test");
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

std::string TempFile(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "." + std::to_string(::getpid()))).string();
}

TEST(RoutingProfileTest, RoundTripsAndRanksTheExperts) {
  const ModelSpec spec = Spec();
  RoutingProfile p = RoutingProfile::For(spec);
  ASSERT_EQ(p.counts.size(), 3u);
  p.tokens = 10;
  p.counts[1] = {5, 0, 9, 9, 1, 0, 0, 2};
  const std::string path = TempFile("profile");
  ASSERT_TRUE(SaveRoutingProfile(path, p).ok());
  auto back = LoadRoutingProfile(path, spec);
  std::filesystem::remove(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tokens, 10);
  EXPECT_EQ(back->counts, p.counts);
  EXPECT_EQ(MostUsedExperts(*back, 1, 3), (std::vector<int>{2, 3, 0}));  // ties: the lower id first
  EXPECT_DOUBLE_EQ(ShareOfPicks(*back, 1, {2, 3}), 18.0 / 26.0);
  EXPECT_TRUE(MostUsedExperts(*back, 7, 3).empty());
  // Layers 0 and 2 have no picks (share 0); layer 1's top two take 18 of 26.
  EXPECT_DOUBLE_EQ(MeanShareOfMostUsed(*back, {1}, 2), 18.0 / 26.0);
  EXPECT_DOUBLE_EQ(MeanShareOfMostUsed(*back, {}, 2), 18.0 / 26.0 / 3);
}

TEST(RoutingProfileTest, AWrongFileSaysWhatAndWhere) {
  const ModelSpec spec = Spec();
  const std::string path = TempFile("bad-profile");
  auto load_with = [&](const std::string& text) {
    std::ofstream(path) << text;
    return LoadRoutingProfile(path, spec).status();
  };
  EXPECT_EQ(LoadRoutingProfile(path + ".absent", spec).status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(load_with("{").message().find("not a JSON object"), std::string::npos);
  const std::string head = R"({"format": "moeserve routing profile", "model_type": "qwen3_moe", "num_layers": 3,
    "num_experts": 8, "top_k": 2, "tokens": 1, "layers": [)";
  const std::string full = R"({"layer": 0, "counts": [1,0,0,0,0,0,0,0]}, {"layer": 1, "counts": [1,0,0,0,0,0,0,0]})";
  absl::Status missing = load_with(head + full + "]}");
  EXPECT_NE(missing.message().find("no counts for MoE layer 2"), std::string::npos) << missing;
  absl::Status short_counts = load_with(head + full + R"(, {"layer": 2, "counts": [1, 2]}]})");
  EXPECT_NE(short_counts.message().find("layer 2 has 2 counts for 8 experts"), std::string::npos) << short_counts;
  absl::Status other = load_with(R"({"format": "moeserve routing profile", "model_type": "mixtral", "num_layers": 32,
    "num_experts": 8, "top_k": 2, "tokens": 1, "layers": []})");
  EXPECT_NE(other.message().find("made for a mixtral of 32 layers"), std::string::npos) << other;
  EXPECT_NE(other.message().find(path), std::string::npos) << other;
  std::filesystem::remove(path);
}

// Held experts chosen while serving: the best newcomers replace the weakest holders, only by a
// clear margin.
TEST(RoutingProfileTest, HeldExpertSwapsMoveTowardTheTopByAMargin) {
  const std::vector<double> scores = {1, 50, 9, 30, 0, 12, 40, 10};
  // Held 0, 2, 4; the top three are 1, 6, 3: 1 replaces 4 (the weakest), 6 replaces 0, 3 replaces 2.
  EXPECT_EQ(PlanHeldExpertSwaps(scores, {0, 2, 4}, 1.25), (std::vector<std::pair<int, int>>{{4, 1}, {0, 6}, {2, 3}}));
  // Held 1, 6, 5: the top three are 1, 6, 3; 3 (30) beats 5 (12) by more than 1.25x.
  EXPECT_EQ(PlanHeldExpertSwaps(scores, {1, 6, 5}, 1.25), (std::vector<std::pair<int, int>>{{5, 3}}));
  // Held 1, 6, 7 with a margin of 4: 3 (30) is not 4x 7 (10): nothing moves.
  EXPECT_TRUE(PlanHeldExpertSwaps(scores, {1, 6, 7}, 4.0).empty());
  // Already the top: nothing moves.
  EXPECT_TRUE(PlanHeldExpertSwaps(scores, {3, 1, 6}, 1.0).empty());
  // A few picks are noise: 3 against 0 is not two standard deviations (3^2 < 4 x 3).
  EXPECT_TRUE(PlanHeldExpertSwaps({3, 0}, {1}, 1.25).empty());
  EXPECT_EQ(PlanHeldExpertSwaps({5, 0}, {1}, 1.25), (std::vector<std::pair<int, int>>{{1, 0}}));
  // No counts at all: nothing moves either.
  EXPECT_TRUE(PlanHeldExpertSwaps(std::vector<double>(8, 0.0), {0, 1}, 1.25).empty());
}

}  // namespace
}  // namespace moe::runtime
