// Every kernel against a plain double-precision reference, on random shapes including odd ones.
#include "moe/experts/kernels.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "moe/core/cpu_features.h"
#include "moe/core/dtype.h"
#include "moe/core/memory.h"
#include "moe/core/status.h"

namespace moe::experts {
namespace {

struct KernelCase {
  ExpertFormat format;
  KernelKind kind;
  int group;
};

std::string CaseName(const ::testing::TestParamInfo<KernelCase>& info) {
  std::string s = std::string(FormatName(info.param.format)) + "_" + KernelName(info.param.kind);
  if (info.param.format == ExpertFormat::kInt4 || info.param.format == ExpertFormat::kFp8) {
    s += "_g" + std::to_string(info.param.group);
  }
  return s;
}

std::vector<KernelCase> AllCases() {
  std::vector<KernelCase> cases;
  for (ExpertFormat f : {ExpertFormat::kBF16, ExpertFormat::kInt8, ExpertFormat::kInt4, ExpertFormat::kFp8}) {
    for (KernelKind k : KernelsFor(f)) {
      if (f == ExpertFormat::kInt4 || f == ExpertFormat::kFp8) {
        for (int g : {32, 64, 128}) cases.push_back({f, k, g});
      } else {
        cases.push_back({f, k, 32});
      }
    }
  }
  return cases;
}

class KernelTest : public ::testing::TestWithParam<KernelCase> {
 protected:
  void SetUp() override {
    const std::string why = KernelUnsupportedReason(GetParam().kind, GetParam().format, core::GetCpuFeatures());
    if (!why.empty()) GTEST_SKIP() << KernelName(GetParam().kind) << " not run on this CPU: " << why;
    ASSERT_TRUE(PrepareThreadForKernel(GetParam().kind).ok());
  }
};

// The activation value the kernel multiplies by (fp32, bf16-rounded, or int8-dequantized).
double ActivationValue(const KernelCase& c, const Activations& a, int64_t m, int64_t k) {
  if (!TakesFloatActivations(c.format)) return a.i8(m)[k] * static_cast<double>(a.i8_scale(m));
  if (c.kind == KernelKind::kAvx512Bf16 && c.format == ExpertFormat::kFp8) {
    return double(core::Bf16ToFloat(a.bf16(m)[k])) + core::Bf16ToFloat(a.bf16_lo(m)[k]);
  }
  if (c.kind == KernelKind::kAvx512Bf16) return core::Bf16ToFloat(a.bf16(m)[k]);
  if (c.kind == KernelKind::kAmx) return double(core::Bf16ToFloat(a.bf16(m)[k])) + core::Bf16ToFloat(a.bf16_lo(m)[k]);
  return a.f32(m)[k];
}

// A random n x k matrix (entries of about 0.05) packed in `format`.
struct RandomMatrix {
  MatrixLayout layout;
  core::AlignedBuffer storage;
  PackedMatrix packed() const { return PackedMatrix{layout, storage.as<uint8_t>()}; }
};

absl::StatusOr<RandomMatrix> PackRandom(ExpertFormat format, int64_t n, int64_t k, int group, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  RandomMatrix m;
  MOE_ASSIGN_OR_RETURN(m.layout, MakeLayout(format, n, k, group));
  std::vector<float> w(n * k);
  for (float& v : w) v = dist(rng) * 0.05f;
  MOE_ASSIGN_OR_RETURN(m.storage, core::AlignedBuffer::Allocate(m.layout.bytes(), 64));
  MOE_RETURN_IF_ERROR(PackMatrix({w.data(), core::DType::kF32, {n, k}}, m.layout, m.storage.as<uint8_t>()));
  return m;
}

TEST_P(KernelTest, MatchesThePlainReference) {
  const KernelCase c = GetParam();
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  for (auto [n, k] : {std::pair<int64_t, int64_t>{16, 64}, {37, 100}, {48, 300}, {96, 768}}) {
    auto matrix = PackRandom(c.format, n, k, c.group, rng);
    ASSERT_TRUE(matrix.ok()) << matrix.status();
    const MatrixLayout* layout = &matrix->layout;
    const PackedMatrix packed = matrix->packed();
    for (int64_t m : {1, 3, 8, 17, 40}) {
      std::vector<float> x(m * k);
      for (float& v : x) v = dist(rng);
      Activations a;
      const int sum_group = c.format == ExpertFormat::kInt4 ? c.group : static_cast<int>(layout->k_pad);
      ASSERT_TRUE(a.Prepare(x.data(), m, k, layout->k_pad, c.kind, c.format, sum_group).ok());
      const int64_t blocks = layout->blocks();
      std::vector<float> y(m * blocks * 16, -1.0f);
      GetKernel(c.kind, c.format)(packed, a, 0, blocks, y.data(), blocks * 16);
      double worst = 0;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t r = 0; r < n; ++r) {
          double want = 0, scale = 1e-6;
          for (int64_t j = 0; j < layout->k_pad; ++j) {
            const double term = ActivationValue(c, a, i, j) * UnpackValue(packed, r, j);
            want += term;
            scale += std::abs(term);
          }
          worst = std::max(worst, std::abs(y[i * blocks * 16 + r] - want) / scale);
        }
      }
      EXPECT_LT(worst, 1e-5) << "n=" << n << " k=" << k << " m=" << m;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllKernels, KernelTest, ::testing::ValuesIn(AllCases()), CaseName);

TEST(PackedTest, QuantizationStaysCloseToTheWeights) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist;
  const int64_t n = 40, k = 200;
  std::vector<float> w(n * k);
  for (float& v : w) v = dist(rng);
  for (auto [format, tol] : {std::pair<ExpertFormat, double>{ExpertFormat::kBF16, 0.005}, {ExpertFormat::kInt8, 0.01},
                             {ExpertFormat::kInt4, 0.2}, {ExpertFormat::kFp8, 0.04}}) {
    auto layout = MakeLayout(format, n, k, 32);
    ASSERT_TRUE(layout.ok());
    auto storage = core::AlignedBuffer::Allocate(layout->bytes(), 64);
    ASSERT_TRUE(PackMatrix({w.data(), core::DType::kF32, {n, k}}, *layout, storage->as<uint8_t>()).ok());
    const PackedMatrix packed{*layout, storage->as<uint8_t>()};
    double worst = 0;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < k; ++j) worst = std::max(worst, double(std::abs(UnpackValue(packed, r, j) - w[r * k + j])));
      for (int64_t j = k; j < layout->k_pad; ++j) ASSERT_EQ(UnpackValue(packed, r, j), 0.0f);
    }
    // Errors relative to the largest weight (about 4 sigma): half a quantization step at most.
    EXPECT_LT(worst, tol * 4.5) << FormatName(format);
  }
}

