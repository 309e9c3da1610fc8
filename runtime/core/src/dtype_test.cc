#include "moe/core/dtype.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"
#include "moe/core/cpu_features.h"

namespace moe::core {
namespace {

TEST(DTypeTest, Bf16RoundTripsRepresentableValues) {
  for (float v : {0.0f, 1.0f, -2.5f, 0.15625f, 65536.0f, -1e-3f}) {
    float back = Bf16ToFloat(FloatToBf16(v));
    EXPECT_NEAR(back, v, std::abs(v) / 128.0f) << v;
  }
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f)), 1.0f);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to even (1).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);
  // Slightly above the tie rounds up.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256 + 1.0f / 4096)), 1.0f + 1.0f / 128);
}

TEST(DTypeTest, F16ConvertsNormalsSubnormalsAndSpecials) {
  EXPECT_EQ(F16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(F16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(F16ToFloat(0x7bff), 65504.0f);
  EXPECT_FLOAT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(F16ToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7e00)));
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32, DType::kI8, DType::kI32, DType::kI64}) {
    EXPECT_EQ(DTypeFromName(DTypeName(t)), t);
  }
  EXPECT_FALSE(DTypeFromName("F8_E4M3").has_value());
}

TEST(CpuFeaturesTest, DescribesTheMachine) {
  const CpuFeatures& f = GetCpuFeatures();
  EXPECT_FALSE(f.ToString().empty());
  // AVX-512 BF16 implies AVX-512F; AMX BF16 implies AMX tiles.
  if (f.avx512_bf16) EXPECT_TRUE(f.avx512f);
  if (f.amx_bf16) EXPECT_TRUE(f.amx_tile);
}

}  // namespace
}  // namespace moe::core
