#include "moe/runtime/kv_cache.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/backend_cpu.h"

namespace moe::runtime {
namespace {

TEST(KvBlockAllocatorTest, AllocatesFreesAndRefusesWhenFull) {
  KvBlockAllocator alloc(4);
  std::vector<int32_t> a, b;
  ASSERT_TRUE(alloc.Allocate(3, &a).ok());
  EXPECT_EQ(a, std::vector<int32_t>({0, 1, 2}));
  EXPECT_EQ(alloc.num_free(), 1);
  absl::Status full = alloc.Allocate(2, &b);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), ::testing::HasSubstr("2 blocks wanted, 1 of 4 free"));
  EXPECT_TRUE(b.empty());  // nothing taken
  alloc.Free(&a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(alloc.num_free(), 4);
  ASSERT_TRUE(alloc.Allocate(4, &b).ok());
  EXPECT_EQ(alloc.num_free(), 0);
}

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
