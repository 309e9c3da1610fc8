#include "moe/experts/expert_pool.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moe/experts/host_threads.h"

namespace moe::experts {
namespace {

using ::testing::HasSubstr;

// Random bf16 experts, as a checkpoint would hold them, and a plain double MoE reference.
class Experts {
 public:
  Experts(const ExpertShape& s, uint32_t seed) : shape_(s) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist;
    const int64_t per = 3 * s.hidden * s.intermediate;
    data_.resize(static_cast<size_t>(s.num_layers) * s.num_experts * per);
    for (auto& v : data_) v = core::FloatToBf16(dist(rng) / std::sqrt(float(s.hidden)));
  }
  const uint16_t* Matrix(int layer, int e, int which) const {
    const int64_t m = shape_.hidden * shape_.intermediate;
    return data_.data() + ((static_cast<int64_t>(layer) * shape_.num_experts + e) * 3 + which) * m;
  }
  ExpertWeightSource Source() const {
    return [this](int layer, int e) -> absl::StatusOr<ExpertWeights> {
      const core::Shape io = {shape_.intermediate, shape_.hidden}, oi = {shape_.hidden, shape_.intermediate};
      return ExpertWeights{{Matrix(layer, e, 0), core::DType::kBF16, io},
                           {Matrix(layer, e, 1), core::DType::kBF16, io},
                           {Matrix(layer, e, 2), core::DType::kBF16, oi}};
    };
  }
  std::vector<double> Reference(int layer, const std::vector<float>& x, const std::vector<int32_t>& ids,
                                const std::vector<float>& w) const {
    const int64_t h = shape_.hidden, inter = shape_.intermediate, k = shape_.top_k, t_count = x.size() / h;
    std::vector<double> out(x.size(), 0.0), mid(inter);
    for (int64_t t = 0; t < t_count; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int e = ids[t * k + j];
        if (e == kSkippedSlot) continue;
        const uint16_t *g = Matrix(layer, e, 0), *u = Matrix(layer, e, 1), *d = Matrix(layer, e, 2);
        for (int64_t i = 0; i < inter; ++i) {
          double gs = 0, us = 0;
          for (int64_t c = 0; c < h; ++c) {
            gs += core::Bf16ToFloat(g[i * h + c]) * double(x[t * h + c]);
            us += core::Bf16ToFloat(u[i * h + c]) * double(x[t * h + c]);
          }
          mid[i] = gs / (1 + std::exp(-gs)) * us;
        }
        for (int64_t c = 0; c < h; ++c) {
          double acc = 0;
          for (int64_t i = 0; i < inter; ++i) acc += core::Bf16ToFloat(d[c * inter + i]) * mid[i];
          out[t * h + c] += w[t * k + j] * acc;
        }
      }
    }
    return out;
  }

 private:
  ExpertShape shape_;
  std::vector<uint16_t> data_;
};

// Odd sizes on purpose: hidden not a multiple of 64, intermediate not a multiple of 16.
ExpertShape SmallShape() { return ExpertShape{2, 8, 3, 96, 40}; }

struct Routing {
  std::vector<float> x, w;
  std::vector<int32_t> ids;
};

Routing RandomRouting(const ExpertShape& s, int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  Routing r;
  r.x.resize(tokens * s.hidden);
  for (float& v : r.x) v = dist(rng);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(s.num_experts);
    for (int e = 0; e < s.num_experts; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < s.top_k; ++j) {
      r.ids.push_back(all[j]);
      r.w.push_back(0.2f + std::uniform_real_distribution<float>(0, 1)(rng));
    }
  }
  return r;
}

struct PoolCase {
  ExpertFormat format;
  std::optional<KernelKind> kernel;
  double tolerance;  // relative RMS error
};

std::string PoolCaseName(const ::testing::TestParamInfo<PoolCase>& info) {
  return std::string(FormatName(info.param.format)) + "_" +
         (info.param.kernel ? KernelName(*info.param.kernel) : "auto");
}

class ExpertPoolTest : public ::testing::TestWithParam<PoolCase> {};

