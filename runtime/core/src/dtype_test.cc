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

TEST(DTypeTest, F8E4M3EveryCodeRoundTripsAndRoundingIsToNearestEven) {
  for (int c = 0; c < 256; ++c) {
    const float f = F8E4M3ToFloat(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << c;
      continue;
    }
    EXPECT_EQ(FloatToF8E4M3(f), c) << c << " = " << f;
  }
  EXPECT_EQ(F8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(F8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(F8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(FloatToF8E4M3(1.0625f), 0x38);               // halfway: to the even mantissa
  EXPECT_EQ(FloatToF8E4M3(1.1875f), 0x3a);
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 subnormal steps: to 2
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(5.0f, -10)), 0x02);  // 2.5 steps: to 2 as well
  EXPECT_EQ(FloatToF8E4M3(1000.0f), 0x7e);                // saturates
  EXPECT_EQ(FloatToF8E4M3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToF8E4M3(std::nanf("")), 0x7f);
  EXPECT_EQ(FloatToF8E4M3(-0.0f), 0x80);
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32, DType::kI8, DType::kI32, DType::kI64, DType::kF8E4M3}) {
    EXPECT_EQ(DTypeFromName(DTypeName(t)), t);
  }
  EXPECT_FALSE(DTypeFromName("F8_E5M2").has_value());
}

TEST(CpuFeaturesTest, DescribesTheMachine) {
  const CpuFeatures& f = GetCpuFeatures();
  EXPECT_FALSE(f.ToString().empty());
  // AVX-512 BF16 implies AVX-512F; AMX BF16 implies AMX tiles.
  if (f.avx512_bf16) {
    EXPECT_TRUE(f.avx512f);
  }
  if (f.amx_bf16) {
    EXPECT_TRUE(f.amx_tile);
  }
}

}  // namespace
}  // namespace moe::core
