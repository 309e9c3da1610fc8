// Every Backend operation against a plain double-precision reference, on random inputs, odd sizes
// and mixed batches. It runs on the CPU backend and, where a GPU is visible, on the CUDA backend
// with the same inputs: fp32 activations must land within 1e-5 of the reference, bf16 ones within
// the relative error bf16 rounding gives (about 1e-2).
#include "moe/runtime/backend.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "backend_test_util.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moe/runtime/backend_cpu.h"
#include "moe/runtime/routing.h"

namespace moe::runtime {
namespace {

using core::DType;
using testing_util::BackendKind;
using testing_util::Random;

class BackendTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    auto backend = testing_util::MakeBackend(GetParam());
    if (!backend.ok()) GTEST_SKIP() << backend.status();
    b_ = std::move(*backend);
    if (GetParam() == BackendKind::kCpuOnPoolThreads) {
      pool_ = testing_util::TinyPool(3);
      ASSERT_NE(pool_, nullptr);
      b_->UseHostThreads(&pool_->host_threads());
    }
    ASSERT_TRUE(b_->ReserveArena(64 << 20, 1 << 20).ok());
    // Scratch for the largest case of each test: Linear's 257 rows of 2048 biased outputs, the
    // attention cases' heads and contexts, the MoE cases' experts.
    Backend::StepLimits limits;
    limits.max_tokens = 512;
    limits.max_logit_rows = 64;
    limits.max_context = 256;
    limits.num_heads = 8;
    limits.head_dim = 128;
    limits.vocab = 1024;
    limits.hidden = 64;
    limits.num_experts = 8;
    limits.top_k = 3;
    limits.moe_intermediate = 40;
    limits.max_bias_width = 2048;
    const absl::Status scratch = b_->ReserveScratch(limits);
    ASSERT_TRUE(scratch.ok()) << scratch;
  }
  bool bf16() const { return b_->activation_dtype() == DType::kBF16; }
  // Relative error bound for results in the activation dtype.
  double tolerance() const { return bf16() ? 1.5e-2 : 1e-5; }

  // A device tensor holding `host` in `dtype`.
  Tensor Put(const std::vector<float>& host, int64_t rows, int64_t cols, DType dtype) {
    auto t = testing_util::Upload(*b_, host, rows, cols, dtype);
    EXPECT_TRUE(t.ok()) << t.status();
    buffers_.push_back(std::move(*t));
    return buffers_.back()->tensor();
  }
  Tensor PutInts(const std::vector<int32_t>& host, int64_t rows, int64_t cols) {
    auto t = b_->Allocate(DType::kI32, rows, cols);
    EXPECT_TRUE(t.ok());
    b_->CopyFromHost(host.data(), (*t)->tensor());
    buffers_.push_back(std::move(*t));
    return buffers_.back()->tensor();
  }
  // A device tensor of NaNs, so that anything left unwritten shows.
  Tensor Poisoned(int64_t rows, int64_t cols, DType dtype) {
    return Put(std::vector<float>(rows * cols, NAN), rows, cols, dtype);
  }
  std::vector<float> Get(const Tensor& t) {
    auto v = testing_util::Download(*b_, t);
    EXPECT_TRUE(v.ok()) << v.status();
    return *v;
  }
  std::unique_ptr<DeviceWeight> Weight(const std::vector<float>& w, core::Shape shape, DType dtype,
                                       WeightUse use = WeightUse::kMatrix) {
    hosts_.push_back(testing_util::HostTensor(w, dtype));
    auto weight = b_->PrepareWeight({hosts_.back().data(), dtype, std::move(shape)}, use);
    EXPECT_TRUE(weight.ok()) << weight.status();
    return std::move(*weight);
  }

  std::unique_ptr<experts::ExpertPool> pool_;  // whose threads b_ runs on, with kCpuOnPoolThreads
  std::unique_ptr<Backend> b_;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers_;
  std::vector<std::vector<uint8_t>> hosts_;
};

// Values a bf16 activation holds: the reference starts from what the backend was given.
std::vector<float> AsInput(const std::vector<float>& v, DType dtype) {
  if (dtype != DType::kBF16) return v;
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = core::Bf16ToFloat(core::FloatToBf16(v[i]));
  return out;
}

