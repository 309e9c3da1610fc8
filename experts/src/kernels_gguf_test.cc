// The GGUF formats: the packed layout keeps each block (bit for bit the file's values), and every
// kernel this CPU runs computes DequantizeRow's weights times the int8 activations.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "moe/core/cpu_features.h"
#include "moe/core/memory.h"
#include "moe/experts/gguf_types.h"
#include "moe/experts/kernels.h"
#include "moe/experts/packed.h"
#include "gguf_test_blocks.h"

namespace moe::experts {
namespace {

struct GgufCase {
  ExpertFormat format;
  KernelKind kind;
};

std::vector<GgufCase> Cases() {
  std::vector<GgufCase> cases;
  for (const FormatDescriptor& d : PackedFormats()) {
    if (!IsGgufFormat(d.format)) continue;
    for (KernelKind k : KernelsFor(d.format)) cases.push_back({d.format, k});
  }
  return cases;
}

class GgufKernelTest : public ::testing::TestWithParam<GgufCase> {};

TEST_P(GgufKernelTest, MatchesDequantizedWeightsOnOddShapes) {
  const GgufCase c = GetParam();
  const std::string why = KernelUnsupportedReason(c.kind, c.format, core::GetCpuFeatures());
  if (!why.empty()) GTEST_SKIP() << KernelName(c.kind) << " not run on this CPU: " << why;
  const int type_id = Describe(c.format).gguf_type;
  const GgufType& type = *FindGgufType(type_id);
  std::mt19937 rng(type_id * 7 + static_cast<int>(c.kind));
  // n not a multiple of 16; k over more than one 256-column span, and an odd count of 32-blocks.
  for (const int64_t k : {type.block_elements == 32 ? int64_t{288} : int64_t{512}, type.block_elements * int64_t{4}}) {
    const int64_t n = 37;
    std::vector<uint8_t> rows;
    for (int64_t r = 0; r < n; ++r) {
      const std::vector<uint8_t> row = RandomRow(type, k, rng);
      rows.insert(rows.end(), row.begin(), row.end());
    }
    const MatrixLayout l = MakeLayout(c.format, n, k).value();
    EXPECT_LE(l.bytes(), static_cast<int64_t>(rows.size() * 1.1) + 16 * 64 + 15 * GgufRowBytes(type, k));
    auto buf = core::AlignedBuffer::Allocate(l.bytes(), 64).value();
    PackBlockRows(l, rows.data(), buf.as<uint8_t>());
    const PackedMatrix w{l, buf.as<uint8_t>()};
    // The packed values are DequantizeRow's, bit for bit.
    std::vector<float> wf(n * k);
    for (int64_t r = 0; r < n; ++r) DequantizeRow(type_id, rows.data() + r * GgufRowBytes(type, k), k, &wf[r * k]);
    for (int64_t r = 0; r < n; r += 5) {
      for (int64_t i = 0; i < k; i += 7) ASSERT_EQ(UnpackValue(w, r, i), wf[r * k + i]) << r << " " << i;
    }
    for (const int64_t m : {1, 3, 7}) {
      SCOPED_TRACE(testing::Message() << "k " << k << " m " << m);
      std::vector<float> x(m * k);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (float& v : x) v = normal(rng);
      Activations a;
      ASSERT_TRUE(a.Prepare(x.data(), m, k, l.k_pad, c.kind, c.format, 16).ok());
      std::vector<float> y(m * l.n_pad, NAN);
      GetKernel(c.kind, c.format)(w, a, 0, l.blocks(), y.data(), l.n_pad);
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t r = 0; r < n; ++r) {
          // Against the int8 activations the kernel reads: only float rounding apart.
          double want = 0, mag = 0, want_f32 = 0, bound = 0;
          for (int64_t i = 0; i < k; ++i) {
            // GGUF formats: a scale per 32 activations (Activations::kScaleGroup).
            ASSERT_TRUE(a.group_scaled());
            const double scale = a.i8_group_scales(t)[i / Activations::kScaleGroup];
            const double xi = a.i8(t)[i] * scale;
            want += wf[r * k + i] * xi;
            mag += std::abs(wf[r * k + i] * xi);
            want_f32 += wf[r * k + i] * static_cast<double>(x[t * k + i]);
            bound += std::abs(wf[r * k + i]) * 0.5 * scale;
          }
          const double got = y[t * l.n_pad + r];
          ASSERT_NEAR(got, want, 1e-5 * mag + 1e-30) << "row " << r << " token " << t;
          // Against fp32 activations: within what rounding them to int8 can move the sum.
          ASSERT_NEAR(got, want_f32, 1.001 * bound + 1e-5 * mag) << "row " << r << " token " << t;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllGgufFormats, GgufKernelTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<GgufCase>& info) {
                           return std::string(FormatName(info.param.format)) + "_" + KernelName(info.param.kind);
                         });

TEST(GgufLayoutTest, KeepsTheFileBytes) {
  for (const FormatDescriptor& d : PackedFormats()) {
    if (!IsGgufFormat(d.format)) continue;
    const GgufType& type = *FindGgufType(d.gguf_type);
    const int64_t n = 2048, k = 2048;
    const MatrixLayout l = MakeLayout(d.format, n, k).value();
    EXPECT_EQ(l.bytes(), n * GgufRowBytes(type, k)) << d.name;  // exactly the blocks at this shape
    EXPECT_EQ(l.block_bytes() % 64, 0) << d.name;
    EXPECT_FALSE(MakeLayout(d.format, n, k + 16).ok()) << d.name;  // rows are whole blocks
    EXPECT_EQ(FormatForGgufType(d.gguf_type).value(), d.format);
  }
  EXPECT_FALSE(FormatForGgufType(kGgufF16).ok());
  EXPECT_FALSE(MakeLayout(ExpertFormat::kNative, 16, 256).ok());
  EXPECT_EQ(ParseFormat("Q4_K").value(), ExpertFormat::kQ4_K);
  EXPECT_EQ(ParseFormat("iq3_xxs").value(), ExpertFormat::kIQ3_XXS);
  EXPECT_EQ(ParseFormat("native").value(), ExpertFormat::kNative);
}

}  // namespace
}  // namespace moe::experts
