#include "moe/worker/step_codec.h"

#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/model_executor.h"

namespace moe::worker {
namespace {

using ::testing::HasSubstr;

runtime::SequenceChunk Chunk(int64_t first, int32_t n, std::vector<int32_t> blocks, uint64_t id) {
  return runtime::SequenceChunk{first, n, std::move(blocks), id};
}

runtime::SampleRow Row(uint32_t position, bool penalized) {
  runtime::SampleRow r;
  r.seed = 7;
  r.position = position;
  r.prompt_len = 3;
  if (penalized) r.sampling.repetition_penalty = 1.3f;
  return r;
}

// The decoder rebuilds the plan the encoder saw, step after step, from what changed.
TEST(StepCodecTest, PlansRoundTripAndOnlyChangesTravel) {
  PlanEncoder encoder;
  PlanDecoder decoder;
  // Step 1: a prompt of 3 tokens (id 5) and one of 2 (id 6).
  runtime::StepPlan p1;
  p1.batch.token_ids = {10, 11, 12, 20, 21};
  p1.batch.sequences = {Chunk(0, 3, {4}, 5), Chunk(0, 2, {9}, 6)};
  p1.batch.logit_rows = {2, 4};
  p1.samples = {Row(3, true), Row(2, false)};
  p1.samples[0].history = {10, 11, 12};
  auto r1 = encoder.Encode(p1);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_TRUE(r1->sequences(0).replace_blocks());
  auto d1 = decoder.Decode(*r1);
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_EQ(d1->batch.token_ids, p1.batch.token_ids);
  EXPECT_EQ(d1->batch.sequences[1].block_table, (std::vector<int32_t>{9}));
  EXPECT_EQ(d1->samples[0].history, (std::vector<int32_t>{10, 11, 12}));  // rebuilt from the tokens fed
  EXPECT_TRUE(d1->samples[1].history.empty());                            // unpenalized: none

  // Step 2: both decode; sequence 5 crosses into a new block (only the new block travels);
  // sequence 6 ended before the step.
  runtime::StepPlan p2;
  p2.batch.token_ids = {13};
  p2.batch.sequences = {Chunk(3, 1, {4, 8}, 5)};
  p2.batch.logit_rows = {0};
  p2.samples = {Row(4, true)};
  p2.released = {6};
  auto r2 = encoder.Encode(p2);
  ASSERT_TRUE(r2.ok());
  EXPECT_FALSE(r2->sequences(0).replace_blocks());
  EXPECT_EQ(std::vector<int32_t>(r2->sequences(0).blocks().begin(), r2->sequences(0).blocks().end()),
            (std::vector<int32_t>{8}));
  auto d2 = decoder.Decode(*r2);
  ASSERT_TRUE(d2.ok()) << d2.status();
  EXPECT_EQ(d2->batch.sequences[0].block_table, (std::vector<int32_t>{4, 8}));
  EXPECT_EQ(d2->samples[0].history, (std::vector<int32_t>{10, 11, 12, 13}));
  EXPECT_EQ(decoder.live_sequences(), 1u);
  EXPECT_EQ(encoder.live_sequences(), 1u);

  // A table that changed other than by appending travels whole.
  runtime::StepPlan p3;
  p3.batch.token_ids = {14};
  p3.batch.sequences = {Chunk(4, 1, {2, 8}, 5)};
  auto r3 = encoder.Encode(p3);
  ASSERT_TRUE(r3.ok());
  EXPECT_TRUE(r3->sequences(0).replace_blocks());
  auto d3 = decoder.Decode(*r3);
  ASSERT_TRUE(d3.ok());
  EXPECT_EQ(d3->batch.sequences[0].block_table, (std::vector<int32_t>{2, 8}));

  // The tables of further cache groups travel whole.
  runtime::StepPlan p4;
  p4.batch.token_ids = {15};
  p4.batch.sequences = {Chunk(5, 1, {2, 8}, 5)};
  p4.batch.sequences[0].more_block_tables = {{6, 7}, {1}};
  auto r4 = encoder.Encode(p4);
  ASSERT_TRUE(r4.ok());
  auto d4 = decoder.Decode(*r4);
  ASSERT_TRUE(d4.ok()) << d4.status();
  EXPECT_EQ(d4->batch.sequences[0].more_block_tables, p4.batch.sequences[0].more_block_tables);
}

// A request that does not fit the decoder's mirror is refused and changes nothing.
TEST(StepCodecTest, ARequestThatDoesNotFitIsRefusedWholly) {
  PlanDecoder decoder;
  moeserve::v1::StepRequest r;
  r.set_step(1);
  auto* s = r.add_sequences();
  s->set_id(3);
  s->set_first_position(5);  // never seen
  s->add_token_ids(1);
  auto d = decoder.Decode(r);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("has not seen it"));
  s->set_first_position(0);
  r.add_logit_rows(3);  // outside the one row
  r.add_samples();
  d = decoder.Decode(r);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("logit row 3 outside [0, 1)"));
  EXPECT_EQ(decoder.live_sequences(), 0u);
  PlanEncoder encoder;
  runtime::StepPlan p;
  p.batch.token_ids = {1};
  p.batch.sequences = {Chunk(0, 1, {0}, 0)};
  EXPECT_THAT(encoder.Encode(p).status().message(), HasSubstr("has no id"));
}

