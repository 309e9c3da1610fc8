#include "moe/runtime/kv_cache.h"

#include "gtest/gtest.h"
#include "moe/runtime/backend_cpu.h"

namespace moe::runtime {
namespace {

TEST(KvCacheTest, LayersDoNotOverlapAndHoldAScratchBlock) {
  auto backend = CreateCpuBackend(1);
  KvCacheShape shape{2, 3, 4, 2, 8};
  auto cache = backend->CreateKvCache(shape);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ((*cache)->scratch_block(), 3);
  // Each layer holds num_blocks + 1 blocks of 4 x 2 x 8 floats.
  EXPECT_EQ(static_cast<float*>((*cache)->k(1)) - static_cast<float*>((*cache)->k(0)), 4 * 4 * 2 * 8);
  EXPECT_EQ(BlocksFor(17, 16), 2);
  EXPECT_EQ(BlocksFor(16, 16), 1);
  auto bad = backend->CreateKvCache(KvCacheShape{2, 0, 4, 2, 8});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::runtime