TEST_P(ExpertPoolTest, MatchesThePlainMoe) {
  const PoolCase c = GetParam();
  if (c.kernel) {
    const std::string why = KernelUnsupportedReason(*c.kernel, c.format, core::GetCpuFeatures());
    if (!why.empty()) GTEST_SKIP() << KernelName(*c.kernel) << " not run on this CPU: " << why;
  }
  const ExpertShape shape = SmallShape();
  Experts experts(shape, 1);
  ExpertPoolOptions options;
  options.format = c.format;
  options.kernel = c.kernel;
  options.threads = 2;
  options.progress = false;
  auto pool = ExpertPool::Create(shape, options, experts.Source());
  ASSERT_TRUE(pool.ok()) << pool.status();
  for (int64_t tokens : {1, 5, 70}) {
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      Routing r = RandomRouting(shape, tokens, 10 + tokens + layer);
      std::vector<float> out(r.x.size(), -1.0f);
      ASSERT_TRUE((*pool)->Compute(layer, r.x.data(), tokens, r.ids.data(), r.w.data(), out.data()).ok());
      const std::vector<double> want = experts.Reference(layer, r.x, r.ids, r.w);
      // Relative RMS error: quantization noise over signal.
      double signal = 0, noise = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        signal += want[i] * want[i];
        noise += (out[i] - want[i]) * (out[i] - want[i]);
      }
      const double error = std::sqrt(noise / signal);
      EXPECT_LT(error, c.tolerance) << "tokens=" << tokens << " layer=" << layer;
      RecordProperty("relative_rms_error_" + std::to_string(tokens) + "_" + std::to_string(layer),
                     std::to_string(error));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, ExpertPoolTest,
                         ::testing::Values(PoolCase{ExpertFormat::kBF16, std::nullopt, 1e-5},
                                           PoolCase{ExpertFormat::kBF16, KernelKind::kPortable, 1e-5},
                                           PoolCase{ExpertFormat::kBF16, KernelKind::kAvx512, 1e-5},
                                           PoolCase{ExpertFormat::kBF16, KernelKind::kAvx512Bf16, 1e-2},
                                           PoolCase{ExpertFormat::kBF16, KernelKind::kAmx, 1e-4},
                                           PoolCase{ExpertFormat::kInt8, std::nullopt, 3e-2},
                                           PoolCase{ExpertFormat::kInt8, KernelKind::kPortable, 3e-2},
                                           PoolCase{ExpertFormat::kInt8, KernelKind::kVnni, 3e-2},
                                           PoolCase{ExpertFormat::kInt8, KernelKind::kAmx, 3e-2},
                                           PoolCase{ExpertFormat::kInt4, std::nullopt, 0.2},
                                           PoolCase{ExpertFormat::kInt4, KernelKind::kPortable, 0.2},
                                           PoolCase{ExpertFormat::kInt4, KernelKind::kVnni, 0.2},
                                           PoolCase{ExpertFormat::kInt4, KernelKind::kAmx, 0.2},
                                           PoolCase{ExpertFormat::kFp8, std::nullopt, 5e-2},
                                           PoolCase{ExpertFormat::kFp8, KernelKind::kPortable, 5e-2},
                                           PoolCase{ExpertFormat::kFp8, KernelKind::kAvx512Bf16, 5e-2}),
                         PoolCaseName);

class ExpertPoolBehaviour : public ::testing::Test {
 protected:
  std::unique_ptr<ExpertPool> Make(int threads, ExpertFormat format = ExpertFormat::kInt8,
                                   int64_t linger_us = ExpertPoolOptions().linger_us) {
    ExpertPoolOptions options;
    options.format = format;
    options.threads = threads;
    options.progress = false;
    options.linger_us = linger_us;
    auto pool = ExpertPool::Create(SmallShape(), options, experts_.Source());
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? std::move(*pool) : nullptr;
  }
  Experts experts_{SmallShape(), 2};
};

