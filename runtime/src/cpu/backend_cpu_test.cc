// The CPU backend's optimised loops against plain double-precision references.
#include "moe/runtime/backend_cpu.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moe/runtime/kv_cache.h"

namespace moe::runtime {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = core::FloatToBf16(v[i]);
  return out;
}

class CpuBackendTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = CreateCpuBackend(2);
};

TEST_F(CpuBackendTest, LinearMatchesReferenceForBf16AndF32Weights) {
  for (int64_t rows : {1, 3, 40}) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{19, 37}, {64, 128}, {33, 2048}}) {
      for (bool bf16 : {true, false}) {
        std::vector<float> x = Random(rows * k, 1), w = Random(n * k, 2, 0.1f), bias = Random(n, 3);
        std::vector<uint16_t> w16 = ToBf16(w);
        core::TensorView wv{bf16 ? static_cast<const void*>(w16.data()) : w.data(),
                            bf16 ? core::DType::kBF16 : core::DType::kF32,
                            {n, k}};
        core::TensorView bv{bias.data(), core::DType::kF32, {n}};
        auto weight = backend_->PrepareWeight(wv);
        auto b = backend_->PrepareWeight(bv);
        ASSERT_TRUE(weight.ok() && b.ok());
        std::vector<float> out(rows * n);
        backend_->Linear(x.data(), rows, **weight, b->get(), out.data());
        double worst = 0;
        for (int64_t t = 0; t < rows; ++t) {
          for (int64_t j = 0; j < n; ++j) {
            double want = bias[j];
            for (int64_t i = 0; i < k; ++i) {
              const double wij = bf16 ? core::Bf16ToFloat(w16[j * k + i]) : w[j * k + i];
              want += double(x[t * k + i]) * wij;
            }
            worst = std::max(worst, std::abs(want - out[t * n + j]));
          }
        }
        EXPECT_LT(worst, 2e-4) << "rows=" << rows << " n=" << n << " k=" << k << " bf16=" << bf16;
      }
    }
  }
}