TEST_P(BackendTest, LinearMatchesReferenceForBf16AndF32Weights) {
  const DType act = b_->activation_dtype();
  for (int64_t rows : {1, 3, 40, 257}) {
    // n = 1 and 60: a shared expert's gate and a router of 60 experts (not multiples of 8).
    for (auto [n, k] : {std::pair<int64_t, int64_t>{24, 40}, {64, 128}, {40, 2048}, {1, 64}, {60, 128}}) {
      for (DType wtype : {DType::kBF16, DType::kF32}) {
        for (bool f32_out : {true, false}) {
          std::vector<float> x = AsInput(Random(rows * k, 1), act), w = Random(n * k, 2, 0.1f), bias = Random(n, 3);
          const std::vector<float> wq = AsInput(w, wtype == DType::kBF16 || bf16() ? DType::kBF16 : DType::kF32);
          auto weight = Weight(w, {n, k}, wtype);
          auto b = Weight(bias, {n}, DType::kF32, WeightUse::kVector);
          const DType out_type = f32_out ? DType::kF32 : act;
          Tensor out = Poisoned(rows, n, out_type);
          b_->Linear(Put(x, rows, k, act), *weight, b.get(), out);
          const std::vector<float> got = Get(out);
          double err = 0, norm = 0;
          for (int64_t t = 0; t < rows; ++t) {
            for (int64_t j = 0; j < n; ++j) {
              double want = bias[j];
              for (int64_t i = 0; i < k; ++i) want += double(x[t * k + i]) * wq[j * k + i];
              err += (want - got[t * n + j]) * (want - got[t * n + j]);
              norm += want * want;
            }
          }
          EXPECT_LT(std::sqrt(err / norm), f32_out && !bf16() ? 1e-6 : tolerance())
              << "rows=" << rows << " n=" << n << " k=" << k << " weights " << core::DTypeName(wtype);
        }
      }
    }
  }
}

// The CPU backend with --weight-format int8/int4: each Linear through the expert pool's packed
// kernels, on odd shapes (a last block of 16 rows cut short, columns not a multiple of 64), for one
// token and many, with a bias and fused parts, against the fp32 product.
TEST(PackedLinearTest, PackedLinearWeightsMatchTheFp32Product) {
  for (const auto format : {experts::ExpertFormat::kInt8, experts::ExpertFormat::kInt4}) {
    auto b = CreateCpuBackend(2, WeightPolicy::Uniform(format, 32));
    for (const auto& [rows, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 60, 100}, {37, 257, 192}, {3, 16, 64}}) {
      const std::vector<float> w = Random(n * k, 7), x = Random(rows * k, 8), bias = Random(n, 9);
      const std::vector<uint8_t> wh = testing_util::HostTensor(w, DType::kBF16);
      // Two parts stacked (as a fused QKV is): the first half of the rows, then the rest.
      const int64_t n0 = n / 2;
      auto weight = b->PrepareFusedWeight({core::TensorView{wh.data(), DType::kBF16, {n0, k}},
                                           core::TensorView{wh.data() + n0 * k * 2, DType::kBF16, {n - n0, k}}},
                                          WeightUse::kMatrix);
      ASSERT_TRUE(weight.ok()) << weight.status();
      const std::vector<uint8_t> bh = testing_util::HostTensor(bias, DType::kF32);
      auto bw = b->PrepareWeight(core::TensorView{bh.data(), DType::kF32, {n}}, WeightUse::kVector);
      ASSERT_TRUE(bw.ok());
      std::vector<float> out(rows * n, NAN), xs = x;
      b->Linear(Tensor{xs.data(), DType::kF32, rows, k}, **weight, bw->get(), Tensor{out.data(), DType::kF32, rows, n});
      double err = 0, ref = 0;
      for (int64_t t = 0; t < rows; ++t) {
        for (int64_t j = 0; j < n; ++j) {
          double want = bias[j];
          for (int64_t c = 0; c < k; ++c)
            want += double(core::Bf16ToFloat(core::FloatToBf16(w[j * k + c]))) * x[t * k + c];
          err += (out[t * n + j] - want) * (out[t * n + j] - want);
          ref += want * want;
        }
      }
      const double rel = std::sqrt(err / ref);
      // int4 in groups of 32 (q in [-8, 7]) as the expert pool's own test bounds it.
      EXPECT_LT(rel, format == experts::ExpertFormat::kInt8 ? 2e-2 : 0.2)
          << experts::FormatName(format) << " rows " << rows << " n " << n << " k " << k;
    }
  }
}