TEST(SiluMulTest, MatchesTheLibmReference) {
  std::vector<float> gate, up, out;
  for (float x = -90.0f; x <= 90.0f; x += 0.37f) {
    gate.push_back(x);
    up.push_back(1.5f);
  }
  out.resize(gate.size());
  SiluMul(gate.data(), up.data(), static_cast<int64_t>(gate.size()), out.data());
  for (size_t i = 0; i < gate.size(); ++i) {
    const double want = gate[i] / (1.0 + std::exp(-double(gate[i]))) * 1.5;
    EXPECT_NEAR(out[i], want, 1e-6 * std::max(1.0, std::abs(want))) << gate[i];
  }
}

// The fused gate+up kernels (AMX int8 and int4) give bit for bit what the kernel's products
// through SiluMul give, on an intermediate size that is not a multiple of 16 and on a block range
// that starts after the first pair, and write nothing past the last intermediate column.
TEST(SwiGluKernelTest, EqualsTheKernelThenSiluMul) {
  for (KernelKind kind : {KernelKind::kPortable, KernelKind::kVnni}) {
    EXPECT_EQ(GetSwiGluKernel(kind, ExpertFormat::kInt8), nullptr);
    EXPECT_EQ(GetSwiGluKernel(kind, ExpertFormat::kInt4), nullptr);
  }
  EXPECT_EQ(GetSwiGluKernel(KernelKind::kAmx, ExpertFormat::kBF16), nullptr);
  const std::string why = KernelUnsupportedReason(KernelKind::kAmx, ExpertFormat::kInt8, core::GetCpuFeatures());
  if (!why.empty()) GTEST_SKIP() << "amx not run on this CPU: " << why;
  ASSERT_TRUE(PrepareThreadForKernel(KernelKind::kAmx).ok());
  for (auto [format, group] : {std::pair{ExpertFormat::kInt8, 32}, {ExpertFormat::kInt4, 32}, {ExpertFormat::kInt4, 64},
                               {ExpertFormat::kInt4, 128}}) {
    SCOPED_TRACE(std::string(FormatName(format)) + " group " + std::to_string(group));
    const SwiGluKernel fused = GetSwiGluKernel(KernelKind::kAmx, format);
    ASSERT_NE(fused, nullptr);
    const MatmulKernel kernel = GetKernel(KernelKind::kAmx, format);
    std::mt19937 rng(11);
    std::normal_distribution<float> dist;
    const int64_t inter = 45, n = 2 * 48, k = 300;  // 3 (gate, up) pairs, the last with 13 columns
    auto matrix = PackRandom(format, n, k, group, rng);
    ASSERT_TRUE(matrix.ok()) << matrix.status();
    const MatrixLayout* layout = &matrix->layout;
    const PackedMatrix packed = matrix->packed();
    const int64_t blocks = layout->blocks(), ld = blocks * 16;
    const int sum_group = format == ExpertFormat::kInt4 ? group : static_cast<int>(layout->k_pad);
    for (int64_t m : {1, 17, 40, 64}) {
      std::vector<float> x(m * k);
      for (float& v : x) v = dist(rng) * 3.0f;
      Activations a;
      ASSERT_TRUE(a.Prepare(x.data(), m, k, layout->k_pad, KernelKind::kAmx, format, sum_group).ok());
      // The products into rows on cache-line boundaries (streaming stores) and off them (plain
      // stores): the same values.
      auto storage = core::AlignedBuffer::Allocate((m * ld + 4) * sizeof(float));
      ASSERT_TRUE(storage.ok());
      float* const products = storage->as<float>();
      std::vector<float> products_off(m * ld);
      kernel(packed, a, 0, blocks, products + 4, ld);
      std::copy(products + 4, products + 4 + m * ld, products_off.begin());
      kernel(packed, a, 0, blocks, products, ld);
      for (int64_t i = 0; i < m * ld; ++i) ASSERT_EQ(products[i], products_off[i]) << "m=" << m << " at " << i;
      for (int64_t b0 : {int64_t{0}, int64_t{2}}) {
        const int64_t col0 = b0 / 2 * 16, ldy = inter + 3;
        std::vector<float> want(m * ldy, -7.0f), got(m * ldy, -7.0f);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t b = b0; b < blocks; b += 2) {
            const int64_t unit = b / 2 * 16, cols = std::min<int64_t>(16, inter - unit);
            SiluMul(&products[i * ld + b * 16], &products[i * ld + (b + 1) * 16], cols, &want[i * ldy + unit - col0]);
          }
        }
        fused(packed, a, b0, blocks, inter, got.data(), ldy);
        // Rows on cache-line boundaries take the kernel's streaming stores: the same values.
        const int64_t ld_aligned = 64;
        auto aligned = core::AlignedBuffer::Allocate(m * ld_aligned * sizeof(float));
        ASSERT_TRUE(aligned.ok());
        float* got_aligned = aligned->as<float>();
        std::fill(got_aligned, got_aligned + m * ld_aligned, -7.0f);
        fused(packed, a, b0, blocks, inter, got_aligned, ld_aligned);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < ldy; ++j) {
            ASSERT_EQ(got[i * ldy + j], want[i * ldy + j]) << "m=" << m << " b0=" << b0 << " row " << i << " col " << j;
          }
          for (int64_t j = 0; j < ld_aligned; ++j) {
            const float expect = j < inter - col0 ? want[i * ldy + j] : -7.0f;
            ASSERT_EQ(got_aligned[i * ld_aligned + j], expect)
                << "aligned, m=" << m << " b0=" << b0 << " row " << i << " col " << j;
          }
        }
      }
    }
  }
}