TEST_F(ExpertPoolBehaviour, SubmitReturnsAndWaitDeliversWhileTheCallerWorks) {
  auto pool = Make(2);
  Routing r = RandomRouting(SmallShape(), 9, 3);
  std::vector<float> out(r.x.size()), again(r.x.size());
  auto ticket = pool->Submit(1, r.x.data(), 9, r.ids.data(), r.w.data(), out.data());
  ASSERT_TRUE(ticket.ok());
  // A second call while one is in flight is refused.
  auto second = pool->Submit(1, r.x.data(), 9, r.ids.data(), r.w.data(), again.data());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->MeasureReadBandwidth(1 << 20, 1), 0.0);  // not during a call
  EXPECT_EQ(pool->MeasureKernelStream(8, 1).all_gbps, 0.0);
  double other_work = 0;
  for (int i = 0; i < 100000; ++i) other_work += std::sqrt(double(i));  // the caller's own work
  ASSERT_TRUE(pool->Wait(*ticket).ok());
  EXPECT_GT(other_work, 0);
  ASSERT_TRUE(pool->Compute(1, r.x.data(), 9, r.ids.data(), r.w.data(), again.data()).ok());
  EXPECT_EQ(out, again);
}

TEST_F(ExpertPoolBehaviour, KernelChoiceFollowsTheTokensPerExpert) {
  const core::CpuFeatures& cpu = core::GetCpuFeatures();
  const bool amx = KernelUnsupportedReason(KernelKind::kAmx, ExpertFormat::kInt8, cpu).empty();
  const bool vnni = KernelUnsupportedReason(KernelKind::kVnni, ExpertFormat::kInt8, cpu).empty();
  const KernelKind small = vnni ? KernelKind::kVnni : KernelKind::kPortable;
  auto int8 = Make(2, ExpertFormat::kInt8);
  auto int4 = Make(2, ExpertFormat::kInt4);
  EXPECT_EQ(int8->KernelFor(1), small);
  EXPECT_EQ(int8->KernelFor(15), small);
  EXPECT_EQ(int8->KernelFor(16), amx ? KernelKind::kAmx : small);
  // int4 stays on VNNI longer: an AMX step over a group of 32 costs what an int8 step does.
  EXPECT_EQ(int4->KernelFor(16), small);
  EXPECT_EQ(int4->KernelFor(23), small);
  EXPECT_EQ(int4->KernelFor(24), amx ? KernelKind::kAmx : small);
  ASSERT_TRUE(int4->SetKernel(small).ok());
  EXPECT_EQ(int4->KernelFor(64), small);  // forced
}

TEST_F(ExpertPoolBehaviour, KernelStreamTimesEveryPartAndLeavesCallsAsTheyWere) {
  // Every format, with the kernel the pool picks for 16 tokens per expert and with each kernel
  // this CPU has forced: three positive rates, and a call afterwards gives the same bits.
  for (ExpertFormat format : {ExpertFormat::kBF16, ExpertFormat::kInt8, ExpertFormat::kInt4}) {
    auto pool = Make(2, format);
    Routing r = RandomRouting(SmallShape(), 24, 5);
    std::vector<float> before(r.x.size()), after(r.x.size());
    ASSERT_TRUE(pool->Compute(1, r.x.data(), 24, r.ids.data(), r.w.data(), before.data()).ok());
    std::vector<std::optional<KernelKind>> kinds = {std::nullopt};
    for (KernelKind k : KernelsFor(format)) {
      if (KernelUnsupportedReason(k, format, core::GetCpuFeatures()).empty()) kinds.push_back(k);
    }
    for (const std::optional<KernelKind>& kind : kinds) {
      const std::string name = std::string(FormatName(format)) + " " + (kind ? KernelName(*kind) : "chosen");
      ASSERT_TRUE(pool->SetKernel(kind).ok()) << name;
      const ExpertPool::KernelStream ks = pool->MeasureKernelStream(16, 1);
      EXPECT_GT(ks.gate_up_gbps, 0.0) << name;
      EXPECT_GT(ks.down_gbps, 0.0) << name;
      EXPECT_GT(ks.all_gbps, 0.0) << name;
      EXPECT_EQ(pool->MeasureKernelStream(0).all_gbps, 0.0) << name;
    }
    ASSERT_TRUE(pool->SetKernel(std::nullopt).ok());
    ASSERT_TRUE(pool->Compute(1, r.x.data(), 24, r.ids.data(), r.w.data(), after.data()).ok());
    EXPECT_EQ(before, after) << FormatName(format);
  }
}