// The CPU backend's Linears give the same bits on an expert pool's threads as on its own, for
// bf16 weights (fp32 math) and packed int8 ones (VNNI, and AMX from 16 rows where the CPU has it):
// the threads share out the output columns, and no column's sum depends on which thread does it.
TEST(CpuBackendThreadsTest, LinearsGiveTheSameBitsOnThePoolsThreads) {
  auto pool = testing_util::TinyPool(3);
  ASSERT_NE(pool, nullptr);
  for (const auto format : {experts::ExpertFormat::kBF16, experts::ExpertFormat::kInt8}) {
    auto own = CreateCpuBackend(2, WeightPolicy::Uniform(format, 32)),
         lent = CreateCpuBackend(2, WeightPolicy::Uniform(format, 32));
    lent->UseHostThreads(&pool->host_threads());
    EXPECT_EQ(lent->host_threads(), &pool->host_threads());
    for (const auto& [rows, n, k] :
         {std::tuple<int64_t, int64_t, int64_t>{1, 2048, 256}, {37, 257, 192}, {3, 60, 64}}) {
      const std::vector<uint8_t> wh = testing_util::HostTensor(Random(n * k, 7), DType::kBF16);
      std::vector<float> x = Random(rows * k, 8), a(rows * n, NAN), b(rows * n, NAN);
      const core::TensorView view{wh.data(), DType::kBF16, {n, k}};
      auto wa = own->PrepareWeight(view, WeightUse::kMatrix), wb = lent->PrepareWeight(view, WeightUse::kMatrix);
      ASSERT_TRUE(wa.ok() && wb.ok());
      own->Linear(Tensor{x.data(), DType::kF32, rows, k}, **wa, nullptr, Tensor{a.data(), DType::kF32, rows, n});
      lent->Linear(Tensor{x.data(), DType::kF32, rows, k}, **wb, nullptr, Tensor{b.data(), DType::kF32, rows, n});
      ASSERT_TRUE(lent->Synchronize().ok());
      EXPECT_EQ(a, b) << experts::FormatName(format) << " rows " << rows << " n " << n << " k " << k;
    }
    lent->UseHostThreads(nullptr);
    EXPECT_EQ(lent->host_threads(), nullptr);
  }
}

TEST_P(BackendTest, FusedWeightsStackTheirParts) {
  const int64_t k = 32;
  std::vector<float> a = Random(8 * k, 4, 0.1f), c = Random(16 * k, 5, 0.1f), x = Random(2 * k, 6);
  std::vector<uint8_t> ha = testing_util::HostTensor(a, DType::kBF16), hc = testing_util::HostTensor(c, DType::kBF16);
  auto fused = b_->PrepareFusedWeight({{ha.data(), DType::kBF16, {8, k}}, {hc.data(), DType::kBF16, {16, k}}},
                                      WeightUse::kMatrix);
  ASSERT_TRUE(fused.ok()) << fused.status();
  EXPECT_EQ((*fused)->rows(), 24);
  Tensor out = Poisoned(2, 24, DType::kF32);
  b_->Linear(Put(x, 2, k, b_->activation_dtype()), **fused, nullptr, out);
  const std::vector<float> got = Get(out);
  const std::vector<float> xq = AsInput(x, b_->activation_dtype()), aq = AsInput(a, DType::kBF16),
                           cq = AsInput(c, DType::kBF16);
  for (int t = 0; t < 2; ++t) {
    for (int j = 0; j < 24; ++j) {
      double want = 0;
      for (int i = 0; i < k; ++i) want += double(xq[t * k + i]) * (j < 8 ? aq[j * k + i] : cq[(j - 8) * k + i]);
      EXPECT_NEAR(got[t * 24 + j], want, 1e-4 + 1e-2 * std::abs(want) * bf16());
    }
  }
}

TEST_P(BackendTest, AddRmsNormAddsTheResidualThenNorms) {
  for (int64_t cols : {7, 128, 2048, 5120}) {
    const int64_t rows = 33;
    std::vector<float> x = Random(rows * cols, 7), d = Random(rows * cols, 8), w = Random(cols, 9);
    Tensor xt = Put(x, rows, cols, DType::kF32), dt = Put(d, rows, cols, DType::kF32);
    auto wt = Weight(w, {cols}, DType::kF32, WeightUse::kVector);
    Tensor out = Poisoned(rows, cols, b_->activation_dtype());
    b_->AddRmsNorm(xt, &dt, *wt, 1e-6f, out);
    const std::vector<float> got = Get(out), sum = Get(xt);
    double err = 0, norm = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < cols; ++i) {
        const double s = double(x[r * cols + i]) + d[r * cols + i];
        EXPECT_NEAR(sum[r * cols + i], s, 1e-5 * (1 + std::abs(s)));
        ss += s * s;
      }
      const double inv = 1 / std::sqrt(ss / cols + 1e-6);
      for (int64_t i = 0; i < cols; ++i) {
        const double want = w[i] * (double(x[r * cols + i]) + d[r * cols + i]) * inv;
        err += (want - got[r * cols + i]) * (want - got[r * cols + i]);
        norm += want * want;
      }
    }
    EXPECT_LT(std::sqrt(err / norm), bf16() ? 5e-3 : 1e-6) << "cols=" << cols;
  }
}

