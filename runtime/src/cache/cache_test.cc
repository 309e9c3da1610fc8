#include "moe/runtime/cache.h"

#include "gtest/gtest.h"
#include "moe/runtime/backend_cpu.h"

namespace moe::runtime {
namespace {

ModelSpec Spec(int layers, int kv_heads, int head_dim) {
  ModelSpec spec;
  spec.num_layers = layers;
  spec.num_kv_heads = kv_heads;
  spec.head_dim = head_dim;
  return spec;
}

TEST(CacheTest, EveryModelIsOnePagedKvGroupOfItsLayers) {
  const CachePlan plan = PlanCache(Spec(48, 4, 128), Range{8, 32}, CacheOptions{16, core::DType::kBF16});
  ASSERT_EQ(plan.groups.size(), 1u);
  const CacheGroup& g = plan.groups[0];
  EXPECT_EQ(g.kind, CacheKind::kPagedKv);
  EXPECT_EQ(g.num_layers(), 24);
  EXPECT_EQ(g.layers.front(), 8);
  EXPECT_EQ(g.layers.back(), 31);
  EXPECT_EQ(g.heads, 4);
  EXPECT_EQ(g.head_dim, 128);
  // K and V of 4 heads of 128 bf16 elements, 16 positions, 24 layers.
  EXPECT_EQ(g.bytes_per_block_layer, 2 * 4 * 128 * 2 * 16);
  EXPECT_EQ(plan.BlockBytes(), int64_t{2 * 4 * 128 * 2 * 16} * 24);
  EXPECT_EQ(plan.BytesPerToken(), int64_t{2 * 4 * 128 * 2} * 24);
  EXPECT_EQ(plan.StateBytesPerSequence(), 0);
  EXPECT_EQ(plan.block_size(), 16);
  EXPECT_EQ(plan.Find(CacheKind::kPagedKv), 0);
  EXPECT_EQ(plan.Find(CacheKind::kRecurrent), -1);
}

TEST(CacheTest, Fp8AddsOneScalePerPositionHeadAndKOrV) {
  const CachePlan fp8 = PlanCache(Spec(2, 8, 64), Range{0, 2}, CacheOptions{16, core::DType::kF8E4M3});
  EXPECT_EQ(fp8.BlockBytes(), int64_t{2} * 8 * (64 * 1 + 4) * 16 * 2);
  const CachePlan f32 = PlanCache(Spec(2, 8, 64), Range{0, 2}, CacheOptions{16, core::DType::kF32});
  EXPECT_EQ(f32.BlockBytes(), int64_t{2} * 8 * 64 * 4 * 16 * 2);
}

TEST(CacheTest, TheBackendAllocatesThePlanWithAScratchBlock) {
  auto backend = CreateCpuBackend(1);
  const CachePlan plan = PlanCache(Spec(2, 2, 8), Range{0, 2}, CacheOptions{4, backend->activation_dtype()});
  auto cache = backend->CreateKvCache(plan, 3);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ((*cache)->scratch_block(), 3);
  // Each layer holds num_blocks + 1 blocks of 4 x 2 x 8 floats.
  EXPECT_EQ(static_cast<float*>((*cache)->k(1)) - static_cast<float*>((*cache)->k(0)), 4 * 4 * 2 * 8);
  EXPECT_EQ((*cache)->k_scale(0), nullptr);
  EXPECT_EQ(BlocksFor(17, 16), 2);
  EXPECT_EQ(BlocksFor(16, 16), 1);
  EXPECT_EQ(backend->CreateKvCache(plan, 0).status().code(), absl::StatusCode::kInvalidArgument);

  CachePlan recurrent = plan;
  recurrent.groups[0].kind = CacheKind::kRecurrent;
  EXPECT_EQ(backend->CreateKvCache(recurrent, 3).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace moe::runtime