TEST_F(ExpertPoolBehaviour, CallsAgreeWhetherTheThreadsLingeredOrSlept) {
  // After a call the threads stay awake for linger_us. Calls back to back (the lingering threads
  // take them), after a pause longer than that (they are started again), during the caller's own
  // work and with a bandwidth measurement in between (it sends them away) all give the same bits.
  const ExpertShape shape = SmallShape();
  Routing a = RandomRouting(shape, 1, 21), b = RandomRouting(shape, 40, 22);
  std::vector<float> want_a(a.x.size()), want_b(b.x.size());
  {
    auto pool = Make(1);
    ASSERT_TRUE(pool->Compute(0, a.x.data(), 1, a.ids.data(), a.w.data(), want_a.data()).ok());
    ASSERT_TRUE(pool->Compute(1, b.x.data(), 40, b.ids.data(), b.w.data(), want_b.data()).ok());
  }
  for (int64_t linger_us : {int64_t{0}, int64_t{300}, int64_t{100000}}) {
    ExpertPoolOptions options;
    options.format = ExpertFormat::kInt8;
    options.threads = 3;
    options.progress = false;
    options.linger_us = linger_us;
    auto pool = ExpertPool::Create(shape, options, experts_.Source());
    ASSERT_TRUE(pool.ok()) << pool.status();
    for (int round = 0; round < 3; ++round) {
      std::vector<float> out_a(a.x.size(), -1.0f), out_b(b.x.size(), -1.0f);
      ASSERT_TRUE((*pool)->Compute(0, a.x.data(), 1, a.ids.data(), a.w.data(), out_a.data()).ok());
      auto ticket = (*pool)->Submit(1, b.x.data(), 40, b.ids.data(), b.w.data(), out_b.data());
      ASSERT_TRUE(ticket.ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(round));  // the caller's own work
      ASSERT_TRUE((*pool)->Wait(*ticket).ok());
      EXPECT_EQ(out_a, want_a) << "linger " << linger_us << " us, round " << round;
      EXPECT_EQ(out_b, want_b) << "linger " << linger_us << " us, round " << round;
      if (round == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past a short linger
      if (round == 1) {
        EXPECT_GT((*pool)->MeasureReadBandwidth(1 << 20, 1), 0.0);
      }
    }
  }
  // Calls posted just as the threads give up lingering (20 us), again and again.
  ExpertPoolOptions options;
  options.format = ExpertFormat::kInt8;
  options.threads = 4;
  options.progress = false;
  options.linger_us = 20;
  auto pool = ExpertPool::Create(shape, options, experts_.Source());
  ASSERT_TRUE(pool.ok()) << pool.status();
  for (int call = 0; call < 200; ++call) {
    const bool one = call % 2 == 0;
    const Routing& r = one ? a : b;
    std::vector<float> out(r.x.size(), -1.0f);
    if (call % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(call % 40));
    ASSERT_TRUE((*pool)->Compute(one ? 0 : 1, r.x.data(), one ? 1 : 40, r.ids.data(), r.w.data(), out.data()).ok());
    ASSERT_EQ(out, one ? want_a : want_b) << "call " << call;
  }
}

TEST_F(ExpertPoolBehaviour, BadIdsAreRejectedAndThePoolGoesOn) {
  auto pool = Make(2);
  Routing r = RandomRouting(SmallShape(), 2, 4);
  std::vector<float> out(r.x.size());
  r.ids[4] = 8;
  absl::Status s = pool->Compute(0, r.x.data(), 2, r.ids.data(), r.w.data(), out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("expert id 8 of token 1 outside [0, 8)"));
  s = pool->Compute(2, r.x.data(), 2, r.ids.data(), r.w.data(), out.data());
  EXPECT_THAT(s.message(), HasSubstr("MoE layer 2 outside [0, 2)"));
  s = pool->Compute(0, r.x.data(), -1, r.ids.data(), r.w.data(), out.data());
  EXPECT_THAT(s.message(), HasSubstr("-1 tokens"));
  r.ids[4] = 1;
  EXPECT_TRUE(pool->Compute(0, r.x.data(), 0, r.ids.data(), r.w.data(), out.data()).ok());  // nothing to do
  EXPECT_TRUE(pool->Compute(0, r.x.data(), 2, r.ids.data(), r.w.data(), out.data()).ok());
}

TEST_F(ExpertPoolBehaviour, MoreThreadsThanDecodeWorkStillAgree) {
  // 16 threads with 4 units each over one token's 3 experts: most units are empty.
  Routing r = RandomRouting(SmallShape(), 1, 9);
  std::vector<float> few(r.x.size()), many(r.x.size());
  for (auto [threads, out] : {std::pair<int, std::vector<float>*>{1, &few}, {16, &many}}) {
    auto pool = Make(threads);
    ASSERT_TRUE(pool->Compute(1, r.x.data(), 1, r.ids.data(), r.w.data(), out->data()).ok());
  }
  EXPECT_EQ(few, many);
  EXPECT_NE(few, std::vector<float>(few.size(), 0.0f));
}

TEST_F(ExpertPoolBehaviour, ThreadCountDoesNotChangeTheResult) {
  Routing r = RandomRouting(SmallShape(), 33, 5);
  std::vector<float> one(r.x.size()), two(r.x.size()), four(r.x.size());
  for (auto [threads, out] : {std::pair<int, std::vector<float>*>{1, &one}, {2, &two}, {4, &four}}) {
    auto pool = Make(threads, ExpertFormat::kBF16);
    EXPECT_EQ(pool->threads(), threads);
    ASSERT_TRUE(pool->Compute(0, r.x.data(), 33, r.ids.data(), r.w.data(), out->data()).ok());
  }
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, four);
}