TEST_P(BackendTest, SiluMulAndEmbedAndGather) {
  const DType act = b_->activation_dtype();
  const int64_t rows = 5, width = 129;
  std::vector<float> gu = AsInput(Random(rows * 2 * width, 10), act);
  Tensor out = Poisoned(rows, width, act);
  b_->SiluMul(Put(gu, rows, 2 * width, act), out);
  std::vector<float> got = Get(out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; ++i) {
      const double g = gu[r * 2 * width + i], u = gu[r * 2 * width + width + i];
      const double want = g / (1 + std::exp(-g)) * u;
      EXPECT_NEAR(got[r * width + i], want, 1e-5 + 1e-2 * std::abs(want) * bf16());
    }
  }

  const int64_t vocab = 37, hidden = 72;
  std::vector<float> table = Random(vocab * hidden, 11);
  auto tw = Weight(table, {vocab, hidden}, DType::kBF16, WeightUse::kEmbedding);
  StepInputs in;
  in.token_ids = {36, 0, 5, 5};
  in.positions = {0, 1, 2, 3};
  in.row_seq = {0, 0, 0, 0};
  in.seq_start = {0, 4};
  in.seq_len = {4};
  in.block_table = {0};
  in.max_blocks = 1;
  in.max_q_len = 4;
  in.max_kv_len = 4;
  in.logit_rows = {3, 0};
  auto step = b_->BeginStep(in);
  ASSERT_TRUE(step.ok()) << step.status();
  Tensor x = Poisoned(4, hidden, DType::kF32);
  b_->Embed(*tw, *step, x);
  got = Get(x);
  const std::vector<float> tq = AsInput(table, DType::kBF16);
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < hidden; ++i) EXPECT_EQ(got[t * hidden + i], tq[in.token_ids[t] * hidden + i]);
  }
  Tensor gathered = Poisoned(2, hidden, DType::kF32);
  b_->GatherRows(x, step->logit_rows, gathered);
  got = Get(gathered);
  for (int i = 0; i < hidden; ++i) {
    EXPECT_EQ(got[i], tq[5 * hidden + i]);
    EXPECT_EQ(got[hidden + i], tq[36 * hidden + i]);
  }
}

TEST_P(BackendTest, AddSharedExpertScalesBySigmoid) {
  const int64_t rows = 3, cols = 50;
  std::vector<float> o = Random(rows * cols, 12), s = Random(rows * cols, 13), g = {0.0f, 3.0f, -2.0f};
  for (bool gated : {true, false}) {
    Tensor out = Put(o, rows, cols, DType::kF32);
    Tensor gate = Put(g, rows, 1, DType::kF32);
    b_->AddSharedExpert(out, Put(s, rows, cols, DType::kF32), gated ? &gate : nullptr);
    const std::vector<float> got = Get(out);
    for (int64_t r = 0; r < rows; ++r) {
      const double f = gated ? 1 / (1 + std::exp(-double(g[r]))) : 1.0;
      for (int64_t i = 0; i < cols; ++i) EXPECT_NEAR(got[r * cols + i], o[r * cols + i] + f * s[r * cols + i], 1e-5);
    }
  }
}

TEST_P(BackendTest, RouteMatchesTheRoutingFunctions) {
  RoutingSpec softmax;
  softmax.num_experts = 60;
  softmax.top_k = 4;
  RoutingSpec renorm = softmax;
  renorm.normalize_top_k = true;
  RoutingSpec sigmoid;
  sigmoid.scoring = ScoringFunction::kSigmoid;
  sigmoid.num_experts = 64;
  sigmoid.top_k = 6;
  sigmoid.normalize_top_k = true;
  sigmoid.has_correction_bias = true;
  sigmoid.n_group = 8;
  sigmoid.topk_group = 3;
  sigmoid.routed_scaling_factor = 2.5f;
  for (const RoutingSpec& spec : {softmax, renorm, sigmoid}) {
    const int64_t tokens = 37, e = spec.num_experts, k = spec.top_k;
    std::vector<float> logits = Random(tokens * e, 14), bias = Random(e, 15, 0.1f);
    auto bw = Weight(bias, {e}, DType::kF32, WeightUse::kVector);
    Tensor ids = Put(std::vector<float>(tokens * k, 0.0f), tokens, k, DType::kI32);
    Tensor weights = Poisoned(tokens, k, DType::kF32);
    b_->Route(Put(logits, tokens, e, DType::kF32), spec, spec.has_correction_bias ? bw.get() : nullptr, ids, weights);
    std::vector<int32_t> want_ids(tokens * k), got_ids(tokens * k);
    std::vector<float> want_w(tokens * k);
    RouteTokens(spec, logits.data(), tokens, spec.has_correction_bias ? bias.data() : nullptr, want_ids.data(),
                want_w.data());
    b_->CopyToHost(ids, got_ids.data());
    ASSERT_TRUE(b_->Synchronize().ok());
    const std::vector<float> got_w = Get(weights);
    EXPECT_EQ(got_ids, want_ids);
    for (int64_t i = 0; i < tokens * k; ++i) EXPECT_NEAR(got_w[i], want_w[i], 1e-5 * (1 + std::abs(want_w[i])));
  }
}

