// The n-gram drafter and the draft-length controller, on synthetic sequences and timings (the
// timings are given, never measured: nothing here depends on this machine's speed).
#include "moe/runtime/speculative.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe::runtime {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(NgramDraftTest, ProposesWhatFollowedTheLatestEarlierOccurrence) {
  // "7 8 9" occurred twice; the later one was followed by 5 6.
  const std::vector<int32_t> tokens = {7, 8, 9, 1, 2, 7, 8, 9, 5, 6, 3, 7, 8, 9};
  std::vector<int32_t> draft;
  NgramDraft(tokens, 3, &draft);
  EXPECT_THAT(draft, ElementsAre(5, 6, 3));
  draft.clear();
  NgramDraft(tokens, 1, &draft);
  EXPECT_THAT(draft, ElementsAre(5));
}

TEST(NgramDraftTest, PrefersTheLongestMatch) {
  // The 2-gram "4 5" last occurred before 9; the 3-gram "3 4 5" before 1.
  const std::vector<int32_t> tokens = {3, 4, 5, 1, 2, 4, 5, 9, 3, 4, 5};
  std::vector<int32_t> draft;
  NgramDraft(tokens, 2, &draft);
  EXPECT_THAT(draft, ElementsAre(1, 2));
}

TEST(NgramDraftTest, DraftsRunIntoTheSuffixAndStopAtTheEnd) {
  const std::vector<int32_t> tokens = {1, 2, 1, 2, 1, 2};
  std::vector<int32_t> draft;
  NgramDraft(tokens, 8, &draft);
  EXPECT_THAT(draft, ElementsAre(1, 2));  // after the match at 2..5 come the last two tokens
}

TEST(NgramDraftTest, NothingWithoutARepeatOrRoom) {
  std::vector<int32_t> draft;
  NgramDraft(std::vector<int32_t>{1, 2, 3, 4, 5}, 4, &draft);
  EXPECT_THAT(draft, IsEmpty());
  NgramDraft(std::vector<int32_t>{1, 2, 1, 2}, 0, &draft);
  EXPECT_THAT(draft, IsEmpty());
  NgramDraft(std::vector<int32_t>{}, 4, &draft);
  NgramDraft(std::vector<int32_t>{5}, 4, &draft);
  EXPECT_THAT(draft, IsEmpty());
  // One repeated token is below the default 2-token match; a 1-token minimum takes it.
  NgramDraft(std::vector<int32_t>{4, 6, 4}, 4, &draft);
  EXPECT_THAT(draft, IsEmpty());
  NgramDraft(std::vector<int32_t>{4, 6, 4}, 4, &draft, {.min_match = 1, .max_match = 3});
  EXPECT_THAT(draft, ElementsAre(6, 4));
}

TEST(SpeculativeConfigTest, NamesAndRefusals) {
  EXPECT_EQ(*ParseSpecType("ngram"), SpecType::kNgram);
  EXPECT_EQ(*ParseSpecType("off"), SpecType::kOff);
  EXPECT_THAT(ParseSpecType("eagle").status().message(), HasSubstr("'eagle' is not a speculative method"));
  SpeculativeConfig c;
  c.type = SpecType::kNgram;
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.max_draft(), 3);
  c.n_max = 17;
  EXPECT_THAT(c.Validate().message(), HasSubstr("n_max: 17 is not in [1, 16]"));
  c.n_max = 2;
  c.draft_model = "/m";
  EXPECT_THAT(c.Validate().message(), HasSubstr("only read with type draft"));
  c = {};
  c.type = SpecType::kMtp;  // the checkpoint's head is checked where it is loaded
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.max_draft(), 3);
  c.type = SpecType::kOff;
  EXPECT_EQ(c.max_draft(), 0);
}

// The step times measured on the 16-layer bench model (routed experts on the CPU, int8), and
// with everything on the GPU.
void Hybrid(DraftController* c) {
  for (int i = 0; i < 3; ++i) {
    c->ObserveStep(1, 5.5e-3);
    c->ObserveStep(2, 9.5e-3);
    c->ObserveStep(4, 17.5e-3);
  }
}
void AllOnGpu(DraftController* c) {
  for (int i = 0; i < 3; ++i) {
    c->ObserveStep(1, 1.38e-3);
    c->ObserveStep(2, 1.94e-3);
    c->ObserveStep(4, 2.68e-3);
  }
}

AcceptanceHistory Accepting(float keep) {
  AcceptanceHistory h;
  for (float& k : h.keep) k = keep;
  return h;
}

TEST(DraftControllerTest, EstimatesStepTimeBetweenAndBeyondMeasuredRows) {
  DraftController c({});
  EXPECT_LT(c.EstimateSeconds(1), 0);
  c.ObserveStep(2, 4.0);
  EXPECT_DOUBLE_EQ(c.EstimateSeconds(2), 4.0);
  EXPECT_LT(c.EstimateSeconds(3), 0);  // one point gives no line
  c.ObserveStep(4, 8.0);
  EXPECT_DOUBLE_EQ(c.EstimateSeconds(3), 6.0);
  EXPECT_DOUBLE_EQ(c.EstimateSeconds(6), 12.0);
  EXPECT_DOUBLE_EQ(c.EstimateSeconds(1), 2.0);
}