std::string FixtureDir(const std::string& arch) {
  const char* env = std::getenv("MOE_TESTDATA_DIR");  // set when the tests run from a bundle
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/fixtures/" + arch;
}

// A prefill chunk that asks for the logits of its last three rows, each penalized: through the
// codec, each row's penalty history must be the sequence's tokens before the position it draws,
// not everything fed by the end of the step, and the executor must then run the decoded plan as
// it runs the original.
TEST(StepCodecTest, APenalizedMultiRowStepRunsOnAWorkerAsInProcess) {
  runtime::ModelOptions options;
  options.threads = 2;
  options.pool.threads = 2;
  options.pool.progress = false;
  auto model = runtime::Model::Load(FixtureDir("qwen3_moe"), options);
  ASSERT_TRUE(model.ok()) << model.status();

  const std::vector<int32_t> prompt = {3, 17, 17, 42, 5, 9, 17, 42};
  const int32_t n = static_cast<int32_t>(prompt.size());
  runtime::StepPlan plan;
  plan.batch.token_ids = prompt;
  plan.batch.sequences = {Chunk(0, n, {0, 1}, 11)};
  for (int32_t row = n - 3; row < n; ++row) {
    plan.batch.logit_rows.push_back(row);
    runtime::SampleRow r;
    r.sampling.repetition_penalty = 1.8f;
    r.sampling.frequency_penalty = 0.7f;
    r.seed = 5;
    r.position = static_cast<uint32_t>(row + 1);
    r.prompt_len = 4;
    r.history.assign(prompt.begin(), prompt.begin() + row + 1);
    r.logprobs = 2;
    plan.samples.push_back(std::move(r));
  }

  PlanEncoder encoder;
  PlanDecoder decoder;
  auto request = encoder.Encode(plan);
  ASSERT_TRUE(request.ok()) << request.status();
  auto decoded = decoder.Decode(*request);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  for (size_t i = 0; i < plan.samples.size(); ++i) {
    EXPECT_EQ(decoded->samples[i].history, plan.samples[i].history) << "row " << i;
  }

  auto worker = runtime::ModelExecutor::Create(**model, 8, 8);
  auto in_process = runtime::ModelExecutor::Create(**model, 8, 8);
  ASSERT_TRUE(worker.ok() && in_process.ok());
  auto got = (*worker)->Execute(*decoded);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = (*in_process)->Execute(plan);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(got->size(), 3u);
  ASSERT_EQ(want->size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ((*got)[i].token, (*want)[i].token) << "row " << i;
    ASSERT_TRUE((*got)[i].logprobs.has_value());
    EXPECT_EQ((*got)[i].logprobs->top, (*want)[i].logprobs->top) << "row " << i;
  }
}

TEST(StepCodecTest, TokensWithLogprobsAndErrorsRoundTrip) {
  runtime::SampledToken t;
  t.token = 42;
  t.logprobs = runtime::TokenLogprobs{-0.5f, {{42, -0.5f}, {7, -1.25f}}};
  const runtime::SampledToken back = FromProto(ToProto(t));
  EXPECT_EQ(back.token, 42);
  ASSERT_TRUE(back.logprobs.has_value());
  EXPECT_EQ(back.logprobs->top, t.logprobs->top);
  runtime::SampledToken bad;
  bad.error = absl::InternalError("logits not finite at 3");
  EXPECT_EQ(FromProto(ToProto(bad)).error, bad.error);
}

}  // namespace
}  // namespace moe::worker