// The split of each row's picks between the host and the backend's copies of some experts: the
// picks of each side keep their weights, the others become weight-0 slots of an expert that side
// reads for the row anyway. Rows with picks on both sides, on one side only, and repeated experts.
TEST_P(BackendTest, SplitRoutingSendsEachPickToOneSide) {
  const int64_t e = 16, k = 4;
  std::vector<int32_t> index(e, -1);
  index[3] = 0;
  index[7] = 1;
  index[12] = 2;
  const std::vector<int32_t> ids = {3, 5, 7, 9, 0, 1, 2, 4, 3, 7, 12, 3, 12, 6, 6, 1};
  std::vector<float> weights(ids.size());
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = 0.1f * static_cast<float>(i + 1);
  const int64_t rows = static_cast<int64_t>(ids.size()) / k;
  Tensor host_ids = PutInts(std::vector<int32_t>(rows * k, -5), rows, k);
  Tensor backend_ids = PutInts(std::vector<int32_t>(rows * k, -5), rows, k);
  Tensor host_w = Poisoned(rows, k, DType::kF32), backend_w = Poisoned(rows, k, DType::kF32);
  b_->SplitRouting(PutInts(ids, rows, k), Put(weights, rows, k, DType::kF32), PutInts(index, 1, e), host_ids, host_w,
                   backend_ids, backend_w);
  std::vector<int32_t> got_host(rows * k), got_backend(rows * k);
  b_->CopyToHost(host_ids, got_host.data());
  b_->CopyToHost(backend_ids, got_backend.data());
  ASSERT_TRUE(b_->Synchronize().ok());
  const std::vector<float> got_hw = Get(host_w), got_bw = Get(backend_w);
  // By hand: row 0 has host picks 5, 9 and backend picks 3 (index 0), 7 (index 1); each side skips
  // the other's slots.
  EXPECT_EQ(std::vector<int32_t>(got_host.begin(), got_host.begin() + 4), (std::vector<int32_t>{-1, 5, -1, 9}));
  EXPECT_EQ(std::vector<int32_t>(got_backend.begin(), got_backend.begin() + 4), (std::vector<int32_t>{0, -1, 1, -1}));
  EXPECT_EQ(std::vector<float>(got_hw.begin(), got_hw.begin() + 4), (std::vector<float>{0, 0.2f, 0, 0.4f}));
  // Row 2 is all on the backend: the host skips every slot, reading no expert for it.
  EXPECT_EQ(std::vector<int32_t>(got_host.begin() + 8, got_host.begin() + 12), (std::vector<int32_t>{-1, -1, -1, -1}));
  EXPECT_EQ(std::vector<float>(got_hw.begin() + 8, got_hw.begin() + 12), (std::vector<float>{0, 0, 0, 0}));
  // Every row as the CPU's SplitPicks has it.
  for (int64_t r = 0; r < rows; ++r) {
    int32_t hi[4], bi[4];
    float hw[4], bw[4];
    SplitPicks(ids.data() + r * k, weights.data() + r * k, k, index.data(), hi, hw, bi, bw);
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(got_host[r * k + j], hi[j]) << "row " << r;
      EXPECT_EQ(got_backend[r * k + j], bi[j]) << "row " << r;
      EXPECT_EQ(got_hw[r * k + j], hw[j]) << "row " << r;
      EXPECT_EQ(got_bw[r * k + j], bw[j]) << "row " << r;
    }
  }
}

// The picks of real rows add to the counts (skipped slots, -1, do not); a graph step's padding row,
// whose block table holds only the scratch block, is left out.
TEST_P(BackendTest, CountPicksAddsRealRowsOnly) {
  const int e = 6, k = 2, scratch = 9;
  StepInputs in;
  in.token_ids = {1, 2, 3, 0};
  in.positions = {0, 1, 5, 0};
  in.row_seq = {0, 0, 1, 2};
  in.seq_start = {0, 2, 3, 4};
  in.seq_len = {2, 6, 1};
  in.block_table = {0, scratch, 1, 2, scratch, scratch};  // sequence 2 is padding
  in.max_blocks = 2;
  in.max_q_len = 2;
  in.max_kv_len = 6;
  in.logit_rows = {1, 2, 3};
  auto step = b_->BeginStep(in);
  ASSERT_TRUE(step.ok()) << step.status();
  const std::vector<int32_t> ids = {0, 5, 5, -1, 2, 5, 3, 3};
  Tensor counts = PutInts({5, 0, 0, 0, 0, 1}, 1, e);
  b_->CountPicks(PutInts(ids, 4, k), *step, scratch, counts);
  b_->CountPicks(PutInts(ids, 4, k), *step, scratch, counts);  // counts add up across calls
  std::vector<int32_t> got(e);
  b_->CopyToHost(counts, got.data());
  ASSERT_TRUE(b_->Synchronize().ok());
  EXPECT_EQ(got, (std::vector<int32_t>{7, 0, 2, 0, 0, 7}));
}