// AMX and VNNI compute the same exact integer sums and scale them with the same fp32 operations
// in the same order, so the pool may switch between them with the tokens per expert and a token
// still gets the same bits. Shapes: an odd number of blocks (a last pass of one block), K across
// several of the int4 kernel's unpacked chunks and not a multiple of them, token counts around
// the 16- and 32-token passes.
// From six tokens on, VNNI runs four blocks (int8) or two (int4) and up to six tokens at a time; a
// token's row must still be bit for bit what the one-token tile gives it alone, for every size of
// the last group of tokens (1 to 6), with blocks left over, and from a block range that does not
// start at the first block.
TEST(VnniKernelTest, ManyTokensGiveEachTokenItsOwnResultBitForBit) {
  if (const std::string why = KernelUnsupportedReason(KernelKind::kVnni, ExpertFormat::kInt8, core::GetCpuFeatures());
      !why.empty()) {
    GTEST_SKIP() << "vnni not run on this CPU: " << why;
  }
  for (auto [format, group] : {std::pair{ExpertFormat::kInt8, 32}, {ExpertFormat::kInt4, 32}, {ExpertFormat::kInt4, 64},
                               {ExpertFormat::kInt4, 128}}) {
    SCOPED_TRACE(std::string(FormatName(format)) + " group " + std::to_string(group));
    std::mt19937 rng(9);
    std::normal_distribution<float> dist;
    const int64_t n = 16 * 11, k = 700;  // 11 blocks: fours or pairs, and some left
    auto matrix = PackRandom(format, n, k, group, rng);
    ASSERT_TRUE(matrix.ok()) << matrix.status();
    const MatrixLayout* layout = &matrix->layout;
    const MatmulKernel kernel = GetKernel(KernelKind::kVnni, format);
    const int sum_group = format == ExpertFormat::kInt4 ? group : static_cast<int>(layout->k_pad);
    for (int64_t m = 6; m <= 14; ++m) {
      std::vector<float> x(m * k);
      for (float& v : x) v = dist(rng);
      Activations all;
      ASSERT_TRUE(all.Prepare(x.data(), m, k, layout->k_pad, KernelKind::kVnni, format, sum_group).ok());
      for (int64_t b0 : {int64_t{0}, int64_t{3}}) {
        const int64_t cols = (layout->blocks() - b0) * 16, ld = cols + 7;
        std::vector<float> got(m * ld, -5.0f);
        kernel(matrix->packed(), all, b0, layout->blocks(), got.data(), ld);
        for (int64_t i = 0; i < m; ++i) {
          Activations one;
          ASSERT_TRUE(one.Prepare(x.data() + i * k, 1, k, layout->k_pad, KernelKind::kVnni, format, sum_group).ok());
          std::vector<float> want(ld, -5.0f);
          kernel(matrix->packed(), one, b0, layout->blocks(), want.data(), ld);
          ASSERT_EQ(std::vector<float>(got.begin() + i * ld, got.begin() + (i + 1) * ld), want)
              << m << " tokens, token " << i << ", from block " << b0;
        }
      }
    }
  }
}

