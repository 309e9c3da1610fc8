#include "moe/runtime/kv_cache.h"

#include "gtest/gtest.h"
#include "moe/runtime/backend_cpu.h"

namespace moe::runtime {
namespace {

TEST(KvCacheTest, BlocksDoNotOverlap) {
  auto backend = CreateCpuBackend(1);
  KvCacheShape shape{2, 3, 4, 2, 8};
  auto cache = KvCache::Create(*backend, shape);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ((*cache)->k(0, 1) - (*cache)->k(0, 0), 4 * 2 * 8);
  EXPECT_EQ((*cache)->k(1, 0) - (*cache)->k(0, 2), 4 * 2 * 8);
  EXPECT_EQ(BlocksFor(17, 16), 2);
  EXPECT_EQ(BlocksFor(16, 16), 1);
  auto bad = KvCache::Create(*backend, KvCacheShape{2, 0, 4, 2, 8});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::runtime