// Replacing one held expert's weights changes that slot only.
TEST_P(BackendTest, ReplaceExpertChangesOnlyItsSlot) {
  const DType act = b_->activation_dtype();
  const int h = 32, width = 16;
  std::vector<std::vector<uint8_t>> host;
  auto matrix = [&](uint32_t seed, int rows, int cols) {
    host.push_back(testing_util::HostTensor(AsInput(Random(rows * cols, seed, 0.3f), DType::kBF16), DType::kBF16));
    return core::TensorView{host.back().data(), DType::kBF16, {rows, cols}};
  };
  host.reserve(16);
  std::vector<core::TensorView> g, u, d;
  for (int i = 0; i < 4; ++i) {  // experts 0-2 prepared; expert 3 is the newcomer
    g.push_back(matrix(100 + i, width, h));
    u.push_back(matrix(200 + i, width, h));
    d.push_back(matrix(300 + i, h, width));
  }
  auto three = b_->PrepareExperts({g[0], g[1], g[2]}, {u[0], u[1], u[2]}, {d[0], d[1], d[2]});
  auto reference = b_->PrepareExperts({g[0], g[3], g[2]}, {u[0], u[3], u[2]}, {d[0], d[3], d[2]});
  ASSERT_TRUE(three.ok() && reference.ok());
  ASSERT_TRUE(b_->ReplaceExpert(**three, 1, g[3], u[3], d[3]).ok());
  EXPECT_EQ(b_->ReplaceExpert(**three, 3, g[3], u[3], d[3]).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<float> x = AsInput(Random(3 * h, 7), act);
  const std::vector<int32_t> ids = {0, 1, 1, 2, 2, 0};
  const std::vector<float> w = {0.5f, 0.25f, 1.0f, 0.75f, 0.3f, 0.6f};
  Tensor got = Poisoned(3, h, DType::kF32), want = Poisoned(3, h, DType::kF32);
  b_->MoeExperts(Put(x, 3, h, act), PutInts(ids, 3, 2), Put(w, 3, 2, DType::kF32), **three, got);
  b_->MoeExperts(Put(x, 3, h, act), PutInts(ids, 3, 2), Put(w, 3, 2, DType::kF32), **reference, want);
  const std::vector<float> a = Get(got), b = Get(want);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  EXPECT_GT(scale, 0.0);
  EXPECT_LE(worst, 1e-6 * scale);  // the same kernel over the same weights (up to the order of atomics)
}

TEST_P(BackendTest, MoeExpertsWeightTheChosenExperts) {
  const DType act = b_->activation_dtype();
  const int e = 8, k = 3, h = 64, width = 40;
  for (int64_t tokens : {1, 5, 70}) {
    std::vector<std::vector<float>> g(e), u(e), d(e);
    std::vector<std::vector<uint8_t>> hg(e), hu(e), hd(e);
    std::vector<core::TensorView> gv, uv, dv;
    for (int i = 0; i < e; ++i) {
      g[i] = AsInput(Random(width * h, 20 + i, 0.2f), DType::kBF16);
      u[i] = AsInput(Random(width * h, 40 + i, 0.2f), DType::kBF16);
      d[i] = AsInput(Random(h * width, 60 + i, 0.2f), DType::kBF16);
      hg[i] = testing_util::HostTensor(g[i], DType::kBF16);
      hu[i] = testing_util::HostTensor(u[i], DType::kBF16);
      hd[i] = testing_util::HostTensor(d[i], DType::kBF16);
      gv.push_back({hg[i].data(), DType::kBF16, {width, h}});
      uv.push_back({hu[i].data(), DType::kBF16, {width, h}});
      dv.push_back({hd[i].data(), DType::kBF16, {h, width}});
    }
    auto experts = b_->PrepareExperts(gv, uv, dv);
    ASSERT_TRUE(experts.ok()) << experts.status();
    std::vector<float> x = AsInput(Random(tokens * h, 80), act), w = Random(tokens * k, 81);
    std::vector<int32_t> ids(tokens * k);
    std::mt19937 rng(82);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> perm(e);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::copy(perm.begin(), perm.begin() + k, ids.begin() + t * k);
    }
    Tensor out = Poisoned(tokens, h, DType::kF32);
    b_->MoeExperts(Put(x, tokens, h, act), PutInts(ids, tokens, k), Put(w, tokens, k, DType::kF32), **experts, out);
    const std::vector<float> got = Get(out);
    double err = 0, norm = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> want(h, 0.0);
      for (int j = 0; j < k; ++j) {
        const int ex = ids[t * k + j];
        std::vector<double> a(width);
        for (int r = 0; r < width; ++r) {
          double gs = 0, us = 0;
          for (int i = 0; i < h; ++i) {
            gs += double(x[t * h + i]) * g[ex][r * h + i];
            us += double(x[t * h + i]) * u[ex][r * h + i];
          }
          a[r] = gs / (1 + std::exp(-gs)) * us;
        }
        for (int i = 0; i < h; ++i) {
          double y = 0;
          for (int r = 0; r < width; ++r) y += d[ex][i * width + r] * a[r];
          want[i] += w[t * k + j] * y;
        }
      }
      for (int i = 0; i < h; ++i) {
        err += (want[i] - got[t * h + i]) * (want[i] - got[t * h + i]);
        norm += want[i] * want[i];
      }
    }
    EXPECT_LT(std::sqrt(err / norm), tolerance()) << "tokens=" << tokens;
  }
}

