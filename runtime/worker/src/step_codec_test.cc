#include "moe/worker/step_codec.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/model_executor.h"

namespace moe::worker {
namespace {

using ::testing::HasSubstr;

runtime::SequenceChunk Chunk(int64_t first, int32_t n, std::vector<int32_t> blocks, uint64_t seq_id) {
  return runtime::SequenceChunk{first, n, std::move(blocks), seq_id};
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
  ASSERT_EQ(got->sequences.size(), 1u);
  ASSERT_EQ(want->sequences.size(), 1u);
  ASSERT_EQ(got->sequences[0].tokens.size(), 3u);  // one token per logit row: no drafts
  EXPECT_EQ(got->sequences[0].tokens, want->sequences[0].tokens);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(got->sequences[0].logprobs[i].has_value());
    EXPECT_EQ(got->sequences[0].logprobs[i]->top, want->sequences[0].logprobs[i]->top) << "row " << i;
  }
}

// A worker's view of plans: each goes through the codec (as over the control stream) and runs on
// the worker's ModelExecutor, whose result travels back through the codec too.
class OverTheCodec : public runtime::Executor {
 public:
  explicit OverTheCodec(runtime::Executor& worker) : worker_(worker) {}
  absl::StatusOr<runtime::StepResult> Execute(const runtime::StepPlan& plan) override {
    auto request = encoder_.Encode(plan);
    if (!request.ok()) return request.status();
    auto decoded = decoder_.Decode(*request);
    if (!decoded.ok()) return decoded.status();
    auto result = worker_.Execute(*decoded);
    if (!result.ok()) return result.status();
    runtime::StepResult back;
    for (const runtime::SequenceResult& r : result->sequences) back.sequences.push_back(FromProto(ToProto(r)));
    return back;
  }
  runtime::KvCapacity kv_capacity() const override { return worker_.kv_capacity(); }
  const runtime::ModelInfo& model_info() const override { return worker_.model_info(); }
  std::string Describe() const override { return "over the codec"; }

 private:
  runtime::Executor& worker_;
  PlanEncoder encoder_;
  PlanDecoder decoder_;
};

// Decoding sequence 21 (blocks 0..7 of 4 positions) `n` tokens after `prompt` on `executor`, up
// to `k` drafts a step from `propose`; `drafted`/`accepted` count them.
std::vector<int32_t> Decode(runtime::Executor& executor, const std::vector<int32_t>& prompt, int n, int k,
                            const runtime::SamplingParams& sampling,
                            const std::function<std::vector<int32_t>(size_t, int)>& propose, int* drafted,
                            int* accepted) {
  std::vector<int32_t> tokens = prompt;
  int64_t computed = 0;
  const std::vector<int32_t> blocks = {0, 1, 2, 3, 4, 5, 6, 7};
  while (static_cast<int>(tokens.size()) < static_cast<int>(prompt.size()) + n) {
    const int room = static_cast<int>(prompt.size()) + n - static_cast<int>(tokens.size()) - 1;
    const std::vector<int32_t> drafts =
        computed == 0 ? std::vector<int32_t>{} : propose(tokens.size(), std::min(k, room));
    runtime::StepPlan plan;
    plan.batch.token_ids.assign(tokens.begin() + computed, tokens.end());
    plan.batch.token_ids.insert(plan.batch.token_ids.end(), drafts.begin(), drafts.end());
    runtime::SequenceChunk& chunk = plan.batch.sequences.emplace_back();
    chunk.first_position = computed;
    chunk.num_tokens = static_cast<int32_t>(plan.batch.token_ids.size());
    chunk.block_table = blocks;
    chunk.seq_id = 21;
    chunk.num_draft = static_cast<int32_t>(drafts.size());
    for (size_t i = 0; i <= drafts.size(); ++i) {
      plan.batch.logit_rows.push_back(chunk.num_tokens - chunk.num_draft - 1 + static_cast<int32_t>(i));
      runtime::SampleRow row;
      row.sampling = sampling;
      row.seed = 3;
      row.position = static_cast<uint32_t>(tokens.size() + i);
      row.prompt_len = static_cast<int32_t>(prompt.size());
      row.history = tokens;
      row.history.insert(row.history.end(), drafts.begin(), drafts.begin() + i);
      plan.samples.push_back(std::move(row));
    }
    auto step = executor.Execute(plan);
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) return {};
    const runtime::SequenceResult& r = step->sequences.at(0);
    *drafted += r.drafted;
    *accepted += r.accepted;
    // The next step starts after the kept drafts: below what the worker's mirror holds when some
    // were rejected.
    computed = static_cast<int64_t>(tokens.size()) + r.accepted;
    tokens.insert(tokens.end(), r.tokens.begin(), r.tokens.end());
  }
  return std::vector<int32_t>(tokens.begin() + prompt.size(), tokens.end());
}