TEST(AmxKernelTest, EqualsVnniBitForBit) {
  const std::string why = KernelUnsupportedReason(KernelKind::kAmx, ExpertFormat::kInt8, core::GetCpuFeatures());
  if (!why.empty()) GTEST_SKIP() << "amx not run on this CPU: " << why;
  if (!KernelUnsupportedReason(KernelKind::kVnni, ExpertFormat::kInt8, core::GetCpuFeatures()).empty()) {
    GTEST_SKIP() << "vnni not run on this CPU";
  }
  ASSERT_TRUE(PrepareThreadForKernel(KernelKind::kAmx).ok());
  for (auto [format, group] : {std::pair{ExpertFormat::kInt8, 32}, {ExpertFormat::kInt4, 32}, {ExpertFormat::kInt4, 64},
                               {ExpertFormat::kInt4, 128}}) {
    std::mt19937 rng(5);
    std::normal_distribution<float> dist;
    const int64_t n = 80, k = 1100;
    auto matrix = PackRandom(format, n, k, group, rng);
    ASSERT_TRUE(matrix.ok()) << matrix.status();
    const MatrixLayout* layout = &matrix->layout;
    const int64_t blocks = layout->blocks(), ld = blocks * 16 + 5;
    const int sum_group = format == ExpertFormat::kInt4 ? group : static_cast<int>(layout->k_pad);
    for (int64_t m : {1, 15, 16, 17, 33, 70}) {
      std::vector<float> x(m * k);
      for (float& v : x) v = dist(rng);
      Activations amx, vnni;
      ASSERT_TRUE(amx.Prepare(x.data(), m, k, layout->k_pad, KernelKind::kAmx, format, sum_group).ok());
      ASSERT_TRUE(vnni.Prepare(x.data(), m, k, layout->k_pad, KernelKind::kVnni, format, sum_group).ok());
      std::vector<float> want(m * ld, -3.0f), got(m * ld, -3.0f);
      GetKernel(KernelKind::kVnni, format)(matrix->packed(), vnni, 0, blocks, want.data(), ld);
      GetKernel(KernelKind::kAmx, format)(matrix->packed(), amx, 0, blocks, got.data(), ld);
      ASSERT_EQ(got, want) << FormatName(format) << " group " << group << ", " << m << " tokens";
    }
  }
}