// One layer's attention over a mixed step (prefill chunks from 0 and from a cached offset, decode
// rows, partly filled blocks in shuffled order), then a decode step over what the first stored.
TEST_P(BackendTest, AttentionMatchesFullAttentionOverMixedSteps) {
  const DType act = b_->activation_dtype();
  struct Case {
    int heads, kv_heads, head_dim, rotary_dim, block;
    bool qk_norm;
  };
  for (const Case& c : {Case{4, 2, 32, 32, 4, true}, Case{8, 1, 128, 64, 16, false}, Case{4, 4, 64, 64, 16, true}}) {
    const int d = c.head_dim, qw = c.heads * d, kvw = c.kv_heads * d, width = qw + 2 * kvw;
    // Sequences: (cached positions before the step, new tokens in the step).
    const std::vector<std::pair<int, int>> seqs = {{0, 9}, {0, 1}, {21, 1}, {13, 6}, {40, 1}};
    const int num_blocks = 64;
    ModelSpec spec;
    spec.num_kv_heads = c.kv_heads;
    spec.head_dim = d;
    auto cache = b_->CreateKvCache(PlanCache(spec, Range{0, 1}, CacheOptions{c.block, act}), num_blocks);
    ASSERT_TRUE(cache.ok()) << cache.status();
    std::vector<int32_t> free_blocks(num_blocks);
    std::iota(free_blocks.begin(), free_blocks.end(), 0);
    std::shuffle(free_blocks.begin(), free_blocks.end(), std::mt19937(90));
    // Every sequence's whole history of q/k/v rows (the pre-RoPE qkv projection output).
    std::vector<std::vector<float>> history(seqs.size());
    std::vector<std::vector<int32_t>> tables(seqs.size());
    int next_block = 0;
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int total = seqs[s].first + seqs[s].second;
      history[s] = AsInput(Random(int64_t{total} * width, 100 + s), act);
      for (int i = 0; i < BlocksFor(total, c.block); ++i) tables[s].push_back(free_blocks[next_block++]);
    }
    std::vector<float> qn = Random(d, 91, 0.3f), kn = Random(d, 92, 0.3f);
    for (float& v : qn) v += 1;
    for (float& v : kn) v += 1;
    auto qnw = Weight(qn, {d}, DType::kF32, WeightUse::kVector), knw = Weight(kn, {d}, DType::kF32, WeightUse::kVector);
    std::vector<float> inv_freq(c.rotary_dim / 2);
    for (int i = 0; i < c.rotary_dim / 2; ++i) inv_freq[i] = 1.0f / std::pow(10000.0f, 2.0f * i / c.rotary_dim);
    Tensor freq = Put(inv_freq, 1, c.rotary_dim / 2, DType::kF32);

    // Runs one step over rows [from[s], to[s]) of each sequence.
    auto run = [&](const std::vector<std::pair<int, int>>& ranges) {
      StepInputs in;
      std::vector<float> qkv;
      int max_kv = 0;
      for (const auto& [from, to] : ranges) max_kv = std::max(max_kv, to);
      in.max_blocks = BlocksFor(max_kv, c.block);
      for (size_t s = 0; s < ranges.size(); ++s) {
        in.seq_start.push_back(static_cast<int32_t>(in.positions.size()));
        in.seq_len.push_back(ranges[s].second);
        in.max_q_len = std::max(in.max_q_len, ranges[s].second - ranges[s].first);
        for (int p = ranges[s].first; p < ranges[s].second; ++p) {
          in.positions.push_back(p);
          in.row_seq.push_back(static_cast<int32_t>(s));
          in.token_ids.push_back(0);
          qkv.insert(qkv.end(), history[s].begin() + int64_t{p} * width, history[s].begin() + int64_t{p + 1} * width);
        }
        std::vector<int32_t> row(in.max_blocks, (*cache)->scratch_block());
        std::copy(tables[s].begin(), tables[s].begin() + BlocksFor(ranges[s].second, c.block), row.begin());
        in.block_table.insert(in.block_table.end(), row.begin(), row.end());
      }
      in.seq_start.push_back(static_cast<int32_t>(in.positions.size()));
      in.max_kv_len = max_kv;
      const int64_t rows = in.num_tokens();
      auto step = b_->BeginStep(in);
      EXPECT_TRUE(step.ok()) << step.status();
      AttentionArgs a;
      a.qkv = Put(qkv, rows, width, act);
      a.q = Poisoned(rows, qw, act);
      a.out = Poisoned(rows, qw, act);
      a.num_heads = c.heads;
      a.num_kv_heads = c.kv_heads;
      a.head_dim = d;
      a.rotary_dim = c.rotary_dim;
      a.scale = 1.0f / std::sqrt(float(d));
      a.eps = 1e-6f;
      a.q_norm = c.qk_norm ? qnw.get() : nullptr;
      a.k_norm = c.qk_norm ? knw.get() : nullptr;
      a.inv_freq = &freq;
      a.cache = cache->get();
      a.layer = 0;
      b_->Attention(a, *step);
      return std::make_pair(in, Get(a.out));
    };
    // The reference: q or k of sequence s at position p, normed and rotated in double.
    auto head = [&](size_t s, int p, int offset, const std::vector<float>& norm) {
      std::vector<double> v(history[s].begin() + int64_t{p} * width + offset,
                            history[s].begin() + int64_t{p} * width + offset + d);
      if (c.qk_norm) {
        double ss = 0;
        for (double x : v) ss += x * x;
        const double inv = 1 / std::sqrt(ss / d + 1e-6);
        for (int i = 0; i < d; ++i) v[i] = v[i] * inv * norm[i];
      }
      const int half = c.rotary_dim / 2;
      for (int i = 0; i < half; ++i) {
        const double angle = double(float(p) * inv_freq[i]);
        const double a = v[i], bb = v[i + half];
        v[i] = a * std::cos(angle) - bb * std::sin(angle);
        v[i + half] = bb * std::cos(angle) + a * std::sin(angle);
      }
      return v;
    };
    auto check = [&](const StepInputs& in, const std::vector<float>& got) {
      double err = 0, norm = 0;
      const int group = c.heads / c.kv_heads;
      for (int r = 0; r < in.num_tokens(); ++r) {
        const size_t s = in.row_seq[r];
        const int p = in.positions[r];
        for (int h = 0; h < c.heads; ++h) {
          const int kvh = h / group;
          const std::vector<double> q = head(s, p, h * d, qn);
          std::vector<double> score(p + 1);
          double mx = -1e300, sum = 0;
          for (int j = 0; j <= p; ++j) {
            const std::vector<double> k = head(s, j, qw + kvh * d, kn);
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += q[i] * k[i];
            score[j] = dot / std::sqrt(double(d));
            mx = std::max(mx, score[j]);
          }
          for (double& x : score) sum += x = std::exp(x - mx);
          for (int i = 0; i < d; ++i) {
            double want = 0;
            for (int j = 0; j <= p; ++j)
              want += score[j] / sum * history[s][int64_t{j} * width + qw + kvw + kvh * d + i];
            const double g = got[(int64_t{r} * c.heads + h) * d + i];
            err += (want - g) * (want - g);
            norm += want * want;
          }
        }
      }
      EXPECT_LT(std::sqrt(err / norm), bf16() ? 2e-2 : 1e-5)
          << "heads=" << c.heads << " kv_heads=" << c.kv_heads << " head_dim=" << d;
    };
    // Step 1 fills the cached prefixes (as earlier steps would have); step 2 is the mixed step;
    // step 3 decodes one more token of every sequence.
    std::vector<std::pair<int, int>> prefix, mixed, decode;
    for (const auto& [cached, fresh] : seqs) {
      prefix.push_back({0, std::max(cached, 1)});
      mixed.push_back({cached, cached + fresh});
    }
    auto [in1, out1] = run(prefix);
    check(in1, out1);
    for (size_t s = 0; s < seqs.size(); ++s) {
      if (seqs[s].first == 0) mixed[s] = {0, seqs[s].second};
    }
    auto [in2, out2] = run(mixed);
    check(in2, out2);
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int total = seqs[s].first + seqs[s].second;
      decode.push_back({total - 1, total});
    }
    auto [in3, out3] = run(decode);
    check(in3, out3);
  }
}

// One source, two binaries: runtime_test runs the CPU backend, backend_cuda_test (CTest label
// gpu) the CUDA one.
#if MOE_BACKEND_TEST_CUDA
INSTANTIATE_TEST_SUITE_P(Backends, BackendTest, ::testing::Values(BackendKind::kCuda),
                         [](const auto& info) { return testing_util::BackendKindName(info.param); });
#else
INSTANTIATE_TEST_SUITE_P(Backends, BackendTest, ::testing::Values(BackendKind::kCpu, BackendKind::kCpuOnPoolThreads),
                         [](const auto& info) { return testing_util::BackendKindName(info.param); });
#endif

}  // namespace
}  // namespace moe::runtime