// A row may name an expert more than once (hybrid execution fills the picks it sends to the GPU
// with weight-0 copies of one the row reads anyway): each slot counts once, with its own weight,
// in both schedules and for every format.
TEST_F(ExpertPoolBehaviour, RepeatedExpertsInARowCountOncePerSlot) {
  const ExpertShape shape = SmallShape();  // top-3 of 8
  for (ExpertFormat format : {ExpertFormat::kBF16, ExpertFormat::kInt8, ExpertFormat::kInt4}) {
    for (int64_t tokens : {1, 4, 40}) {
      Routing r = RandomRouting(shape, tokens, 50 + tokens);
      for (int64_t t = 0; t < tokens; ++t) {
        // Slots 0 and 2 repeat slot 1's expert; slot 0 at weight 0, slot 2 at its own weight.
        r.ids[t * 3 + 0] = r.ids[t * 3 + 1];
        r.w[t * 3 + 0] = 0.0f;
        if (t % 2 == 1) r.ids[t * 3 + 2] = r.ids[t * 3 + 1];
      }
      const std::vector<double> want = experts_.Reference(0, r.x, r.ids, r.w);
      for (int64_t decode_max : {int64_t{0}, int64_t{64}}) {
        ExpertPoolOptions options;
        options.format = format;
        options.threads = 3;
        options.progress = false;
        options.decode_max_tokens = decode_max;
        auto pool = ExpertPool::Create(shape, options, experts_.Source());
        ASSERT_TRUE(pool.ok()) << pool.status();
        std::vector<float> out(r.x.size(), -1.0f);
        ASSERT_TRUE((*pool)->Compute(0, r.x.data(), tokens, r.ids.data(), r.w.data(), out.data()).ok());
        double signal = 0, noise = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          signal += want[i] * want[i];
          noise += (out[i] - want[i]) * (out[i] - want[i]);
        }
        // int4 at one token: two experts' quantization noise, not averaged over many.
        const double tolerance = format == ExpertFormat::kBF16 ? 1e-4 : format == ExpertFormat::kInt8 ? 3e-2 : 0.3;
        EXPECT_LT(std::sqrt(noise / signal), tolerance)
            << FormatName(format) << ", " << tokens << " tokens, decode_max_tokens " << decode_max;
      }
    }
  }
}