// Drafts, rollbacks and each draft row's own penalty history, through the codec: a worker gives
// the tokens that plain decoding gives in process.
TEST(StepCodecTest, DraftsAndRollbacksOverTheCodecChangeNothing) {
  runtime::ModelOptions options;
  options.threads = 2;
  options.pool.threads = 2;
  options.pool.progress = false;
  auto model = runtime::Model::Load(FixtureDir("qwen3_moe"), options);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->spec().vocab_size;
  runtime::SamplingParams sampling;
  sampling.temperature = 0.8f;
  sampling.repetition_penalty = 1.5f;
  sampling.presence_penalty = 0.3f;
  const std::vector<int32_t> prompt = {3, 17, 17, 42, 5, 9};
  constexpr int kTokens = 12;
  auto in_process = runtime::ModelExecutor::Create(**model, 8, 4);
  auto worker = runtime::ModelExecutor::Create(**model, 8, 4);
  ASSERT_TRUE(in_process.ok() && worker.ok());
  int drafted = 0, accepted = 0;
  auto none = [](size_t, int) { return std::vector<int32_t>{}; };
  const std::vector<int32_t> plain = Decode(**in_process, prompt, kTokens, 0, sampling, none, &drafted, &accepted);
  ASSERT_EQ(plain.size(), static_cast<size_t>(kTokens));

  OverTheCodec codec(**worker);
  // Right drafts for even positions, wrong ones after: every step keeps some and rolls back.
  auto mixed = [&](size_t length, int most) {
    std::vector<int32_t> drafts;
    for (int i = 0; i < most; ++i) {
      const int32_t right = plain[length - prompt.size() + i];
      drafts.push_back(i == 0 ? right : (right + 1) % vocab);
    }
    return drafts;
  };
  EXPECT_EQ(Decode(codec, prompt, kTokens, 3, sampling, mixed, &drafted, &accepted), plain);
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

// The mirror follows rollbacks and takes a cached prefix for a sequence it has not seen.
TEST(StepCodecTest, TheMirrorRollsBackAndTakesACachedPrefix) {
  PlanEncoder encoder;
  PlanDecoder decoder;
  runtime::StepPlan p1;
  p1.batch.token_ids = {10, 11, 12, 13, 14};  // two tokens, then three drafts
  p1.batch.sequences = {Chunk(0, 5, {4, 5}, 5)};
  p1.batch.sequences[0].num_draft = 3;
  auto r1 = encoder.Encode(p1);
  ASSERT_TRUE(r1.ok());
  auto d1 = decoder.Decode(*r1);
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_EQ(d1->batch.sequences[0].num_draft, 3);

  // One draft was kept: the next step starts at 3, below the mirror's 5 tokens.
  runtime::StepPlan p2;
  p2.batch.token_ids = {20};
  p2.batch.sequences = {Chunk(3, 1, {4, 5}, 5)};
  p2.batch.logit_rows = {0};
  p2.samples = {Row(4, true)};
  auto d2 = decoder.Decode(*encoder.Encode(p2));
  ASSERT_TRUE(d2.ok()) << d2.status();
  EXPECT_EQ(d2->samples[0].history, (std::vector<int32_t>{10, 11, 12, 20}));

  // Beyond the mirror's length is still refused.
  moeserve::v1::StepRequest ahead = *encoder.Encode(p2);
  ahead.mutable_sequences(0)->set_first_position(9);
  EXPECT_THAT(decoder.Decode(ahead).status().message(), HasSubstr("continues at position 9 but has 4 tokens"));

  // A sequence not seen before that starts on a cached prefix brings the prefix.
  runtime::StepPlan p3;
  p3.batch.token_ids = {33};
  p3.batch.sequences = {Chunk(3, 1, {6}, 8)};
  p3.batch.sequences[0].prefix = {30, 31, 32};
  p3.batch.sequences[0].state_slot = 2;
  p3.batch.sequences[0].want_drafts = 4;
  p3.batch.logit_rows = {0};
  p3.samples = {Row(4, true)};
  auto d3 = decoder.Decode(*encoder.Encode(p3));
  ASSERT_TRUE(d3.ok()) << d3.status();
  EXPECT_EQ(d3->samples[0].history, (std::vector<int32_t>{30, 31, 32, 33}));
  EXPECT_EQ(d3->batch.sequences[0].state_slot, 2);
  EXPECT_EQ(d3->batch.sequences[0].want_drafts, 4);
  EXPECT_EQ(d2->batch.sequences[0].state_slot, -1);
  moeserve::v1::StepRequest short_prefix = *encoder.Encode(p3);
  short_prefix.mutable_sequences(0)->set_id(9);
  short_prefix.mutable_sequences(0)->mutable_prefix()->RemoveLast();
  EXPECT_THAT(decoder.Decode(short_prefix).status().message(),
              HasSubstr("starts at position 3 with a prefix of 2 tokens"));
}

TEST(StepCodecTest, SequenceResultsWithLogprobsAndErrorsRoundTrip) {
  runtime::SequenceResult r;
  r.tokens = {42, 9};
  r.logprobs = {runtime::TokenLogprobs{-0.5f, {{42, -0.5f}, {7, -1.25f}}}, std::nullopt};
  r.drafted = 3;
  r.accepted = 1;
  r.drafts = {5, 6};
  const runtime::SequenceResult back = FromProto(ToProto(r));
  EXPECT_EQ(back.drafts, r.drafts);
  EXPECT_EQ(back.tokens, r.tokens);
  ASSERT_EQ(back.logprobs.size(), 2u);
  ASSERT_TRUE(back.logprobs[0].has_value());
  EXPECT_EQ(back.logprobs[0]->top, r.logprobs[0]->top);
  EXPECT_FALSE(back.logprobs[1].has_value());
  EXPECT_EQ(back.drafted, 3);
  EXPECT_EQ(back.accepted, 1);
  runtime::SequenceResult bad;
  bad.error = absl::InternalError("logits not finite at 3");
  EXPECT_EQ(FromProto(ToProto(bad)).error, bad.error);
}

}  // namespace
}  // namespace moe::worker