// Gathering rows from activations quantized once gives what preparing those rows gives: the
// same int8 values, scales and group sums, with the AMX row padding zeroed.
TEST(ActivationsTest, GatherEqualsPreparingTheRows) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  const int64_t tokens = 23, k = 200, k_pad = 256;
  std::vector<float> x(tokens * k);
  for (float& v : x) v = dist(rng);
  const std::vector<int32_t> pick = {5, 0, 22, 5, 17, 9, 3, 11, 12, 13, 14, 15, 16, 18, 19, 20, 21, 1};
  std::vector<const float*> rows;
  for (int32_t t : pick) rows.push_back(x.data() + t * k);
  const int64_t m = static_cast<int64_t>(pick.size());
  for (auto [format, group] : {std::pair{ExpertFormat::kInt8, 256}, {ExpertFormat::kInt4, 32}}) {
    for (KernelKind kind : {KernelKind::kVnni, KernelKind::kAmx}) {
      Activations all, gathered, direct;
      ASSERT_TRUE(all.Prepare(x.data(), tokens, k, k_pad, KernelKind::kVnni, format, group).ok());
      ASSERT_TRUE(gathered.Gather(all, pick.data(), m, kind).ok());
      ASSERT_TRUE(direct.Prepare(rows.data(), m, k, k_pad, kind, format, group).ok());
      ASSERT_EQ(gathered.m_pad(), direct.m_pad());
      EXPECT_EQ(gathered.m_pad(), kind == KernelKind::kAmx ? 32 : m);
      for (int64_t r = 0; r < gathered.m_pad(); ++r) {
        ASSERT_EQ(std::memcmp(gathered.i8(r), direct.i8(r), k_pad), 0) << "row " << r;
        EXPECT_EQ(gathered.i8_scale(r), direct.i8_scale(r));
        for (int64_t g = 0; g < k_pad / group; ++g) EXPECT_EQ(gathered.i8_sum(r, g), direct.i8_sum(r, g));
      }
    }
  }
  Activations bf16, out;
  ASSERT_TRUE(bf16.Prepare(x.data(), tokens, k, k_pad, KernelKind::kAvx512, ExpertFormat::kBF16, k_pad).ok());
  EXPECT_EQ(out.Gather(bf16, pick.data(), m, KernelKind::kAvx512).code(), absl::StatusCode::kInvalidArgument);
}