// Skipped slots (kSkippedSlot) run no expert and their weights are not read: a token gets the sum
// of its other slots, zeros when it has none; a call's picks split over two calls sum to the
// whole (a tensor split's ranks, expert deferral). Both schedules, every format.
TEST_F(ExpertPoolBehaviour, SkippedSlotsAreLeftOut) {
  const ExpertShape shape = SmallShape();  // top-3 of 8
  for (ExpertFormat format : {ExpertFormat::kBF16, ExpertFormat::kInt8, ExpertFormat::kInt4}) {
    for (int64_t tokens : {1, 5, 40}) {
      const Routing r = RandomRouting(shape, tokens, 70 + tokens);
      Routing first = r, second = r;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int j = 0; j < 3; ++j) {
          // Token 0 skips every slot of the first call; the others split their picks.
          const bool in_first = t != 0 && (t + j) % 2 == 0;
          (in_first ? second : first).ids[t * 3 + j] = kSkippedSlot;
          (in_first ? second : first).w[t * 3 + j] = std::nanf("");  // never read
        }
      }
      for (int64_t decode_max : {int64_t{0}, int64_t{64}}) {
        ExpertPoolOptions options;
        options.format = format;
        options.threads = 3;
        options.progress = false;
        options.decode_max_tokens = decode_max;
        auto pool = ExpertPool::Create(shape, options, experts_.Source());
        ASSERT_TRUE(pool.ok()) << pool.status();
        std::vector<float> whole(r.x.size()), a(r.x.size(), -1.0f), b(r.x.size(), -1.0f);
        ASSERT_TRUE((*pool)->Compute(1, r.x.data(), tokens, r.ids.data(), r.w.data(), whole.data()).ok());
        ASSERT_TRUE((*pool)->Compute(1, first.x.data(), tokens, first.ids.data(), first.w.data(), a.data()).ok());
        ASSERT_TRUE((*pool)->Compute(1, second.x.data(), tokens, second.ids.data(), second.w.data(), b.data()).ok());
        const std::string where =
            absl::StrCat(FormatName(format), ", ", tokens, " tokens, decode_max_tokens ", decode_max);
        for (int64_t c = 0; c < shape.hidden; ++c) ASSERT_EQ(a[c], 0.0f) << where;  // token 0: all skipped
        const std::vector<double> want = experts_.Reference(1, first.x, first.ids, first.w);
        double signal = 0, noise = 0, split = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          ASSERT_TRUE(std::isfinite(a[i]) && std::isfinite(b[i])) << where;
          signal += double(whole[i]) * whole[i];
          noise += (a[i] - want[i]) * (a[i] - want[i]);
          split += (a[i] + b[i] - whole[i]) * (a[i] + b[i] - whole[i]);
        }
        const double tolerance = format == ExpertFormat::kBF16 ? 1e-4 : format == ExpertFormat::kInt8 ? 3e-2 : 0.3;
        EXPECT_LT(std::sqrt(noise / signal), tolerance) << where;
        EXPECT_LT(std::sqrt(split / signal), 1e-5) << where;
      }
    }
  }
}

TEST_F(ExpertPoolBehaviour, DecodeAndBatchSchedulesAgreeExactly) {
  // The same kernels over the same blocks, cut differently: bit-identical results, whatever the
  // thread count. The second shape has a hidden size of two reduce chunks in both schedules (the
  // batch schedule's are 2048 columns), not a multiple of 16, and an odd number of down blocks. With 70 tokens the
  // batch schedule cuts gate+up items two ways (finer for the last experts) and queues the sums; where the CPU has AMX,
  // the AMX kernels (gate+up with SiLU fused) run in both schedules too, int8 and int4.
  std::vector<std::optional<KernelKind>> kernels = {std::nullopt};
  if (KernelUnsupportedReason(KernelKind::kAmx, ExpertFormat::kInt8, core::GetCpuFeatures()).empty()) {
    kernels.push_back(KernelKind::kAmx);
  }
  for (ExpertFormat format : {ExpertFormat::kInt8, ExpertFormat::kInt4})
    for (const ExpertShape& shape : {SmallShape(), ExpertShape{1, 6, 2, 2090, 200}})
      for (std::optional<KernelKind> kernel : kernels)
        for (int64_t tokens : {1, 3, 16, 70}) {
          const Experts experts(shape, 3);
          Routing r = RandomRouting(shape, tokens, 20 + tokens);
          std::vector<float> want;
          for (int64_t decode_max : {int64_t{0}, int64_t{128}}) {
            for (int threads : {1, 3, 5}) {
              ExpertPoolOptions options;
              options.format = format;
              options.kernel = kernel;
              options.threads = threads;
              options.progress = false;
              options.decode_max_tokens = decode_max;
              auto pool = ExpertPool::Create(shape, options, experts.Source());
              ASSERT_TRUE(pool.ok()) << pool.status();
              std::vector<float> out(r.x.size(), -1.0f);
              ASSERT_TRUE((*pool)->Compute(0, r.x.data(), tokens, r.ids.data(), r.w.data(), out.data()).ok());
              if (want.empty()) {
                want = out;
              } else {
                EXPECT_EQ(out, want) << FormatName(format) << ", hidden " << shape.hidden << ", " << tokens
                                     << " tokens, decode_max_tokens " << decode_max << ", " << threads << " threads";
              }
            }
          }
        }
}

