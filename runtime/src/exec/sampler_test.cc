#include "moe/runtime/sampler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/core/philox.h"

namespace moe::runtime {
namespace {

using ::testing::HasSubstr;

const std::vector<float> kLogits = {0.5f, 2.0f, -1.0f, 1.9f, 0.0f, 1.0f};

SamplingParams Sampled(float temperature, int top_k = 0, float top_p = 1.0f, float min_p = 0.0f) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

std::string Describe(const SamplingParams& p) {
  return "temperature=" + std::to_string(p.temperature) + " top_k=" + std::to_string(p.top_k) +
         " top_p=" + std::to_string(p.top_p) + " min_p=" + std::to_string(p.min_p);
}

// The algorithm of sampler.h written plainly, with full sorts: the kept set in (q desc, id asc)
// order.
std::vector<int32_t> PlainKeptSet(const std::vector<float>& logits, const SamplingParams& p) {
  const int vocab = static_cast<int>(logits.size());
  const float kMax = std::numeric_limits<float>::max();
  std::vector<float> z(vocab);
  for (int i = 0; i < vocab; ++i) z[i] = std::clamp(logits[i] / p.temperature, -kMax, kMax);
  std::vector<int32_t> by_z(vocab);
  std::iota(by_z.begin(), by_z.end(), 0);
  std::sort(by_z.begin(), by_z.end(), [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  const float z_max = z[by_z[0]];
  const int k1 = p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab;
  std::vector<int32_t> k1_ids(by_z.begin(), by_z.begin() + k1);
  std::sort(k1_ids.begin(), k1_ids.end());
  std::vector<float> e(vocab, 0.0f);
  double sum = 0;
  for (int32_t id : k1_ids) {
    e[id] = std::exp(z[id] - z_max);
    sum += e[id];
  }
  std::vector<int32_t> k2;
  for (int32_t id : k1_ids) {
    if (e[id] >= p.min_p) k2.push_back(id);
  }
  std::sort(k2.begin(), k2.end(), [&](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); });
  if (p.top_p >= 1) return k2;
  std::vector<int32_t> kept;
  double mass_before = 0;
  for (int32_t id : k2) {
    if (!kept.empty() && !(mass_before < static_cast<double>(p.top_p) * sum)) break;
    kept.push_back(id);
    mass_before += e[id];
  }
  return kept;
}

float PlainGumbelScore(const std::vector<float>& logits, const SamplingParams& p, const SampleKey& key, int32_t id) {
  const float kMax = std::numeric_limits<float>::max();
  const float z = std::clamp(logits[id] / p.temperature, -kMax, kMax);
  const float u = std::min(core::SamplingUniform(key.seed, key.sequence, key.position, id), 0x1.fffffep-1f);
  return z + -std::log(-std::log(u));
}

int32_t PlainSample(const std::vector<float>& logits, const SamplingParams& p, const SampleKey& key) {
  if (p.greedy()) return ArgMax(logits.data(), static_cast<int>(logits.size()));
  std::vector<int32_t> kept = PlainKeptSet(logits, p);
  std::sort(kept.begin(), kept.end());
  int32_t best = kept[0];
  float best_score = PlainGumbelScore(logits, p, key, best);
  for (int32_t id : kept) {
    const float s = PlainGumbelScore(logits, p, key, id);
    if (s > best_score) {
      best_score = s;
      best = id;
    }
  }
  return best;
}

// softmax(z) over the kept set, indexed by id (0 outside it).
std::vector<double> KeptDistribution(const std::vector<float>& logits, const SamplingParams& p) {
  std::vector<double> prob(logits.size(), 0.0);
  double sum = 0;
  for (int32_t id : PlainKeptSet(logits, p))
    sum += prob[id] = std::exp(static_cast<double>(logits[id]) / p.temperature);
  for (double& v : prob) v /= sum;
  return prob;
}

TEST(SamplerTest, PhiloxMatchesTheKnownAnswers) {
  // Random123's kat_vectors for philox4x32_10: every process and the GPU rely on these words.
  core::Philox4x32 r = core::Philox(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = core::Philox(~0u, ~0u, ~0u, ~0u, ~0u, ~0u);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  r = core::Philox(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[2], 0x5001e420u);
}

TEST(SamplerTest, GreedyTakesTheArgmaxWithLowestIdOnTies) {
  const SampleKey key{1, 0, 0};
  EXPECT_EQ(SampleToken(kLogits.data(), 6, SamplingParams{}, key), 1);
  const std::vector<float> tie = {1.0f, 3.0f, 3.0f};
  EXPECT_EQ(SampleToken(tie.data(), 3, SamplingParams{}, key), 1);
  const std::vector<float> all_equal(50, -2.5f);
  EXPECT_EQ(SampleToken(all_equal.data(), 50, SamplingParams{}, key), 0);
  // Sampling whose filters keep only the best entry is greedy too, ties included.
  EXPECT_EQ(SampleToken(tie.data(), 3, Sampled(1.0f, 1), key), 1);
  EXPECT_EQ(SampleToken(all_equal.data(), 50, Sampled(1.0f, 1), key), 0);
}

TEST(SamplerTest, SameKeySameTokenAndEveryKeyFieldChangesTheDraws) {
  const SamplingParams p = Sampled(1.0f);
  auto draws = [&](uint64_t seed, uint32_t sequence, uint32_t first_position) {
    std::vector<int32_t> out;
    for (uint32_t i = 0; i < 64; ++i) {
      out.push_back(SampleToken(kLogits.data(), 6, p, SampleKey{seed, sequence, first_position + i}));
    }
    return out;
  };
  const std::vector<int32_t> base = draws(42, 0, 0);
  EXPECT_EQ(draws(42, 0, 0), base);  // no state: the same keys give the same tokens
  EXPECT_GT(std::set<int32_t>(base.begin(), base.end()).size(), 2u) << "positions must give different draws";
  EXPECT_NE(draws(43, 0, 0), base);
  EXPECT_NE(draws(42, 1, 0), base);
  EXPECT_NE(draws(42, 0, 64), base);
  EXPECT_NE(draws(42ull | (1ull << 40), 0, 0), base);  // the seed's high word counts too
}

TEST(SamplerTest, FiltersThatKeepOneTokenAreGreedy) {
  for (const SamplingParams& p : {Sampled(5.0f, 1), Sampled(5.0f, 0, 0.01f), Sampled(5.0f, 0, 1.0f, 1.0f)}) {
    for (uint32_t i = 0; i < 100; ++i) {
      ASSERT_EQ(SampleToken(kLogits.data(), 6, p, SampleKey{7, 0, i}), 1) << Describe(p);
    }
  }
}

TEST(SamplerTest, TopKKeepsOnlyTheHead) {
  const SamplingParams p = Sampled(10.0f, 2);  // nearly flat
  std::set<int32_t> seen;
  for (uint32_t i = 0; i < 200; ++i) seen.insert(SampleToken(kLogits.data(), 6, p, SampleKey{7, 0, i}));
  EXPECT_EQ(seen, (std::set<int32_t>{1, 3}));
}

TEST(SamplerTest, TopPKeepsTheSmallestPrefixThatReachesIt) {
  // q = 1/2, 1/4, 1/8, 1/8 (ids shuffled). Mass before each in q order: 0, 1/2, 3/4, 7/8.
  const std::vector<float> logits = {std::log(0.125f), std::log(0.5f), std::log(0.125f), std::log(0.25f)};
  auto kept = [&](float top_p, float min_p) {
    std::set<int32_t> seen;
    for (uint32_t i = 0; i < 2000; ++i) {
      seen.insert(SampleToken(logits.data(), 4, Sampled(1.0f, 0, top_p, min_p), SampleKey{3, 0, i}));
    }
    return seen;
  };
  EXPECT_EQ(kept(0.4f, 0), (std::set<int32_t>{1}));
  EXPECT_EQ(kept(0.6f, 0), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(kept(0.74f, 0), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(kept(0.76f, 0), (std::set<int32_t>{0, 1, 3}));  // the tie at 1/8 goes to the lower id
  EXPECT_EQ(kept(0.9f, 0), (std::set<int32_t>{0, 1, 2, 3}));
  // top_p counts the mass of K1, not renormalised after min_p: min_p drops both 1/8 entries,
  // 1/4 keeps its mass before of 1/2 < 0.6 (renormalised it would be 2/3 and dropped).
  EXPECT_EQ(kept(0.6f, 0.3f), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(kept(0.45f, 0.3f), (std::set<int32_t>{1}));
}

TEST(SamplerTest, TopPAfterMinPKeepsWhatThePlainReferenceKeeps) {
  // min_p drops 990 entries holding most of K1's mass; top_p = 0.9 of that mass is out of reach
  // of the 11 left, so all 11 are kept, however small their e.
  std::vector<float> logits(1001, std::log(0.009f));
  logits[500] = 0.0f;
  for (int i = 0; i < 10; ++i) logits[i * 97] = std::log(0.05f);
  const SamplingParams p = Sampled(1.0f, 0, 0.9f, 0.01f);
  const std::vector<int32_t> want = PlainKeptSet(logits, p);
  ASSERT_EQ(want.size(), 11u);
  std::set<int32_t> seen;
  for (uint32_t i = 0; i < 3000; ++i) seen.insert(SampleToken(logits.data(), 1001, p, SampleKey{8, 0, i}));
  EXPECT_EQ(seen, std::set<int32_t>(want.begin(), want.end()));
}

TEST(SamplerTest, MatchesThePlainReference) {
  std::mt19937 rng(5);
  const std::vector<SamplingParams> mixes = {Sampled(1.0f),
                                             Sampled(0.7f, 5),
                                             Sampled(1.3f, 0, 0.9f),
                                             Sampled(1.0f, 0, 1.0f, 0.1f),
                                             Sampled(0.9f, 40, 0.8f, 0.05f),
                                             Sampled(2.0f, 3, 0.5f),
                                             Sampled(0.05f, 0, 0.95f),
                                             Sampled(1.0f, 1000, 0.3f)};
  int checked = 0;
  for (int vocab : {1, 2, 7, 100, 1000}) {
    for (bool ties : {false, true}) {
      std::normal_distribution<float> dist(0.0f, 2.0f);
      std::vector<float> logits(vocab);
      for (float& v : logits) v = ties ? std::round(dist(rng) * 2) / 2 : dist(rng);
      for (const SamplingParams& p : mixes) {
        for (uint32_t pos = 0; pos < 40; ++pos) {
          const SampleKey key{rng(), static_cast<uint32_t>(rng() % 4), pos};
          ASSERT_EQ(SampleToken(logits.data(), vocab, p, key), PlainSample(logits, p, key))
              << "vocab=" << vocab << " ties=" << ties << " " << Describe(p) << " position=" << pos;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 5 * 2 * 8 * 40);
}

TEST(SamplerTest, FollowsTheSoftmaxOverTheKeptSet) {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, 1.5f, -1.0f, 0.7f};
  const std::vector<SamplingParams> mixes = {Sampled(0.8f),
                                             Sampled(0.8f, 3),
                                             Sampled(0.8f, 0, 0.8f),
                                             Sampled(0.8f, 0, 1.0f, 0.2f),
                                             Sampled(1.0f, 5, 0.9f, 0.1f),
                                             Sampled(2.0f, 6, 0.7f)};
  const int n = 20000;
  for (const SamplingParams& p : mixes) {
    const std::vector<double> want = KeptDistribution(logits, p);
    std::vector<int> count(logits.size(), 0);
    for (uint32_t i = 0; i < n; ++i) ++count[SampleToken(logits.data(), 8, p, SampleKey{2024, 0, i})];
    double chi2 = 0;
    int kept = 0;
    for (size_t t = 0; t < logits.size(); ++t) {
      if (want[t] == 0) {
        EXPECT_EQ(count[t], 0) << "token " << t << " is outside the kept set; " << Describe(p);
        continue;
      }
      ++kept;
      const double expected = want[t] * n;
      chi2 += (count[t] - expected) * (count[t] - expected) / expected;
    }
    // The 0.9999 quantile of chi-square with 7 degrees of freedom is 29.9: a sampler that is off
    // by a few percent on any token lands far above it with 20000 draws.
    const int dof = std::max(kept - 1, 1);
    EXPECT_LT(chi2, 16.0 + 2.0 * dof) << Describe(p) << " kept " << kept;
  }
}

TEST(SamplerTest, FiltersNeverLeaveAnEmptySet) {
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const std::vector<SamplingParams> extremes = {Sampled(1.0f, 1, 1e-7f, 1.0f),   Sampled(1e-3f, 0, 1e-7f),
                                                Sampled(100.0f, 0, 1e-7f, 1.0f), Sampled(1.0f, 0, 1.0f, 1.0f),
                                                Sampled(1e-38f, 0, 0.5f),        Sampled(1e-38f, 2, 1.0f, 0.5f),
                                                Sampled(1.0f, 1 << 24, 0.001f),  Sampled(50.0f, 2, 0.999f, 0.999f)};
  for (int vocab : {1, 3, 64}) {
    std::vector<float> logits(vocab);
    for (float& v : logits) v = dist(rng);
    for (const SamplingParams& p : extremes) {
      for (uint32_t pos = 0; pos < 20; ++pos) {
        const int32_t t = SampleToken(logits.data(), vocab, p, SampleKey{11, 0, pos});
        ASSERT_GE(t, 0);
        ASSERT_LT(t, vocab);
        ASSERT_EQ(t, PlainSample(logits, p, SampleKey{11, 0, pos})) << Describe(p);
      }
    }
  }
}

TEST(SamplerTest, ATinyTemperatureDoesNotOverflow) {
  // 10 / 1e-38 overflows fp32: the clamp keeps the softmax finite and the draw among the best.
  const std::vector<float> logits = {-3.0f, 10.0f, 9.5f, 2.0f};
  for (uint32_t i = 0; i < 50; ++i) {
    const int32_t t = SampleToken(logits.data(), 4, Sampled(1e-38f), SampleKey{1, 0, i});
    EXPECT_TRUE(t == 1 || t == 2) << t;
  }
}

TEST(SamplerTest, UniformDrawsStayBelowOne) {
  // The largest word gives (2^23 - 0.5) / 2^23: below 1, so the Gumbel noise -log(-log(u)) is
  // finite (about 15.9) and no entry wins whatever its logit.
  EXPECT_LT(core::UniformFromBits(0xFFFFFFFFu), 1.0f);
  EXPECT_GT(core::UniformFromBits(0u), 0.0f);
  EXPECT_TRUE(std::isfinite(-std::log(-std::log(core::UniformFromBits(0xFFFFFFFFu)))));
}

TEST(SamplerTest, ALargeVocabularyNeedsNoFullSort) {
  // 150000 entries as in a real tokenizer; checked against the plain reference. The time is
  // printed, not asserted: a full sort per token would show here as milliseconds per draw.
  const int vocab = 150000;
  std::mt19937 rng(21);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  std::vector<float> logits(vocab);
  for (float& v : logits) v = dist(rng);
  for (const SamplingParams& p : {Sampled(1.0f, 50), Sampled(0.8f, 20, 0.9f, 0.05f), Sampled(1.0f, 0, 0.9f),
                                  Sampled(1.0f, 0, 1.0f, 0.1f), Sampled(1.0f)}) {
    const int draws = 20;
    const auto start = std::chrono::steady_clock::now();
    std::vector<int32_t> got;
    for (uint32_t i = 0; i < draws; ++i) got.push_back(SampleToken(logits.data(), vocab, p, SampleKey{5, 0, i}));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("vocab %d, %s: %.3f ms per token\n", vocab, Describe(p).c_str(), ms / draws);
    for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(got[i], PlainSample(logits, p, SampleKey{5, 0, i})) << Describe(p);
  }
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
  EXPECT_FLOAT_EQ(logits[0], 1.0f);                      // prompt token, positive: halved
  EXPECT_FLOAT_EQ(logits[1], -2.0f);                     // prompt token, negative: doubled
  EXPECT_FLOAT_EQ(logits[2], 0.25f - 0.5f - 2 * 0.25f);  // output token twice: all three
  EXPECT_FLOAT_EQ(logits[3], 3.0f);                      // never seen
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
