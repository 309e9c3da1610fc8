#include "cpu/mla_attention.h"

#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace moe::runtime::internal {
namespace {

void Serial(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body) { body(0, n); }

// A sequence of `len` positions in a paged latent cache (its blocks out of order), and a chunk of
// its last `rows` positions as queries.
struct MlaCase {
  MlaDims d;
  int block_size = 4;
  int len = 0, rows = 0;
  std::vector<float> kv_b, cache, q;
  std::vector<int32_t> table, positions, seq_start;

  MlaCase(MlaDims dims, int length, int chunk, uint32_t seed) : d(dims), len(length), rows(chunk) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, size_t n, float scale) {
      v.resize(n);
      for (float& x : v) x = normal(rng) * scale;
    };
    fill(kv_b, static_cast<size_t>(d.heads) * (d.nope + d.v) * d.lora, 0.3f);
    const int blocks = (len + block_size - 1) / block_size;
    table.resize(blocks);
    std::iota(table.rbegin(), table.rend(), 1);  // reversed, from block 1
    fill(cache, static_cast<size_t>(blocks + 2) * block_size * d.latent(), 1.0f);
    fill(q, static_cast<size_t>(rows) * d.heads * d.qk(), 1.0f);
    for (int r = 0; r < rows; ++r) positions.push_back(len - rows + r);
    seq_start = {0, rows};
  }
  MlaQueries Queries(std::vector<float>* out, float scale) const {
    out->assign(static_cast<size_t>(rows) * d.heads * d.v, 0.0f);
    return MlaQueries{
        q.data(), out->data(), scale, positions.data(), seq_start.data(), table.data(), static_cast<int>(table.size())};
  }
  PagedLatent Cache() const { return PagedLatent{cache.data(), block_size}; }

  // The math as transformers writes it, in double: every head's key [W_UK c | k_rope] and value
  // W_UV c from each position's latent c.
  std::vector<double> Reference(float scale) const {
    std::vector<double> out(static_cast<size_t>(rows) * d.heads * d.v, 0.0);
    auto latent = [&](int p) {
      return cache.data() + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * d.latent();
    };
    for (int r = 0; r < rows; ++r) {
      for (int h = 0; h < d.heads; ++h) {
        const float* qh = q.data() + (static_cast<int64_t>(r) * d.heads + h) * d.qk();
        const float* w = kv_b.data() + static_cast<int64_t>(h) * (d.nope + d.v) * d.lora;
        std::vector<double> scores(positions[r] + 1);
        double max_score = -1e300;
        for (int p = 0; p <= positions[r]; ++p) {
          double s = 0;
          for (int i = 0; i < d.nope; ++i) {
            double k = 0;
            for (int c = 0; c < d.lora; ++c) k += double{w[i * d.lora + c]} * latent(p)[c];
            s += qh[i] * k;
          }
          for (int i = 0; i < d.rope; ++i) s += double{qh[d.nope + i]} * latent(p)[d.lora + i];
          scores[p] = s * scale;
          max_score = std::max(max_score, scores[p]);
        }
        double sum = 0;
        for (double& s : scores) sum += (s = std::exp(s - max_score));
        for (int p = 0; p <= positions[r]; ++p) {
          for (int j = 0; j < d.v; ++j) {
            double v = 0;
            for (int c = 0; c < d.lora; ++c) v += double{w[(d.nope + j) * d.lora + c]} * latent(p)[c];
            out[(static_cast<size_t>(r) * d.heads + h) * d.v + j] += scores[p] / sum * v;
          }
        }
      }
    }
    return out;
  }
};

