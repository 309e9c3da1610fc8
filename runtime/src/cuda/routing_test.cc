// RouteTopK against the CPU's RouteTokens (runtime/src/routing.cc) on the same fp32 logits: the
// same ids except on near-ties (decided with a double-precision reference of the choice), and
// weights within 1e-5 relative.
#include "cuda/routing.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda/cuda_status.h"
#include "cuda/ops.h"
#include "gtest/gtest.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/routing.h"

namespace moe::runtime::cuda {
namespace {

#define ASSERT_CUDA(call)                                                                    \
  do {                                                                                       \
    const cudaError_t cuda_error_ = (call);                                                  \
    ASSERT_EQ(cuda_error_, cudaSuccess) << #call << ": " << cudaGetErrorString(cuda_error_); \
  } while (0)

struct RouterCase {
  const char* name;
  bool sigmoid;
  int experts;
  int top_k;
  bool normalize;
  int n_group;
  int topk_group;
  float scale;
  bool bias;
  float bias_center;  // correction biases are uniform in bias_center +- 0.5
};

// Real configurations, and edges: experts not a multiple of 32, groups of one and of three,
// biases so negative that the zeros of dropped groups win the choice.
const RouterCase kCases[] = {
    {"qwen3_128e_top8", false, 128, 8, true, 1, 1, 1.0f, false, 0.0f},
    {"qwen2_60e_top4", false, 60, 4, false, 1, 1, 1.0f, false, 0.0f},
    {"mixtral_8e_top2", false, 8, 2, true, 1, 1, 1.0f, false, 0.0f},
    {"softmax_512e_top10", false, 512, 10, true, 1, 1, 1.0f, false, 0.0f},
    {"softmax_33e_top16_scaled", false, 33, 16, false, 1, 1, 2.0f, false, 0.0f},
    {"deepseek_256e_8g4_top8", true, 256, 8, true, 8, 4, 2.5f, true, 0.0f},
    {"glm45_160e_top8", true, 160, 8, true, 1, 1, 2.5f, true, 0.0f},
    {"sigmoid_512e_16g4_top16", true, 512, 16, true, 16, 4, 1.0f, true, 0.0f},
    {"sigmoid_64e_16g2_top16_negative_bias", true, 64, 16, false, 16, 2, 1.0f, true, -1.5f},
    {"sigmoid_96e_3g2_top6_no_bias", true, 96, 6, true, 3, 2, 1.0f, false, 0.0f},
    {"sigmoid_48e_16g5_top5", true, 48, 5, true, 16, 5, 1.5f, true, 0.0f},
    {"sigmoid_16e_16g8_top4", true, 16, 4, true, 16, 8, 1.0f, true, 0.0f},
    {"sigmoid_500e_4g2_top16", true, 500, 16, false, 4, 2, 1.0f, true, 0.1f},
};

// gtest prints parameters (and CTest names tests) with this rather than the struct's bytes.
void PrintTo(const RouterCase& c, std::ostream* os) { *os << c.name; }

RoutingSpec SpecOf(const RouterCase& c) {
  RoutingSpec spec;
  spec.scoring = c.sigmoid ? ScoringFunction::kSigmoid : ScoringFunction::kSoftmax;
  spec.num_experts = c.experts;
  spec.top_k = c.top_k;
  spec.normalize_top_k = c.normalize;
  spec.has_correction_bias = c.bias;
  spec.n_group = c.n_group;
  spec.topk_group = c.topk_group;
  spec.routed_scaling_factor = c.scale;
  return spec;
}

RouterParams ParamsOf(const RouterCase& c, const float* device_bias) {
  RouterParams p;
  p.sigmoid = c.sigmoid;
  p.num_experts = c.experts;
  p.top_k = c.top_k;
  p.normalize_top_k = c.normalize;
  p.n_group = c.n_group;
  p.topk_group = c.topk_group;
  p.routed_scaling_factor = c.scale;
  p.correction_bias = device_bias;
  return p;
}

// The choice criterion in double: softmax probabilities, or biased sigmoid scores with the
// dropped groups at 0. `group_tie` says whether the kept groups are a near-tie away from others.
std::vector<double> ChoiceInDouble(const RouterCase& c, const float* logits, const float* bias, bool* group_tie) {
  const int e = c.experts;
  std::vector<double> v(e);
  *group_tie = false;
  if (!c.sigmoid) {
    const double mx = *std::max_element(logits, logits + e);
    double sum = 0;
    for (int i = 0; i < e; ++i) sum += v[i] = std::exp(double(logits[i]) - mx);
    for (double& p : v) p /= sum;
    return v;
  }
  for (int i = 0; i < e; ++i) v[i] = 1.0 / (1.0 + std::exp(-double(logits[i]))) + (bias != nullptr ? bias[i] : 0.0);
  if (c.n_group > 1) {
    const int per = e / c.n_group;
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < c.n_group; ++g) {
      std::vector<double> m(v.begin() + g * per, v.begin() + (g + 1) * per);
      std::sort(m.rbegin(), m.rend());
      groups.emplace_back(m[0] + (per >= 2 ? m[1] : 0.0), g);
    }
    std::sort(groups.begin(), groups.end(), [](auto a, auto b) { return a.first > b.first; });
    const double gap = groups[c.topk_group - 1].first - groups[c.topk_group].first;
    // An exact tie is one in fp32 on both sides too, and goes to the lower group on both.
    *group_tie = gap > 0 && gap <= 1e-5 * std::max(1.0, std::abs(groups[0].first));
    std::vector<bool> keep(c.n_group, false);
    for (int r = 0; r < c.topk_group; ++r) keep[groups[r].second] = true;
    for (int i = 0; i < e; ++i) {
      if (!keep[i / per]) v[i] = 0.0;
    }
  }
  return v;
}

class RouteTopKTest : public ::testing::TestWithParam<RouterCase> {};

TEST_P(RouteTopKTest, MatchesTheCpuRouter) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const RouterCase& c = GetParam();
  ASSERT_TRUE(CheckRouterParams(ParamsOf(c, nullptr)).ok()) << CheckRouterParams(ParamsOf(c, nullptr));
  const RoutingSpec spec = SpecOf(c);
  for (int tokens : {1, 3, 33, 257, 1000}) {
    SCOPED_TRACE("tokens=" + std::to_string(tokens));
    std::mt19937 rng(tokens * 101 + c.experts);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
    std::vector<float> logits(size_t{1} * tokens * c.experts), bias(c.experts);
    for (float& l : logits) {
      l = normal(rng);
      if (l == 0.0f) l = 0.5f;
    }
    for (float& b : bias) b = c.bias_center + uniform(rng);
    const float* host_bias = c.bias ? bias.data() : nullptr;

    const int k = c.top_k;
    const size_t outputs = size_t{1} * tokens * k;
    constexpr size_t kTail = 32;
    float* d_logits = nullptr;
    float* d_bias = nullptr;
    float* d_weights = nullptr;
    int32_t* d_ids = nullptr;
    ASSERT_CUDA(cudaMalloc(&d_logits, logits.size() * 4));
    ASSERT_CUDA(cudaMalloc(&d_bias, bias.size() * 4));
    ASSERT_CUDA(cudaMalloc(&d_ids, (outputs + kTail) * 4));
    ASSERT_CUDA(cudaMalloc(&d_weights, (outputs + kTail) * 4));
    ASSERT_CUDA(cudaMemcpy(d_logits, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(d_bias, bias.data(), bias.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemset(d_ids, 0xff, (outputs + kTail) * 4));
    ASSERT_CUDA(cudaMemset(d_weights, 0xff, (outputs + kTail) * 4));  // NaN
    RouteTopK(d_logits, tokens, ParamsOf(c, c.bias ? d_bias : nullptr), d_ids, d_weights, nullptr);
    ASSERT_CUDA(cudaGetLastError());
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<int32_t> ids(outputs + kTail);
    std::vector<float> weights(outputs + kTail);
    ASSERT_CUDA(cudaMemcpy(ids.data(), d_ids, ids.size() * 4, cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(weights.data(), d_weights, weights.size() * 4, cudaMemcpyDeviceToHost));
    (void)cudaFree(d_logits);
    (void)cudaFree(d_bias);
    (void)cudaFree(d_ids);
    (void)cudaFree(d_weights);
    for (size_t i = outputs; i < ids.size(); ++i) {
      ASSERT_EQ(ids[i], -1) << "ids written past the end";
      ASSERT_TRUE(std::isnan(weights[i])) << "weights written past the end";
    }

    std::vector<int32_t> cpu_ids(outputs);
    std::vector<float> cpu_weights(outputs);
    RouteTokens(spec, logits.data(), tokens, host_bias, cpu_ids.data(), cpu_weights.data());

    int near_ties = 0;
    for (int t = 0; t < tokens; ++t) {
      const int32_t* g = &ids[size_t{1} * t * k];
      const int32_t* r = &cpu_ids[size_t{1} * t * k];
      std::set<int32_t> distinct(g, g + k);
      ASSERT_EQ(distinct.size(), size_t(k)) << "token " << t << " has a repeated expert";
      ASSERT_GE(*distinct.begin(), 0) << "token " << t;
      ASSERT_LT(*distinct.rbegin(), c.experts) << "token " << t;
      if (std::equal(g, g + k, r)) {
        for (int i = 0; i < k; ++i) {
          const float gw = weights[size_t{1} * t * k + i], cw = cpu_weights[size_t{1} * t * k + i];
          EXPECT_LE(std::abs(gw - cw), 1e-5 * std::abs(cw))
              << "token " << t << " weight " << i << ": " << gw << ", cpu " << cw;
        }
        continue;
      }
      // Different ids: only a near-tie of the choice may explain it.
      bool group_tie = false;
      const std::vector<double> v = ChoiceInDouble(c, &logits[size_t{1} * t * c.experts], host_bias, &group_tie);
      ++near_ties;
      if (group_tie) continue;
      const double scale =
          *std::max_element(v.begin(), v.end(), [](double a, double b) { return std::abs(a) < std::abs(b); });
      for (int i = 0; i < k; ++i) {
        EXPECT_LE(std::abs(v[g[i]] - v[r[i]]), 1e-5 * std::abs(scale))
            << "token " << t << " rank " << i << ": GPU expert " << g[i] << " (" << v[g[i]] << "), CPU expert " << r[i]
            << " (" << v[r[i]] << ") are no near-tie";
      }
    }
    EXPECT_LE(near_ties, std::max(1, tokens / 100)) << "too many near-ties for random logits";
  }
}

INSTANTIATE_TEST_SUITE_P(Routers, RouteTopKTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<RouterCase>& info) { return std::string(info.param.name); });

TEST(RouteTopKTieTest, ExactTiesGoToTheLowerIndexAsOnTheCpu) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  for (const RouterCase& c : kCases) {
    SCOPED_TRACE(c.name);
    constexpr int kTokens = 5;
    // Every expert equal, then runs of equal logits from nine levels: ties decided by index
    // alone. The levels are not symmetric around 0, where sigmoid(-a) + sigmoid(a) = 1 would
    // make group scores of different experts equal up to rounding.
    std::vector<float> logits(size_t{1} * kTokens * c.experts, 0.75f);
    for (int t = 1; t < kTokens; ++t) {
      for (int i = 0; i < c.experts; ++i) logits[size_t{1} * t * c.experts + i] = 0.25f * float((i * t) / 2 % 9) - 0.6f;
    }
    std::vector<float> bias(c.experts, 0.125f);
    const int k = c.top_k;
    float *d_logits = nullptr, *d_bias = nullptr, *d_weights = nullptr;
    int32_t* d_ids = nullptr;
    ASSERT_CUDA(cudaMalloc(&d_logits, logits.size() * 4));
    ASSERT_CUDA(cudaMalloc(&d_bias, bias.size() * 4));
    ASSERT_CUDA(cudaMalloc(&d_ids, size_t{4} * kTokens * k));
    ASSERT_CUDA(cudaMalloc(&d_weights, size_t{4} * kTokens * k));
    ASSERT_CUDA(cudaMemcpy(d_logits, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(d_bias, bias.data(), bias.size() * 4, cudaMemcpyHostToDevice));
    RouteTopK(d_logits, kTokens, ParamsOf(c, c.bias ? d_bias : nullptr), d_ids, d_weights, nullptr);
    ASSERT_CUDA(cudaGetLastError());
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<int32_t> ids(size_t{1} * kTokens * k), cpu_ids(ids.size());
    std::vector<float> weights(ids.size()), cpu_weights(ids.size());
    ASSERT_CUDA(cudaMemcpy(ids.data(), d_ids, ids.size() * 4, cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(weights.data(), d_weights, weights.size() * 4, cudaMemcpyDeviceToHost));
    (void)cudaFree(d_logits);
    (void)cudaFree(d_bias);
    (void)cudaFree(d_ids);
    (void)cudaFree(d_weights);
    RouteTokens(SpecOf(c), logits.data(), kTokens, c.bias ? bias.data() : nullptr, cpu_ids.data(), cpu_weights.data());
    for (int t = 0; t < kTokens; ++t) {
      bool group_tie = false;
      (void)ChoiceInDouble(c, &logits[size_t{1} * t * c.experts], c.bias ? bias.data() : nullptr, &group_tie);
      if (group_tie) continue;  // two different groups' sums a rounding apart: not what this tests
      for (int i = 0; i < k; ++i) {
        const size_t at = size_t{1} * t * k + i;
        EXPECT_EQ(ids[at], cpu_ids[at]) << "token " << t << " rank " << i;
        EXPECT_NEAR(weights[at], cpu_weights[at], 1e-5 * std::abs(cpu_weights[at])) << "token " << t << " rank " << i;
      }
    }
  }
}

TEST(RouteTopKLimitsTest, CheckRouterParamsRefusesWhatItCannotRoute) {
  RouterParams p;
  p.num_experts = 64;
  p.top_k = 8;
  EXPECT_TRUE(CheckRouterParams(p).ok());
  RouterParams bad = p;
  bad.num_experts = 513;
  EXPECT_EQ(CheckRouterParams(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad = p;
  bad.top_k = 17;
  EXPECT_EQ(CheckRouterParams(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad = p;
  bad.top_k = 65;
  EXPECT_EQ(CheckRouterParams(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad = p;
  bad.sigmoid = true;
  bad.n_group = 5;  // does not divide 64
  EXPECT_EQ(CheckRouterParams(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad.n_group = 32;
  EXPECT_EQ(CheckRouterParams(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad.n_group = 8;
  bad.topk_group = 9;
  EXPECT_EQ(CheckRouterParams(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad.topk_group = 4;
  EXPECT_TRUE(CheckRouterParams(bad).ok());
  bad.sigmoid = false;  // softmax routers are not grouped: n_group is not read
  bad.n_group = 5;
  EXPECT_TRUE(CheckRouterParams(bad).ok());
}

TEST(RouteTopKLimitsTest, RefusedParamsPoisonTheOutput) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  RouterParams bad;
  bad.num_experts = 1024;
  bad.top_k = 8;
  constexpr int kTokens = 3;
  float* d_logits = nullptr;
  float* d_weights = nullptr;
  int32_t* d_ids = nullptr;
  ASSERT_CUDA(cudaMalloc(&d_logits, size_t{4} * kTokens * bad.num_experts));
  ASSERT_CUDA(cudaMalloc(&d_ids, size_t{4} * kTokens * bad.top_k));
  ASSERT_CUDA(cudaMalloc(&d_weights, size_t{4} * kTokens * bad.top_k));
  ASSERT_CUDA(cudaMemset(d_ids, 0x7f, size_t{4} * kTokens * bad.top_k));
  RouteTopK(d_logits, kTokens, bad, d_ids, d_weights, nullptr);
  ASSERT_CUDA(cudaGetLastError());
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> ids(size_t{1} * kTokens * bad.top_k);
  std::vector<float> weights(ids.size());
  ASSERT_CUDA(cudaMemcpy(ids.data(), d_ids, ids.size() * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(weights.data(), d_weights, weights.size() * 4, cudaMemcpyDeviceToHost));
  (void)cudaFree(d_logits);
  (void)cudaFree(d_ids);
  (void)cudaFree(d_weights);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(ids[i], 0);
    EXPECT_TRUE(std::isnan(weights[i]));
  }
}

}  // namespace
}  // namespace moe::runtime::cuda