// Every packed format, int4 with each group size.
struct PackCase {
  ExpertFormat format;
  int group;
};
constexpr PackCase kEveryPacking[] = {{ExpertFormat::kBF16, 32},
                                      {ExpertFormat::kInt8, 32},
                                      {ExpertFormat::kInt4, 32},
                                      {ExpertFormat::kInt4, 64},
                                      {ExpertFormat::kInt4, 128}};

TEST(PackedTest, TheAvx512PackerWritesTheSameBytesAsThePlainOne) {
  const core::CpuFeatures& cpu = core::GetCpuFeatures();
  if (!cpu.avx512f || !cpu.avx512bw) GTEST_SKIP() << "this CPU has no AVX-512 F and BW: " << cpu.ToString();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (const PackCase& c : kEveryPacking) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{16, 64}, {17, 100}, {45, 1100}, {33, 300}, {64, 2048}}) {
      std::vector<float> w(n * k);
      for (float& v : w) v = normal(rng);
      // Rows that round exactly half-way: with the largest value 127 (int8) or 7 (int4) the scale
      // is 1 and x.5 must go to the even neighbour; bf16 gets values half-way between two bf16s.
      const float top = c.format == ExpertFormat::kInt8 ? 127.0f : 7.0f;
      for (int64_t j = 0; j < k; ++j) w[1 * k + j] = j == 0 ? top : static_cast<float>(j % 13) - 6.5f;
      for (int64_t j = 0; j < k; ++j) w[2 * k + j] = 0.0f;  // all zero: scale 1
      for (int64_t j = 0; j < k; ++j) {
        uint32_t bits = 0x3f800000u + (static_cast<uint32_t>(j) << 16) + 0x8000u;  // ties
        std::memcpy(&w[3 * k + j], &bits, 4);
      }
      auto layout = MakeLayout(c.format, n, k, c.group);
      ASSERT_TRUE(layout.ok());
      std::vector<uint8_t> plain(layout->bytes() + 64, 0xAB), fast(layout->bytes() + 64, 0xCD);
      auto* plain_out = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(plain.data()) + 63) & ~uintptr_t{63});
      auto* fast_out = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(fast.data()) + 63) & ~uintptr_t{63});
      auto rows = [&](int64_t row, float* dst) { std::memcpy(dst, w.data() + row * k, k * sizeof(float)); };
      internal::PackRowsWith(*layout, rows, plain_out, /*vector=*/false);
      internal::PackRowsWith(*layout, rows, fast_out, /*vector=*/true);
      const std::string name = absl::StrCat(FormatName(c.format), " group ", c.group, ", ", n, " x ", k);
      ASSERT_EQ(std::memcmp(plain_out, fast_out, layout->bytes()), 0) << name;
      // And the values are the ones the layout promises.
      const PackedMatrix m{*layout, fast_out};
      EXPECT_EQ(UnpackValue(m, 1, 1), c.format == ExpertFormat::kBF16 ? -5.5f : -6.0f) << name;  // -5.5 to even
      EXPECT_EQ(UnpackValue(m, n, 0), 0.0f) << name;  // a padding row
    }
  }
}