// The absorbed form of a case's sequence, by every instruction set this CPU runs: they agree within
// fp32 rounding (FMA contraction differs), and the last one's outputs land in `out`.
void Absorbed(const MlaDims& d, const MlaCase& c, float scale, std::vector<float>* out) {
  std::vector<float> first;
  for (const AttentionIsa isa : {AttentionIsa::kPortable, AttentionIsa::kAvx2, AttentionIsa::kAvx512}) {
    if (!AttentionIsaSupported(isa)) continue;
    AttentionScratch scratch;
    std::vector<float> q_abs, o_abs;
    MlaAttendAbsorbed(d, c.kv_b.data(), c.Cache(), c.Queries(out, scale), 0, 1, isa, Serial, scratch, &q_abs, &o_abs);
    if (first.empty()) {
      first = *out;
      continue;
    }
    for (size_t i = 0; i < out->size(); ++i) {
      ASSERT_NEAR((*out)[i], first[i], 1e-5f * std::max(1.0f, std::abs(first[i]))) << AttentionIsaName(isa);
    }
  }
}

double MaxDiff(const std::vector<float>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

TEST(MlaAttentionTest, AbsorbedDecodeEqualsTheExpandedFormWithinFp32Rounding) {
  // DeepSeek-V3's proportions, smaller: nope 2x rope, v = nope, a latent wider than a head.
  const MlaDims d{4, 16, 8, 16, 32};
  for (const int len : {1, 7, 40, 300}) {  // 300: a decode row whose keys the kernel splits
    MlaCase c(d, len, /*chunk=*/1, 7 + len);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d.qk()));
    std::vector<float> expanded, absorbed;
    MlaAttendExpanded(d, c.kv_b.data(), c.Cache(), c.Queries(&expanded, scale), 0, Serial);
    Absorbed(d, c, scale, &absorbed);
    const std::vector<double> want = c.Reference(scale);
    double worst = 0, largest = 0;
    for (size_t i = 0; i < expanded.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(expanded[i] - absorbed[i])));
      largest = std::max(largest, std::abs(want[i]));
    }
    EXPECT_LT(worst, 2e-6 * std::max(1.0, largest)) << "context " << len;
    EXPECT_LT(MaxDiff(expanded, want), 2e-6 * std::max(1.0, largest)) << "context " << len;
    EXPECT_LT(MaxDiff(absorbed, want), 2e-6 * std::max(1.0, largest)) << "context " << len;
  }
}

TEST(MlaAttentionTest, EachRowOfAChunkSeesOnlyItsOwnPrefixInBothForms) {
  const MlaDims d{2, 8, 4, 6, 12};
  MlaCase c(d, 11, /*chunk=*/5, 3);
  const float scale = 0.3f;
  std::vector<float> expanded, absorbed;
  MlaAttendExpanded(d, c.kv_b.data(), c.Cache(), c.Queries(&expanded, scale), 0, Serial);
  Absorbed(d, c, scale, &absorbed);
  const std::vector<double> want = c.Reference(scale);
  EXPECT_LT(MaxDiff(expanded, want), 1e-5);
  EXPECT_LT(MaxDiff(absorbed, want), 1e-5);
}

TEST(MlaAttentionTest, InterleavedRopeRotatesNeighboursAndHalvesRotateHalves) {
  const float inv_freq[2] = {1.0f, 0.5f};
  float pairs[4] = {1, 0, 1, 0};
  RotateMla(pairs, 4, inv_freq, 2, 1.0f, /*interleave=*/true);
  EXPECT_NEAR(pairs[0], std::cos(2.0f), 1e-6);
  EXPECT_NEAR(pairs[1], std::sin(2.0f), 1e-6);
  EXPECT_NEAR(pairs[2], std::cos(1.0f), 1e-6);
  EXPECT_NEAR(pairs[3], std::sin(1.0f), 1e-6);
  float halves[4] = {1, 1, 0, 0};
  RotateMla(halves, 4, inv_freq, 2, 2.0f, /*interleave=*/false);  // cos and sin scaled by 2
  EXPECT_NEAR(halves[0], 2 * std::cos(2.0f), 1e-6);
  EXPECT_NEAR(halves[2], 2 * std::sin(2.0f), 1e-6);
  EXPECT_NEAR(halves[1], 2 * std::cos(1.0f), 1e-6);
  EXPECT_NEAR(halves[3], 2 * std::sin(1.0f), 1e-6);
}

}  // namespace
}  // namespace moe::runtime::internal
