#include "cuda/rms_norm.h"

#include <cmath>
#include <random>
#include <vector>

#include "cuda/cuda_status.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"

namespace moe::runtime::cuda {
namespace {

TEST(CudaRmsNormTest, MatchesThePlainReference) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  for (int64_t cols : {7, 128, 2048, 5120}) {
    const int64_t rows = 33;
    std::mt19937 rng(cols);
    std::normal_distribution<float> dist;
    std::vector<float> x(rows * cols), got(rows * cols);
    std::vector<uint16_t> w(cols);
    for (float& v : x) v = dist(rng);
    for (uint16_t& v : w) v = core::FloatToBf16(1.0f + 0.2f * dist(rng));
    ASSERT_TRUE(RmsNormOnDevice(x.data(), w.data(), rows, cols, 1e-6f, got.data()).ok());
    float worst = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < cols; ++i) ss += double(x[r * cols + i]) * x[r * cols + i];
      const double inv = 1.0 / std::sqrt(ss / cols + 1e-6);
      for (int64_t i = 0; i < cols; ++i) {
        const double want = core::Bf16ToFloat(w[i]) * x[r * cols + i] * inv;
        worst = std::max(worst, float(std::abs(want - got[r * cols + i])));
      }
    }
    EXPECT_LT(worst, 1e-4f) << "cols=" << cols;
  }
}

}  // namespace
}  // namespace moe::runtime::cuda
