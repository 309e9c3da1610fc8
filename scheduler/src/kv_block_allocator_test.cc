#include "moe/scheduler/kv_block_allocator.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe::scheduler {
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

}  // namespace
}  // namespace moe::scheduler