TEST(PackedTest, Bf16RowsPackAsTheirFloatValuesDo) {
  // Rows of bf16 as stored (odd lengths, rows of zeros; NaN where the format keeps it) give the
  // bytes the plain packer gives from their float values, in every format.
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const PackCase& f : kEveryPacking) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{16, 64}, {17, 100}, {45, 1100}, {33, 31}, {64, 2048}}) {
      SCOPED_TRACE(absl::StrCat(FormatName(f.format), " group ", f.group, ", ", n, " x ", k));
      std::vector<uint16_t> bits(n * k);
      for (uint16_t& v : bits) v = core::FloatToBf16(normal(rng));
      if (f.format == ExpertFormat::kBF16) {
        bits[k + 1] = 0x7f81;  // a signalling NaN, which comes out quiet
        bits[k + 2] = 0xffc1;
      }
      auto layout = MakeLayout(f.format, n, k, f.group);
      ASSERT_TRUE(layout.ok());
      auto plain = core::AlignedBuffer::Allocate(layout->bytes());
      auto fast = core::AlignedBuffer::Allocate(layout->bytes());
      ASSERT_TRUE(plain.ok() && fast.ok());
      internal::PackRowsWith(
          *layout,
          [&](int64_t row, float* dst) {
            if (row % 5 == 4) return std::fill(dst, dst + k, 0.0f);
            core::ConvertToFloat(bits.data() + row * k, core::DType::kBF16, dst, k);
          },
          plain->as<uint8_t>(), /*vector=*/false);
      PackRowsBf16(
          *layout, [&](int64_t row) { return row % 5 == 4 ? nullptr : bits.data() + row * k; }, fast->as<uint8_t>());
      EXPECT_EQ(std::memcmp(plain->as<uint8_t>(), fast->as<uint8_t>(), layout->bytes()), 0);
      // PackMatrix takes the same path for bf16 tensors.
      auto via_matrix = core::AlignedBuffer::Allocate(layout->bytes());
      ASSERT_TRUE(via_matrix.ok());
      for (int64_t row = 4; row < n; row += 5) std::fill(bits.begin() + row * k, bits.begin() + (row + 1) * k, 0);
      ASSERT_TRUE(PackMatrix({bits.data(), core::DType::kBF16, {n, k}}, *layout, via_matrix->as<uint8_t>()).ok());
      EXPECT_EQ(std::memcmp(plain->as<uint8_t>(), via_matrix->as<uint8_t>(), layout->bytes()), 0);
    }
  }
}

TEST(PackedTest, RejectsBadShapesAndGroups) {
  EXPECT_FALSE(MakeLayout(ExpertFormat::kInt4, 16, 64, 48).ok());
  auto layout = MakeLayout(ExpertFormat::kBF16, 16, 64);
  std::vector<float> w(10);
  uint8_t out[64];
  absl::Status s = PackMatrix({w.data(), core::DType::kF32, {2, 5}}, *layout, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParseFormat("fp4").ok());
  EXPECT_FALSE(MakeLayout(ExpertFormat::kFp8, 16, 64, 48).ok());
  EXPECT_FALSE(ParseKernel("neon").ok());
}

}  // namespace
}  // namespace moe::experts

