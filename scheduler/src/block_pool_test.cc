#include "moe/scheduler/block_pool.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe::scheduler {
namespace {

using ::testing::ElementsAre;

TEST(BlockPoolTest, AllocatesReleasesAndRefusesWhenFull) {
  BlockPool pool(4);
  std::vector<int32_t> a, b;
  ASSERT_TRUE(pool.Allocate(3, &a).ok());
  EXPECT_EQ(a, std::vector<int32_t>({0, 1, 2}));
  EXPECT_EQ(pool.num_free(), 1);
  absl::Status full = pool.Allocate(2, &b);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), ::testing::HasSubstr("2 blocks wanted, 1 of 4 free"));
  EXPECT_TRUE(b.empty());  // nothing taken
  pool.Release(&a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(pool.num_free(), 4);
  // Released blocks come back in their table's order.
  ASSERT_TRUE(pool.Allocate(4, &b).ok());
  EXPECT_EQ(b, std::vector<int32_t>({0, 1, 2, 3}));
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_EQ(pool.counters().allocated, 7);
}

// A committed block outlives its sequence: a later lookup of the same hashes takes it again, and
// a block two sequences hold is freed only when the last lets go.
TEST(BlockPoolTest, ASharedBlockIsFreedOnlyWhenItsLastHolderReleasesIt) {
  BlockPool pool(4);
  std::vector<int32_t> first;
  ASSERT_TRUE(pool.Allocate(3, &first).ok());
  pool.Commit(first[0], 100);
  pool.Commit(first[1], 101);  // first[2] is the partial tail: never committed
  std::vector<int32_t> second;
  const std::vector<BlockHash> prefix = {100, 101, 102};
  EXPECT_EQ(pool.Lookup(prefix, &second), 2);
  EXPECT_THAT(second, ElementsAre(first[0], first[1]));
  EXPECT_EQ(pool.refcount(first[0]), 2);
  EXPECT_EQ(pool.refcount(first[2]), 1);

  const std::vector<int32_t> shared = {first[0], first[1]};
  const int32_t tail = first[2];
  pool.Release(&first);
  EXPECT_EQ(pool.refcount(shared[0]), 1);  // still the second sequence's
  EXPECT_EQ(pool.num_free(), 2);           // the tail and the never-used block
  EXPECT_EQ(pool.num_cached_free(), 0);
  // Allocating everything free cannot take a block the second sequence holds.
  std::vector<int32_t> third;
  ASSERT_TRUE(pool.Allocate(2, &third).ok());
  EXPECT_THAT(third, ::testing::UnorderedElementsAre(tail, 3));
  EXPECT_EQ(pool.Allocate(1, &third).code(), absl::StatusCode::kResourceExhausted);

  pool.Release(&second);
  EXPECT_EQ(pool.num_cached_free(), 2);  // nobody holds them, their hashes are kept
  std::vector<int32_t> again;
  EXPECT_EQ(pool.Lookup(prefix, &again), 2);
  EXPECT_EQ(again, shared);
  EXPECT_EQ(pool.num_cached_free(), 0);
  EXPECT_EQ(pool.counters().hits, 4);
  EXPECT_EQ(pool.counters().looked_up, 6);
}

TEST(BlockPoolTest, AllocateTakesFreeBlocksFirstThenEvictsTheLeastRecentlyFreed) {
  BlockPool pool(5);
  std::vector<int32_t> a, b;
  ASSERT_TRUE(pool.Allocate(2, &a).ok());  // 0, 1
  ASSERT_TRUE(pool.Allocate(2, &b).ok());  // 2, 3
  for (int32_t block : a) pool.Commit(block, 10 + block);
  for (int32_t block : b) pool.Commit(block, 10 + block);
  pool.Release(&a);  // freed first: 1 then 0 (a table's tail goes first)
  pool.Release(&b);  // then 3, 2
  EXPECT_EQ(pool.num_cached_free(), 4);
  EXPECT_EQ(pool.num_free(), 5);

  std::vector<int32_t> c;
  ASSERT_TRUE(pool.Allocate(3, &c).ok());
  // The never-used block 4 first, then the least recently freed cached ones: 1, then 0.
  EXPECT_THAT(c, ElementsAre(4, 1, 0));
  EXPECT_EQ(pool.counters().evicted, 2);
  // Their hashes are gone; 2 and 3 are still found.
  std::vector<int32_t> hit;
  const std::vector<BlockHash> evicted = {10, 11};
  EXPECT_EQ(pool.Lookup(evicted, &hit), 0);
  const std::vector<BlockHash> kept = {12, 13};
  EXPECT_EQ(pool.Lookup(kept, &hit), 2);
  EXPECT_THAT(hit, ElementsAre(2, 3));
  EXPECT_EQ(pool.num_free(), 0);
}

TEST(BlockPoolTest, ASecondBlockWithTheSameHashStaysPrivate) {
  BlockPool pool(3);
  std::vector<int32_t> a, b;
  ASSERT_TRUE(pool.Allocate(1, &a).ok());
  ASSERT_TRUE(pool.Allocate(1, &b).ok());
  pool.Commit(a[0], 7);
  pool.Commit(b[0], 7);  // computed twice: the first stays the shared one
  EXPECT_EQ(pool.counters().committed, 1);
  pool.Release(&b);
  EXPECT_EQ(pool.num_cached_free(), 0);  // b's block went to the free list
  std::vector<int32_t> hit;
  const std::vector<BlockHash> hashes = {7};
  EXPECT_EQ(pool.Lookup(hashes, &hit), 1);
  EXPECT_EQ(hit[0], a[0]);
}

}  // namespace
}  // namespace moe::scheduler
