// The GPU's unpacking of the CPU pool's packed experts: every value as experts::UnpackValue
// reads it (rounded to bf16), for every format, gate and up rows de-interleaved.
#include <cuda_runtime.h>

#include <random>
#include <vector>

#include "cuda/streamed_layout.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moe/experts/expert_pool.h"
#include "moe/experts/packed.h"

namespace moe::runtime::cuda {
namespace {

TEST(StreamedExpertsTest, UnpacksEveryValueAsTheCpuReadsIt) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no GPU visible";
  // Hidden not a multiple of 64 (padded columns), three experts, intermediate 48 (three units of 16).
  const experts::ExpertShape shape{2, 3, 2, 100, 48};
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<std::vector<uint16_t>> weights(shape.num_layers * shape.num_experts * 3);
  for (auto& w : weights) {
    w.resize(shape.hidden * shape.intermediate);
    for (uint16_t& v : w) v = core::FloatToBf16(normal(rng));
  }
  for (const auto format : {experts::ExpertFormat::kBF16, experts::ExpertFormat::kInt8, experts::ExpertFormat::kInt4}) {
    experts::ExpertPoolOptions options;
    options.format = format;
    options.threads = 1;
    options.progress = false;
    auto pool =
        experts::ExpertPool::Create(shape, options, [&](int l, int e) -> absl::StatusOr<experts::ExpertWeights> {
          const int i = (l * shape.num_experts + e) * 3;
          const core::Shape io = {shape.intermediate, shape.hidden}, oi = {shape.hidden, shape.intermediate};
          return experts::ExpertWeights{{weights[i].data(), core::DType::kBF16, io},
                                        {weights[i + 1].data(), core::DType::kBF16, io},
                                        {weights[i + 2].data(), core::DType::kBF16, oi}};
        });
    ASSERT_TRUE(pool.ok()) << pool.status();
    const auto a = (*pool)->arena_layout();
    const int layer = 1, e_count = shape.num_experts, inter = static_cast<int>(shape.intermediate);
    const int64_t h = shape.hidden, layer_bytes = e_count * a.expert_bytes;
    uint8_t* src = nullptr;
    uint16_t *gate_up = nullptr, *down = nullptr;
    ASSERT_EQ(cudaMalloc(&src, layer_bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&gate_up, e_count * 2 * inter * h * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&down, e_count * h * inter * 2), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(src, a.data + layer * layer_bytes, layer_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    UnpackExperts(src, e_count, a.expert_bytes, ToPackedMatrixLayout(a.gate_up), a.gate_up.bytes(),
                  ToPackedMatrixLayout(a.down), inter, gate_up, down, nullptr);
    std::vector<uint16_t> gu(e_count * 2 * inter * h), dn(e_count * h * inter);
    ASSERT_EQ(cudaMemcpy(gu.data(), gate_up, gu.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dn.data(), down, dn.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(src);
    cudaFree(gate_up);
    cudaFree(down);
    int wrong = 0;
    for (int e = 0; e < e_count; ++e) {
      const uint8_t* base = a.data + (layer * e_count + e) * a.expert_bytes;
      const experts::PackedMatrix g{a.gate_up, base}, d{a.down, base + a.gate_up.bytes()};
      for (int u = 0; u < inter; ++u) {
        for (int64_t k = 0; k < h; ++k) {
          // Unit u's gate row is packed row (u / 16) * 32 + u % 16, its up row 16 further.
          const int64_t n = (u / 16) * 32 + u % 16;
          wrong += gu[(e * 2 * inter + u) * h + k] != core::FloatToBf16(experts::UnpackValue(g, n, k));
          wrong += gu[(e * 2 * inter + inter + u) * h + k] != core::FloatToBf16(experts::UnpackValue(g, n + 16, k));
        }
      }
      for (int64_t n = 0; n < h; ++n) {
        for (int k = 0; k < inter; ++k) {
          wrong += dn[(e * h + n) * inter + k] != core::FloatToBf16(experts::UnpackValue(d, n, k));
        }
      }
    }
    EXPECT_EQ(wrong, 0) << experts::FormatName(format);
    // bf16 is stored as given: the unpacked gate of expert 0, unit 0, is the checkpoint's row.
    if (format == experts::ExpertFormat::kBF16) {
      for (int64_t k = 0; k < h; ++k) ASSERT_EQ(gu[k], weights[(layer * e_count) * 3][k]) << k;
    }
  }
}

}  // namespace
}  // namespace moe::runtime::cuda
