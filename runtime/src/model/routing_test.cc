#include "moe/runtime/routing.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "moe/experts/expert_pool.h"

namespace moe::runtime {
namespace {

TEST(RoutingTest, SoftmaxTopKWithoutRenormalisation) {
  RoutingSpec spec;
  spec.num_experts = 4;
  spec.top_k = 2;
  const float logits[] = {0, 1, 2, 3};
  int32_t ids[2];
  float w[2];
  RouteTokens(spec, logits, 1, nullptr, ids, w);
  const double sum = 1 + std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_EQ(ids[0], 3);
  EXPECT_EQ(ids[1], 2);
  EXPECT_NEAR(w[0], std::exp(3.0) / sum, 1e-6);
  EXPECT_NEAR(w[1], std::exp(2.0) / sum, 1e-6);
}

TEST(RoutingTest, SoftmaxTopKRenormalised) {
  RoutingSpec spec;
  spec.num_experts = 4;
  spec.top_k = 2;
  spec.normalize_top_k = true;
  const float logits[] = {3, 0, 2, 1, /* second token */ -1, 5, 0, 4};
  int32_t ids[4];
  float w[4];
  RouteTokens(spec, logits, 2, nullptr, ids, w);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 2);
  EXPECT_NEAR(w[0], 1 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(w[0] + w[1], 1.0, 1e-6);
  EXPECT_EQ(ids[2], 1);
  EXPECT_EQ(ids[3], 3);
}

RoutingSpec GroupedSigmoid() {
  RoutingSpec spec;
  spec.scoring = ScoringFunction::kSigmoid;
  spec.num_experts = 8;
  spec.top_k = 2;
  spec.n_group = 4;
  spec.topk_group = 2;
  spec.normalize_top_k = true;
  spec.has_correction_bias = true;
  spec.routed_scaling_factor = 2.5f;
  return spec;
}

TEST(RoutingTest, SigmoidPicksWithCorrectionBiasInsideTheBestGroups) {
  const RoutingSpec spec = GroupedSigmoid();
  const float logits[] = {0, 0, 1, 0, 0, 0, -1, 0};
  const float bias[] = {0.0f, 0.1f, 0.3f, 0.0f, -0.2f, 0.05f, 0.2f, 0.19f};
  // Biased scores: group sums {1.1, 1.531, 0.85, 1.159}: groups 1 and 3 are kept. Expert 1 (0.6)
  // would beat expert 7 (0.69)? No, but it sits in a dropped group either way.
  int32_t ids[2];
  float w[2];
  RouteTokens(spec, logits, 1, bias, ids, w);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 7);
  // Weights are the unbiased sigmoid scores, renormalised, then scaled.
  const double s2 = 1 / (1 + std::exp(-1.0)), s7 = 0.5;
  EXPECT_NEAR(w[0], 2.5 * s2 / (s2 + s7), 1e-5);
  EXPECT_NEAR(w[1], 2.5 * s7 / (s2 + s7), 1e-5);
}

TEST(RoutingTest, SigmoidDroppedGroupsScoreZeroAsInTransformers) {
  // Every biased score is negative; experts of the dropped group are masked to 0 (not -inf),
  // so they win the final top-k, exactly as transformers' masked_fill(..., 0.0) does.
  RoutingSpec spec = GroupedSigmoid();
  spec.num_experts = 4;
  spec.n_group = 2;
  spec.topk_group = 1;
  spec.normalize_top_k = false;
  spec.routed_scaling_factor = 1.0f;
  const float logits[] = {0, 0, 0, 0};
  const float bias[] = {-1.0f, -1.0f, -0.9f, -2.0f};
  int32_t ids[2];
  float w[2];
  RouteTokens(spec, logits, 1, bias, ids, w);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 3);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
}

TEST(RoutingTest, SigmoidWithoutGroupsIsPlainBiasedTopK) {
  RoutingSpec spec = GroupedSigmoid();
  spec.n_group = 1;
  spec.topk_group = 1;
  const float logits[] = {2, 0, 0, 0, 0, 0, 0, 1};
  const float bias[] = {0, 0, 0, 0, 0, 0, 0.9f, 0};
  int32_t ids[2];
  float w[2];
  RouteTokens(spec, logits, 1, bias, ids, w);
  EXPECT_EQ(ids[0], 6);  // 0.5 + 0.9 beats sigmoid(2) = 0.88
  EXPECT_EQ(ids[1], 0);
}

// Expert deferral: the n lowest-weighted real picks go later; fillers (weight 0) and skipped
// slots stay; ties go to the later slot; each side skips the other's slots.
TEST(RoutingTest, DeferredPicksAreTheLowestWeighted) {
  constexpr int32_t kSkip = experts::kSkippedSlot;
  const int32_t ids[] = {5, 2, 9, 4, 7, kSkip};
  const float w[] = {0.4f, 0.1f, 0.0f, 0.2f, 0.1f, 0.0f};
  int32_t now[6], later[6];
  float now_w[6], later_w[6];
  SplitDeferredPicks(ids, w, 6, 2, now, now_w, later, later_w);
  EXPECT_EQ(std::vector<int32_t>(now, now + 6), (std::vector<int32_t>{5, kSkip, 9, 4, kSkip, kSkip}));
  EXPECT_EQ(std::vector<float>(now_w, now_w + 6), (std::vector<float>{0.4f, 0.0f, 0.0f, 0.2f, 0.0f, 0.0f}));
  EXPECT_EQ(std::vector<int32_t>(later, later + 6), (std::vector<int32_t>{kSkip, 2, kSkip, kSkip, 7, kSkip}));
  EXPECT_EQ(std::vector<float>(later_w, later_w + 6), (std::vector<float>{0.0f, 0.1f, 0.0f, 0.0f, 0.1f, 0.0f}));
  // One tie: the later slot goes first.
  SplitDeferredPicks(ids, w, 6, 1, now, now_w, later, later_w);
  EXPECT_EQ(std::vector<int32_t>(later, later + 6), (std::vector<int32_t>{kSkip, kSkip, kSkip, kSkip, 7, kSkip}));
  // Asking for more than the row's real picks defers every one of them and nothing else.
  SplitDeferredPicks(ids, w, 6, 5, now, now_w, later, later_w);
  EXPECT_EQ(std::vector<int32_t>(now, now + 6), (std::vector<int32_t>{kSkip, kSkip, 9, kSkip, kSkip, kSkip}));
  EXPECT_EQ(std::vector<int32_t>(later, later + 6), (std::vector<int32_t>{5, 2, kSkip, 4, 7, kSkip}));
}

}  // namespace
}  // namespace moe::runtime
