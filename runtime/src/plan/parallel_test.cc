#include "moe/runtime/parallel.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe::runtime {
namespace {

using ::testing::HasSubstr;

ModelSpec Spec(int heads, int kv_heads, int layers = 4) {
  ModelSpec s;
  s.num_heads = heads;
  s.num_kv_heads = kv_heads;
  s.num_layers = layers;
  s.intermediate_size = 100;
  s.shared_expert_intermediate_size = 30;
  s.vocab_size = 512;
  return s;
}

TEST(TensorShardTest, HeadsColumnsAndVocabAreSplitEvenly) {
  const ModelSpec spec = Spec(32, 4);
  auto s = PlanTensorShard(spec, 1, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->q_heads, (Range{16, 32}));
  EXPECT_EQ(s->kv_heads, (Range{2, 4}));
  EXPECT_EQ(s->dense, (Range{50, 100}));
  EXPECT_EQ(s->shared, (Range{15, 30}));
  EXPECT_EQ(s->vocab, (Range{256, 512}));
  EXPECT_TRUE(s->OwnsExpert(3));
  EXPECT_FALSE(s->OwnsExpert(4));
}

TEST(TensorShardTest, FewerKvHeadsThanRanksAreHeldByEachRankThatReadsThem) {
  const ModelSpec spec = Spec(8, 2);
  for (int rank = 0; rank < 4; ++rank) {
    auto s = PlanTensorShard(spec, rank, 4);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->q_heads, (Range{2 * rank, 2 * rank + 2}));
    EXPECT_EQ(s->kv_heads, (Range{rank / 2, rank / 2 + 1})) << "rank " << rank;
  }
}

TEST(TensorShardTest, UnevenSplitsOfColumnsAndAnOddVocabulary) {
  ModelSpec spec = Spec(6, 3);
  spec.vocab_size = 514;
  auto s = PlanTensorShard(spec, 2, 3);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->dense, (Range{66, 100}));  // 100 * 2 / 3 = 66
  EXPECT_EQ(s->vocab, (Range{0, 514}));   // held whole: 514 rows do not split in three equal shards
}

TEST(TensorShardTest, ImpossibleSplitsSayWhatToChange) {
  auto s = PlanTensorShard(Spec(32, 4), 0, 3);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("num_attention_heads (32) divisible by it"));
  s = PlanTensorShard(Spec(24, 6), 0, 4);  // 24 heads split in 4, but 6 KV heads neither way
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("num_key_value_heads (6)"));
  EXPECT_FALSE(PlanTensorShard(Spec(8, 8), 2, 2).ok());
}

TEST(LayerStageTest, ContiguousAndAsEvenAsTheLayersAllow) {
  const ModelSpec spec = Spec(8, 8, 7);
  EXPECT_EQ(*PlanLayerStage(spec, 0, 3), (Range{0, 3}));
  EXPECT_EQ(*PlanLayerStage(spec, 1, 3), (Range{3, 5}));
  EXPECT_EQ(*PlanLayerStage(spec, 2, 3), (Range{5, 7}));
  auto s = PlanLayerStage(spec, 0, 8);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("the model has 7 (num_hidden_layers)"));
}

}  // namespace
}  // namespace moe::runtime