TEST_F(ExpertPoolBehaviour, ATokensResultDoesNotDependOnItsCall) {
  // A served token gets the same bits whether it came alone or with others, in any order: its
  // row is quantized alone, the kernels' sums are exact integers, and its expert rows are summed
  // in expert order. 70 tokens are three chunks of the batch schedule's parallel sort; reversed,
  // every token's slots sit elsewhere in each chunk and expert.
  const ExpertShape shape{1, 6, 2, 2090, 200};
  const Experts experts(shape, 4);
  const int64_t tokens = 70, h = shape.hidden, k = shape.top_k;
  const Routing r = RandomRouting(shape, tokens, 77);
  Routing reversed = r;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t from = tokens - 1 - t;
    std::copy_n(r.x.begin() + from * h, h, reversed.x.begin() + t * h);
    std::copy_n(r.ids.begin() + from * k, k, reversed.ids.begin() + t * k);
    std::copy_n(r.w.begin() + from * k, k, reversed.w.begin() + t * k);
  }
  for (ExpertFormat format : {ExpertFormat::kInt8, ExpertFormat::kInt4}) {
    for (KernelKind kernel : {KernelKind::kPortable, KernelKind::kVnni, KernelKind::kAmx}) {
      if (!KernelUnsupportedReason(kernel, format, core::GetCpuFeatures()).empty()) continue;
      ExpertPoolOptions options;
      options.format = format;
      options.kernel = kernel;
      options.threads = 3;
      options.progress = false;
      auto pool = ExpertPool::Create(shape, options, experts.Source());
      ASSERT_TRUE(pool.ok()) << pool.status();
      std::vector<float> all(r.x.size()), back(r.x.size()), alone(h);
      ASSERT_TRUE((*pool)->Compute(0, r.x.data(), tokens, r.ids.data(), r.w.data(), all.data()).ok());
      ASSERT_TRUE(
          (*pool)->Compute(0, reversed.x.data(), tokens, reversed.ids.data(), reversed.w.data(), back.data()).ok());
      for (int64_t t = 0; t < tokens; ++t) {
        ASSERT_TRUE(
            (*pool)->Compute(0, r.x.data() + t * h, 1, r.ids.data() + t * k, r.w.data() + t * k, alone.data()).ok());
        const std::vector<float> in_call(all.begin() + t * h, all.begin() + (t + 1) * h);
        const std::vector<float> in_reversed(back.begin() + (tokens - 1 - t) * h, back.begin() + (tokens - t) * h);
        ASSERT_EQ(in_call, alone) << FormatName(format) << " " << KernelName(kernel) << ", token " << t;
        ASSERT_EQ(in_reversed, alone) << FormatName(format) << " " << KernelName(kernel) << ", token " << t;
      }
    }
  }
}

TEST_F(ExpertPoolBehaviour, WrongExpertShapeNamesLayerAndExpert) {
  ExpertPoolOptions options;
  options.progress = false;
  options.threads = 2;
  auto source = [&](int layer, int e) -> absl::StatusOr<ExpertWeights> {
    auto w = experts_.Source()(layer, e);
    if (layer == 1 && e == 6) w->down.tensor.shape = {40, 96};
    return w;
  };
  auto pool = ExpertPool::Create(SmallShape(), options, source);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("MoE layer 1 expert 6"));
}