TEST_F(CpuBackendTest, F16WeightsAreConvertedOnce) {
  std::vector<uint16_t> w = {0x3c00, 0x4000, 0xbc00, 0x3800};  // 1, 2, -1, 0.5
  auto weight = backend_->PrepareWeight({w.data(), core::DType::kF16, {2, 2}});
  ASSERT_TRUE(weight.ok());
  const float x[] = {3, 4};
  float out[2];
  backend_->Linear(x, 1, **weight, nullptr, out);
  EXPECT_FLOAT_EQ(out[0], 11.0f);
  EXPECT_FLOAT_EQ(out[1], -1.0f);
  std::vector<int32_t> ints(4);
  EXPECT_EQ(backend_->PrepareWeight({ints.data(), core::DType::kI32, {2, 2}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, RmsNormMatchesReference) {
  const int64_t rows = 5, cols = 67;
  std::vector<float> x = Random(rows * cols, 4), w = Random(cols, 5), out(rows * cols);
  auto weight = backend_->PrepareWeight({w.data(), core::DType::kF32, {cols}});
  ASSERT_TRUE(weight.ok());
  backend_->RmsNorm(x.data(), **weight, 1e-6f, rows, cols, out.data());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < cols; ++i) ss += double(x[r * cols + i]) * x[r * cols + i];
    const double inv = 1 / std::sqrt(ss / cols + 1e-6);
    for (int64_t i = 0; i < cols; ++i) EXPECT_NEAR(out[r * cols + i], w[i] * x[r * cols + i] * inv, 1e-5);
  }
}

TEST_F(CpuBackendTest, RopeRotatesHalvesOfTheRotaryPart) {
  const int heads = 2, head_dim = 8, rotary = 4;
  std::vector<float> x = Random(3 * heads * head_dim, 6), orig = x;
  const float inv_freq[] = {1.0f, 0.01f};
  const int32_t positions[] = {0, 5, 100};
  backend_->Rope(x.data(), 3, heads, head_dim, rotary, inv_freq, positions);
  for (int r = 0; r < 3; ++r) {
    for (int h = 0; h < heads; ++h) {
      const float* o = orig.data() + (r * heads + h) * head_dim;
      const float* got = x.data() + (r * heads + h) * head_dim;
      for (int i = 0; i < 2; ++i) {
        const double a = positions[r] * double(inv_freq[i]);
        EXPECT_NEAR(got[i], o[i] * std::cos(a) - o[i + 2] * std::sin(a), 1e-4);
        EXPECT_NEAR(got[i + 2], o[i + 2] * std::cos(a) + o[i] * std::sin(a), 1e-4);
      }
      for (int i = rotary; i < head_dim; ++i) EXPECT_EQ(got[i], o[i]);  // the pass-through part
    }
  }
}

// Two sequences with GQA: the first gets a 5-token prefill then 2 more tokens; the second a
// 3-token prefill in the same batch. Every output is checked against attention over the full
// key/value history computed directly.
TEST_F(CpuBackendTest, PagedAttentionMatchesFullAttention) {
  const int heads = 4, kv_heads = 2, d = 16, block = 4;
  auto cache_or = KvCache::Create(*backend_, KvCacheShape{1, 8, block, kv_heads, d});
  ASSERT_TRUE(cache_or.ok());
  KvCache& cache = **cache_or;
  std::vector<int32_t> table_a = {5, 2}, table_b = {7, 0, 3};
  const int len_a = 7, len_b = 3;
  std::vector<float> qa = Random(len_a * heads * d, 10), ka = Random(len_a * kv_heads * d, 11),
                     va = Random(len_a * kv_heads * d, 12);
  std::vector<float> qb = Random(len_b * heads * d, 13), kb = Random(len_b * kv_heads * d, 14),
                     vb = Random(len_b * kv_heads * d, 15);
  auto run = [&](std::vector<SequenceChunk> seqs, const std::vector<float>& q, const std::vector<float>& k,
                 const std::vector<float>& v, int64_t rows) {
    std::vector<float> out(rows * heads * d);
    AttentionArgs args;
    args.q = q.data();
    args.k = k.data();
    args.v = v.data();
    args.out = out.data();
    args.num_tokens = rows;
    args.num_heads = heads;
    args.num_kv_heads = kv_heads;
    args.head_dim = d;
    args.scale = 0.25f;
    args.seqs = seqs.data();
    args.num_seqs = static_cast<int>(seqs.size());
    args.cache = &cache;
    backend_->Attention(args);
    return out;
  };
  auto slice = [&](const std::vector<float>& v, int from, int to, int width) {
    return std::vector<float>(v.begin() + from * width, v.begin() + to * width);
  };
  // Step 1: a's first 5 tokens and all of b, batched.
  std::vector<float> q1 = slice(qa, 0, 5, heads * d), k1 = slice(ka, 0, 5, kv_heads * d), v1 = slice(va, 0, 5, kv_heads * d);
  q1.insert(q1.end(), qb.begin(), qb.end());
  k1.insert(k1.end(), kb.begin(), kb.end());
  v1.insert(v1.end(), vb.begin(), vb.end());
  std::vector<float> out1 = run({{0, 5, table_a}, {0, 3, table_b}}, q1, k1, v1, 8);
  // Step 2: a's last 2 tokens, reading 5 cached positions.
  std::vector<float> out2 = run({{5, 2, table_a}}, slice(qa, 5, 7, heads * d), slice(ka, 5, 7, kv_heads * d),
                                slice(va, 5, 7, kv_heads * d), 2);

  auto reference = [&](const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, int t,
                       int h, int i) {
    const int kvh = h / (heads / kv_heads);
    std::vector<double> s(t + 1);
    double mx = -1e30, sum = 0;
    for (int p = 0; p <= t; ++p) {
      double dot = 0;
      for (int j = 0; j < d; ++j) dot += double(q[(t * heads + h) * d + j]) * k[(p * kv_heads + kvh) * d + j];
      s[p] = dot * 0.25;
      mx = std::max(mx, s[p]);
    }
    double out = 0;
    for (int p = 0; p <= t; ++p) sum += s[p] = std::exp(s[p] - mx);
    for (int p = 0; p <= t; ++p) out += s[p] / sum * v[(p * kv_heads + kvh) * d + i];
    return out;
  };
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < d; ++i) {
      for (int t = 0; t < 5; ++t) EXPECT_NEAR(out1[(t * heads + h) * d + i], reference(qa, ka, va, t, h, i), 1e-5);
      for (int t = 0; t < 3; ++t) {
        EXPECT_NEAR(out1[((5 + t) * heads + h) * d + i], reference(qb, kb, vb, t, h, i), 1e-5);
      }
      for (int t = 5; t < 7; ++t) {
        EXPECT_NEAR(out2[((t - 5) * heads + h) * d + i], reference(qa, ka, va, t, h, i), 1e-5);
      }
    }
  }
}

TEST_F(CpuBackendTest, ElementwiseAndRowOps) {
  const float gate[] = {0.0f, 1.0f, -2.0f}, up[] = {5.0f, 2.0f, 1.0f};
  float out[3];
  backend_->SiluMul(gate, up, 3, out);
  EXPECT_FLOAT_EQ(out[0], 0.0f);
  EXPECT_NEAR(out[1], 2.0 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(out[2], -2.0 / (1 + std::exp(2.0)), 1e-6);

  const float src[] = {1, 2, 3, 4, 5, 6};  // 3 rows of 2
  const int32_t rows[] = {2, 0};
  float gathered[4];
  backend_->GatherRows(src, 2, rows, 2, gathered);
  EXPECT_EQ(gathered[0], 5);
  EXPECT_EQ(gathered[3], 2);
  float acc[6] = {};
  const float scales[] = {2.0f, -1.0f};
  backend_->ScatterAddRows(gathered, 2, rows, scales, 2, acc);
  EXPECT_EQ(acc[4], 10);
  EXPECT_EQ(acc[5], 12);
  EXPECT_EQ(acc[0], -1);
  EXPECT_EQ(acc[2], 0);
  float x[4] = {1, 1, 2, 2};
  const float g[] = {0.0f, 100.0f};
  backend_->ScaleRowsBySigmoid(x, 2, 2, g);
  EXPECT_FLOAT_EQ(x[0], 0.5f);
  EXPECT_FLOAT_EQ(x[3], 2.0f);
}

}  // namespace
}  // namespace moe::runtime
