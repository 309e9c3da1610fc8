#include "moe/runtime/sampler.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe::runtime {
namespace {

using ::testing::HasSubstr;

const std::vector<float> kLogits = {0.5f, 2.0f, -1.0f, 1.9f, 0.0f, 1.0f};

TEST(SamplerTest, GreedyTakesTheArgmaxWithLowestIdOnTies) {
  Sampler s(SamplingParams{});
  EXPECT_EQ(s.Sample(kLogits.data(), 6), 1);
  const std::vector<float> tie = {1.0f, 3.0f, 3.0f};
  EXPECT_EQ(s.Sample(tie.data(), 3), 1);
}

TEST(SamplerTest, SameSeedSameTokens) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  Sampler a(p), b(p);
  std::vector<int32_t> ta, tb;
  for (int i = 0; i < 50; ++i) {
    ta.push_back(a.Sample(kLogits.data(), 6));
    tb.push_back(b.Sample(kLogits.data(), 6));
  }
  EXPECT_EQ(ta, tb);
  p.seed = 43;
  Sampler c(p);
  std::vector<int32_t> tc;
  for (int i = 0; i < 50; ++i) tc.push_back(c.Sample(kLogits.data(), 6));
  EXPECT_NE(ta, tc);
}

TEST(SamplerTest, FiltersThatKeepOneTokenAreGreedy) {
  for (int which = 0; which < 3; ++which) {
    SamplingParams p;
    p.temperature = 5.0f;
    p.seed = which;
    if (which == 0) p.top_k = 1;
    if (which == 1) p.top_p = 0.01f;
    if (which == 2) p.min_p = 1.0f;
    Sampler s(p);
    for (int i = 0; i < 100; ++i) ASSERT_EQ(s.Sample(kLogits.data(), 6), 1) << "filter " << which;
  }
}

TEST(SamplerTest, TopKAndTopPKeepOnlyTheHead) {
  SamplingParams p;
  p.temperature = 10.0f;  // nearly flat
  p.top_k = 2;
  p.seed = 7;
  Sampler s(p);
  for (int i = 0; i < 200; ++i) {
    int32_t t = s.Sample(kLogits.data(), 6);
    ASSERT_TRUE(t == 1 || t == 3) << t;
  }
}

TEST(SamplerTest, FollowsTheSoftmaxDistribution) {
  // p(1) = 3/4, p(0) = 1/4 at temperature 1.
  const std::vector<float> logits = {0.0f, std::log(3.0f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 1;
  Sampler s(p);
  int ones = 0;
  const int n = 4000;
  for (int i = 0; i < n; ++i) ones += s.Sample(logits.data(), 2);
  EXPECT_NEAR(static_cast<double>(ones) / n, 0.75, 0.03);
}

TEST(SamplerTest, PenaltiesFollowTheirDefinitions) {
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  const int32_t prompt[] = {0, 1};
  const int32_t output[] = {2, 2};
  ApplyPenalties(p, prompt, 2, output, 2, logits.data(), 4);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);                         // prompt token, positive: halved
  EXPECT_FLOAT_EQ(logits[1], -2.0f);                        // prompt token, negative: doubled
  EXPECT_FLOAT_EQ(logits[2], 0.25f - 0.5f - 2 * 0.25f);     // output token twice: all three
  EXPECT_FLOAT_EQ(logits[3], 3.0f);                         // never seen
}

TEST(SamplerTest, LogprobsAreALogSoftmaxWithSortedAlternatives) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f};
  const TokenLogprobs lp = ComputeLogprobs(logits.data(), 3, 2, 2);
  const double z = std::log(std::exp(1.0) + std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(lp.logprob, 2.0 - z, 1e-6);
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].first, 1);
  EXPECT_NEAR(lp.top[0].second, 3.0 - z, 1e-6);
  EXPECT_EQ(lp.top[1].first, 2);
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_THAT(p.Validate().message(), HasSubstr("temperature"));
  p = {};
  p.temperature = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(p.Validate().message(), HasSubstr("temperature"));
  p = {};
  p.top_p = 0;
  EXPECT_THAT(p.Validate().message(), HasSubstr("top_p"));
  p = {};
  p.top_p = 1.5f;
  EXPECT_THAT(p.Validate().message(), HasSubstr("top_p"));
  p = {};
  p.top_k = -2;
  EXPECT_THAT(p.Validate().message(), HasSubstr("top_k"));
  p = {};
  p.min_p = 2;
  EXPECT_THAT(p.Validate().message(), HasSubstr("min_p"));
  p = {};
  p.repetition_penalty = 0;
  EXPECT_THAT(p.Validate().message(), HasSubstr("repetition_penalty"));
  p = {};
  p.frequency_penalty = 2.5f;
  EXPECT_THAT(p.Validate().message(), HasSubstr("frequency_penalty"));
  EXPECT_TRUE(SamplingParams{}.Validate().ok());
}

}  // namespace
}  // namespace moe::runtime