TEST_F(ExpertPoolBehaviour, SharedArenaIsAttachedNotReloaded) {
  const std::string name = "moeserve_pool_test_" + std::to_string(::getpid());
  ASSERT_TRUE(HostArena::Unlink(name).ok());
  ExpertPoolOptions options;
  options.format = ExpertFormat::kInt4;
  options.threads = 2;
  options.progress = false;
  options.shm_name = name;
  options.model_id = "test-model";
  auto first = ExpertPool::Create(SmallShape(), options, experts_.Source());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_GT((*first)->loaded_bytes(), 0);
  int fetched = 0;
  auto counting = [&](int layer, int e) {
    ++fetched;
    return experts_.Source()(layer, e);
  };
  auto second = ExpertPool::Create(SmallShape(), options, counting);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE((*second)->arena().attached());
  EXPECT_EQ(fetched, 0);
  EXPECT_EQ((*second)->loaded_bytes(), 0);
  Routing r = RandomRouting(SmallShape(), 4, 6);
  std::vector<float> a(r.x.size()), b(r.x.size());
  ASSERT_TRUE((*first)->Compute(1, r.x.data(), 4, r.ids.data(), r.w.data(), a.data()).ok());
  ASSERT_TRUE((*second)->Compute(1, r.x.data(), 4, r.ids.data(), r.w.data(), b.data()).ok());
  EXPECT_EQ(a, b);
  options.format = ExpertFormat::kInt8;  // same name, other weights: replaced and loaded, never attached
  auto other = ExpertPool::Create(SmallShape(), options, experts_.Source());
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_FALSE((*other)->arena().attached());
  EXPECT_GT((*other)->loaded_bytes(), 0);
  // The first pool keeps the weights it mapped.
  ASSERT_TRUE((*first)->Compute(1, r.x.data(), 4, r.ids.data(), r.w.data(), b.data()).ok());
  EXPECT_EQ(a, b);
  EXPECT_TRUE(HostArena::Unlink(name).ok());
}

// The pool's threads lent as HostThreads: every index of a loop runs once, whatever the loop's
// size and grain; a loop posted while a call is in flight finishes the call first (its result is
// what Compute gives); a loop inside a body runs inline; calls and loops alternate, lingering or
// not, held through a step or resting after it.
TEST_F(ExpertPoolBehaviour, LentThreadsRunEveryIndexOnceBesideThePoolsCalls) {
  Routing r = RandomRouting(SmallShape(), 5, 31);
  std::vector<float> want(r.x.size());
  {
    auto pool = Make(1);
    ASSERT_TRUE(pool->Compute(1, r.x.data(), 5, r.ids.data(), r.w.data(), want.data()).ok());
  }
  for (int64_t linger_us : {int64_t{0}, int64_t{2000}}) {
    auto created = Make(3, ExpertFormat::kInt8, linger_us);
    ASSERT_NE(created, nullptr);
    ExpertPool& pool = *created;
    HostThreads& threads = pool.host_threads();
    EXPECT_EQ(threads.size(), 3);
    for (int round = 0; round < 40; ++round) {
      const int64_t n = 1 + (round * 37) % 500, grain = 1 + round % 7;
      std::vector<std::atomic<int>> seen(n);
      std::vector<float> out(r.x.size(), -1.0f);
      auto ticket = pool.Submit(1, r.x.data(), 5, r.ids.data(), r.w.data(), out.data());
      ASSERT_TRUE(ticket.ok());
      std::atomic<int> short_ranges{0};
      threads.ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
        if (end - begin < grain && end != n) short_ranges.fetch_add(1);
        for (int64_t i = begin; i < end; ++i) seen[i].fetch_add(1);
      });
      EXPECT_EQ(out, want) << "the call in flight was finished before the loop, round " << round;
      ASSERT_TRUE(pool.Wait(*ticket).ok());
      EXPECT_EQ(out, want) << "linger " << linger_us << " us, round " << round;
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i].load(), 1) << "index " << i << " of " << n;
      EXPECT_EQ(short_ranges.load(), 0);
      // A loop inside a body runs on that body's thread.
      std::atomic<int64_t> inner{0};
      threads.ParallelFor(8, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const std::thread::id outer = std::this_thread::get_id();
          threads.ParallelFor(100, 1, [&](int64_t b, int64_t e) {
            EXPECT_EQ(std::this_thread::get_id(), outer);
            inner.fetch_add(e - b);
          });
        }
      });
      EXPECT_EQ(inner.load(), 800);
      if (round % 3 == 0) threads.Rest();
      if (round % 10 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(3));  // past the linger
      if (round == 20) {
        EXPECT_GT(pool.MeasureReadBandwidth(1 << 20, 1), 0.0);
      }
    }
    threads.Rest();
  }
}

}  // namespace
}  // namespace moe::experts