TEST(DraftControllerTest, CheapVerifyAndHighAcceptanceDraftMore) {
  DraftController c({.n_max = 4});
  AllOnGpu(&c);
  AcceptanceHistory h = Accepting(0.9f);
  const int k = c.Choose(&h, 1, 1, 4);
  EXPECT_GE(k, 3);
  // As acceptance falls the best length shrinks.
  AcceptanceHistory weaker = Accepting(0.5f);
  EXPECT_LT(c.Choose(&weaker, 1, 1, 4), k);
  EXPECT_GT(c.Choose(&weaker, 1, 1, 4), 0);  // 1.5 tokens in 1.94 ms beat 1 in 1.38 ms
}

TEST(DraftControllerTest, CostlyVerifyTurnsDraftingOff) {
  DraftController c({.n_max = 4});
  Hybrid(&c);
  // 2 rows cost 1.73x one: even 70% acceptance serves fewer tokens per second.
  AcceptanceHistory h = Accepting(0.7f);
  EXPECT_EQ(c.Choose(&h, 1, 1, 4), 0);
  // Near-certain acceptance pays even there: 1.99 tokens in 9.5 ms beat 1 in 5.5.
  AcceptanceHistory sure = Accepting(0.99f);
  EXPECT_GT(c.Choose(&sure, 1, 1, 4), 0);
}

TEST(DraftControllerTest, LowAcceptanceTurnsDraftingOffEvenWhenCheap) {
  DraftController c({.n_max = 4});
  AllOnGpu(&c);
  AcceptanceHistory h;
  for (int step = 0; step < 10; ++step) c.ObserveVerify(&h, 2, 0);
  EXPECT_LT(h.keep[0], 0.1f);
  EXPECT_EQ(c.Choose(&h, 1, 1, 4), 0);
}

TEST(DraftControllerTest, HighConcurrencyTurnsDraftingOff) {
  DraftController c({.n_max = 4});
  // A batch of 32 decoding sequences: a row more costs as much as a sequence's share of the step.
  for (int i = 0; i < 3; ++i) {
    c.ObserveStep(32, 32e-3);
    c.ObserveStep(40, 40e-3);
  }
  AcceptanceHistory h = Accepting(0.8f);
  EXPECT_EQ(c.Choose(&h, 32, 32, 4), 0);
  // The same sequence alone, where the step has a fixed cost that drafts share.
  DraftController alone({.n_max = 4});
  for (int i = 0; i < 3; ++i) {
    alone.ObserveStep(1, 10e-3);
    alone.ObserveStep(5, 11e-3);
  }
  EXPECT_EQ(alone.Choose(&h, 1, 1, 4), 4);
}

TEST(DraftControllerTest, ProbesBackAfterAWhileAndWaitsLongerAfterAFailedProbe) {
  DraftController c({.n_max = 3, .probe_interval = 4});
  Hybrid(&c);
  AcceptanceHistory h = Accepting(0.3f);
  std::vector<int> picks;
  for (int step = 0; step < 13; ++step) picks.push_back(c.Choose(&h, 1, 1, 3));
  // Off for 3 steps, a probe on the 4th; after the probe the wait doubles to 8.
  EXPECT_THAT(picks, ElementsAre(0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0));
  // A probe that finds the text predictable now turns drafting back on for good.
  for (int step = 0; step < 20; ++step) c.ObserveVerify(&h, 1, 1);
  for (float& k : h.keep) k = std::max(k, 0.995f);
  EXPECT_GT(c.Choose(&h, 1, 1, 3), 0);
  EXPECT_EQ(h.probes, 0);
}

TEST(DraftControllerTest, NotAdaptiveAlwaysTakesTheMost) {
  DraftController c({.n_max = 3, .adaptive = false});
  Hybrid(&c);
  AcceptanceHistory h = Accepting(0.0f);
  EXPECT_EQ(c.Choose(&h, 1, 1, 5), 3);
  EXPECT_EQ(c.Choose(&h, 1, 1, 2), 2);
  EXPECT_EQ(c.Choose(&h, 1, 1, 0), 0);
}

TEST(DraftControllerTest, NothingMeasuredYetTriesOneDraft) {
  DraftController c({.n_max = 3});
  AcceptanceHistory h;
  EXPECT_EQ(c.Choose(&h, 1, 1, 3), 1);
  c.ObserveStep(1, 1e-3);
  EXPECT_EQ(c.Choose(&h, 1, 1, 3), 1);  // still no line through two row counts
}

TEST(DraftControllerTest, VerifyOutcomesMoveOnlyThePositionsReached) {
  DraftController c({.ema = 0.5f});
  AcceptanceHistory h = Accepting(0.5f);
  c.ObserveVerify(&h, 3, 1);  // draft 0 kept, draft 1 rejected, draft 2 never reached
  EXPECT_FLOAT_EQ(h.keep[0], 0.75f);
  EXPECT_FLOAT_EQ(h.keep[1], 0.25f);
  EXPECT_FLOAT_EQ(h.keep[2], 0.5f);
  EXPECT_DOUBLE_EQ(DraftController::ExpectedTokens(h, 2), 1 + 0.75 + 0.75 * 0.25);
}

}  // namespace
}  // namespace moe::runtime