namespace moe::experts {
namespace {

// Each format's descriptor says what the layout and the kernels assume of it.
TEST(FormatDescriptorTest, DescribesEveryPackedFormatAsTheLayoutSizesIt) {
  ASSERT_EQ(PackedFormats().size(), 24u);  // bf16, int8, int4, 19 GGUF types, fp8, native
  for (const FormatDescriptor& d : PackedFormats()) {
    SCOPED_TRACE(d.name);
    EXPECT_EQ(&Describe(d.format), &d);
    EXPECT_EQ(ParseFormat(d.name).value(), d.format);
    if (IsGgufFormat(d.format) || d.format == ExpertFormat::kNative) continue;  // kernels_gguf_test.cc
    EXPECT_EQ(&Describe(d.format), &d);
    EXPECT_EQ(d.bits, FormatBits(d.format));
    EXPECT_EQ(ParseFormat(d.name).value(), d.format);
    const MatrixLayout l = MakeLayout(d.format, 40, 200, 64).value();
    EXPECT_EQ(l.block_bytes() * 8, 16 * l.k_pad * d.bits);
    const int64_t scales = d.scales == FormatDescriptor::Scales::kNone     ? 0
                           : d.scales == FormatDescriptor::Scales::kPerRow ? l.n_pad
                                                                           : l.n_pad * l.groups();
    EXPECT_EQ(l.scale_bytes(), (scales * 4 + 63) / 64 * 64);
    EXPECT_TRUE(d.symmetric);
    EXPECT_EQ(d.codebook, nullptr);
  }
  EXPECT_EQ(Describe(ExpertFormat::kInt8).offset, 128);
  EXPECT_EQ(Describe(ExpertFormat::kInt4).offset, 8);
  EXPECT_EQ(ParseFormat("q4_z").status().message().find("expert format 'q4_z' is not one of bf16, int8, int4, q4_0"),
            0u);
}

// Every format has a portable kernel first, and each kernel the table registers is there to call.
TEST(FormatDescriptorTest, KernelsRegisterAgainstFormats) {
  for (const FormatDescriptor& d : PackedFormats()) {
    if (d.format == ExpertFormat::kNative) continue;  // a pool option, no kernels of its own
    const std::vector<KernelKind> kinds = KernelsFor(d.format);
    ASSERT_FALSE(kinds.empty()) << d.name;
    EXPECT_EQ(kinds.front(), KernelKind::kPortable) << d.name;
  }
  for (const KernelEntry& e : KernelTable()) {
    EXPECT_NE(e.matmul, nullptr);
    EXPECT_EQ(GetKernel(e.kind, e.format), e.matmul);
    EXPECT_EQ(GetSwiGluKernel(e.kind, e.format), e.swiglu);
  }
  EXPECT_EQ(GetKernel(KernelKind::kVnni, ExpertFormat::kBF16), nullptr);
}

// An FP8 checkpoint's codes and scales go in as they are: every value the kernels compute with is
// code * its scale, bit for bit, and the arena holds one byte a value plus a 1/32 of scales.
TEST(PackedTest, Fp8CodesAndScalesAreKeptAsStored) {
  const int64_t n = 40, k = 384;
  const int group = 128;
  std::mt19937 rng(11);
  std::vector<uint8_t> codes(n * k);
  for (uint8_t& c : codes) {
    c = static_cast<uint8_t>(rng() & 0xff);
    if ((c & 0x7f) == 0x7f) c = 0;  // not NaN
  }
  std::vector<float> scales(n * (k / group));
  for (float& s : scales) s = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, -7);
  auto layout = MakeLayout(ExpertFormat::kFp8, n, k, group);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->weight_bytes(), 48 * k);
  EXPECT_EQ(layout->scale_bytes(), 48 * (k / group) * 4);
  auto storage = core::AlignedBuffer::Allocate(layout->bytes(), 64);
  ASSERT_TRUE(storage.ok());
  PackFp8Rows(
      *layout, [&](int64_t r) { return codes.data() + r * k; },
      [&](int64_t r, int64_t g) { return scales[r * (k / group) + g]; }, storage->as<uint8_t>());
  const PackedMatrix packed{*layout, storage->as<uint8_t>()};
  for (int64_t r = 0; r < layout->n_pad; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      const float want = r < n ? core::F8E4M3ToFloat(codes[r * k + j]) * scales[r * (k / group) + j / group] : 0.0f;
      ASSERT_EQ(UnpackValue(packed, r, j), want) << r << "," << j;
    }
  }
}

}  // namespace
}  // namespace moe::experts
