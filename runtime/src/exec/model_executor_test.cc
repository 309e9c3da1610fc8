// ModelExecutor over the tiny qwen3_moe fixture: a StepPlan is a value that owns what it names,
// and a row's token depends on the plan alone, so executors in different processes agree.
#include "moe/runtime/model_executor.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/cache.h"

namespace moe::runtime {
namespace {

using ::testing::HasSubstr;

static_assert(std::is_copy_constructible_v<StepPlan> && std::is_copy_assignable_v<StepPlan>,
              "a StepPlan is sent to every worker: it must be a plain value");

constexpr int kBlockSize = 4;

std::string FixtureDir(const std::string& arch) {
  const char* env = std::getenv("MOE_TESTDATA_DIR");  // set when the tests run from a bundle
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/fixtures/" + arch;
}

std::vector<int32_t> BlockTable(int first, int64_t positions) {
  std::vector<int32_t> table(BlocksFor(positions, kBlockSize));
  std::iota(table.begin(), table.end(), first);
  return table;
}

// A prefill step for each prompt, every one sampling its first token with `sampling`; sequence
// i's blocks start at block 16 * i.
StepPlan PrefillPlan(const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& sampling, uint64_t seed) {
  StepPlan plan;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<int32_t>& prompt = prompts[i];
    const int32_t size = static_cast<int32_t>(prompt.size());
    plan.batch.token_ids.insert(plan.batch.token_ids.end(), prompt.begin(), prompt.end());
    plan.batch.sequences.push_back(SequenceChunk{0, size, BlockTable(16 * static_cast<int>(i), size)});
    plan.batch.logit_rows.push_back(static_cast<int32_t>(plan.batch.token_ids.size()) - 1);
    SampleRow row;
    row.sampling = sampling;
    row.seed = seed + i;
    row.position = static_cast<uint32_t>(size);
    row.prompt_len = size;
    if (sampling.penalized()) row.history = prompt;
    row.logprobs = 2;
    plan.samples.push_back(std::move(row));
  }
  return plan;
}

// One decode step of one sequence (blocks from 0) that holds `tokens`, the last one new.
StepPlan DecodePlan(const std::vector<int32_t>& tokens, int prompt_len, const SamplingParams& sampling, uint64_t seed) {
  StepPlan plan;
  const int64_t last = static_cast<int64_t>(tokens.size()) - 1;
  plan.batch.token_ids = {tokens.back()};
  plan.batch.sequences = {SequenceChunk{last, 1, BlockTable(0, last + 1)}};
  plan.batch.logit_rows = {0};
  SampleRow row;
  row.sampling = sampling;
  row.seed = seed;
  row.position = static_cast<uint32_t>(tokens.size());
  row.prompt_len = prompt_len;
  if (sampling.penalized()) row.history = tokens;
  plan.samples = {std::move(row)};
  return plan;
}

class ModelExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelOptions options;
    options.pool.progress = false;
    options.threads = 2;
    options.pool.threads = 2;
    auto model = Model::Load(FixtureDir("qwen3_moe"), options);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }

  std::unique_ptr<ModelExecutor> NewExecutor(int num_blocks = 64) {
    auto executor = ModelExecutor::Create(*model_, num_blocks, kBlockSize);
    EXPECT_TRUE(executor.ok()) << executor.status();
    return executor.ok() ? *std::move(executor) : nullptr;
  }

  // `steps` tokens of one sequence after `prompt`, one plan per step on `executor`.
  std::vector<int32_t> Generate(ModelExecutor& executor, const std::vector<int32_t>& prompt, int steps,
                                const SamplingParams& sampling, uint64_t seed) {
    std::vector<int32_t> tokens = prompt;
    auto first = executor.Execute(PrefillPlan({prompt}, sampling, seed));
    EXPECT_TRUE(first.ok()) << first.status();
    if (!first.ok()) return {};
    tokens.push_back(first->sequences[0].tokens[0]);
    for (int i = 1; i < steps; ++i) {
      auto next = executor.Execute(DecodePlan(tokens, static_cast<int>(prompt.size()), sampling, seed));
      EXPECT_TRUE(next.ok()) << next.status();
      if (!next.ok()) return {};
      tokens.push_back(next->sequences[0].tokens[0]);
    }
    return std::vector<int32_t>(tokens.begin() + prompt.size(), tokens.end());
  }

  std::unique_ptr<Model> model_;
};

TEST_F(ModelExecutorTest, ReportsItsKvCapacityAndModel) {
  auto executor = NewExecutor(24);
  ASSERT_NE(executor, nullptr);
  EXPECT_EQ(executor->kv_capacity().num_blocks, 24);
  EXPECT_EQ(executor->kv_capacity().block_size, kBlockSize);
  const ModelInfo& info = executor->model_info();
  EXPECT_EQ(info.architecture, "qwen3_moe");
  EXPECT_EQ(info.vocab_size, 512);
  EXPECT_EQ(info.max_position_embeddings, 2048);
  EXPECT_EQ(info.num_experts, 16);
  EXPECT_EQ(info.experts_per_token, 4);
  EXPECT_THAT(executor->Describe(), HasSubstr("KV cache 24 blocks of 4 positions"));

  auto none = ModelExecutor::Create(*model_, 0, kBlockSize);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelExecutorTest, APlanCopiedAndDestroyedBeforeExecuteRunsAsTheOriginal) {
  SamplingParams penalized;
  penalized.repetition_penalty = 1.8f;
  penalized.presence_penalty = 0.5f;
  std::vector<std::vector<int32_t>> prompts = {{3, 17, 17, 42, 5, 9}, {100, 7, 7, 7, 250}};
  auto original = std::make_unique<StepPlan>(PrefillPlan(prompts, penalized, 7));
  const StepPlan copy = *original;
  // Nothing the copy names may live in the original or in what it was built from.
  original.reset();
  for (auto& prompt : prompts) std::fill(prompt.begin(), prompt.end(), 0);

  auto executor = NewExecutor();
  ASSERT_NE(executor, nullptr);
  auto got = executor->Execute(copy);
  ASSERT_TRUE(got.ok()) << got.status();

  // What the same step gives on a second executor from a plan built afresh.
  const std::vector<std::vector<int32_t>> again = {{3, 17, 17, 42, 5, 9}, {100, 7, 7, 7, 250}};
  auto other = NewExecutor();
  ASSERT_NE(other, nullptr);
  auto want = other->Execute(PrefillPlan(again, penalized, 7));
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(got->sequences.size(), 2u);
  for (size_t i = 0; i < got->sequences.size(); ++i) {
    ASSERT_EQ(got->sequences[i].tokens.size(), 1u);
    EXPECT_EQ(got->sequences[i].tokens, want->sequences[i].tokens) << "row " << i;
    ASSERT_TRUE(got->sequences[i].logprobs[0].has_value());
    EXPECT_EQ(got->sequences[i].logprobs[0]->top, want->sequences[i].logprobs[0]->top) << "row " << i;
  }

  // And what the penalties must give, computed here: greedy over the penalized logits.
  auto cache = model_->NewKvCache(64, kBlockSize);
  ASSERT_TRUE(cache.ok());
  std::vector<float> logits;
  ASSERT_TRUE(model_->Forward(PrefillPlan(again, penalized, 7).batch, **cache, &logits).ok());
  const int vocab = model_->spec().vocab_size;
  for (size_t i = 0; i < again.size(); ++i) {
    float* row = logits.data() + i * vocab;
    ApplyPenalties(penalized, again[i].data(), static_cast<int>(again[i].size()), nullptr, 0, row, vocab);
    EXPECT_EQ(got->sequences[i].tokens[0], ArgMax(row, vocab)) << "row " << i;
  }
}

TEST_F(ModelExecutorTest, TwoExecutorsOnOneModelDrawTheSameTokensFromTheSameSeeds) {
  SamplingParams sampling;
  sampling.temperature = 1.5f;  // flat enough that every draw depends on the seed
  sampling.top_p = 0.95f;
  const std::vector<int32_t> prompt = {11, 12, 13, 14, 15};
  auto a = NewExecutor();
  auto b = NewExecutor();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // One after the other on the shared model; b is what another process would run.
  const std::vector<int32_t> from_a = Generate(*a, prompt, 12, sampling, 1234);
  const std::vector<int32_t> from_b = Generate(*b, prompt, 12, sampling, 1234);
  EXPECT_EQ(from_a.size(), 12u);
  EXPECT_EQ(from_a, from_b);
  // Executing again on the same executor changes nothing: no sampler state lives in it.
  EXPECT_EQ(Generate(*a, prompt, 12, sampling, 1234), from_a);
  // The seed is what decides.
  EXPECT_NE(Generate(*b, prompt, 12, sampling, 4321), from_a);
}

// One verify step of one sequence (blocks from 0) that holds `tokens` (the last one not yet in
// the cache), carrying `drafts` after it: a logit row for the last token and one per draft, row i
// drawing at position tokens.size() + i.
StepPlan DraftPlan(const std::vector<int32_t>& tokens, const std::vector<int32_t>& drafts, int prompt_len,
                   const SamplingParams& sampling, uint64_t seed) {
  StepPlan plan;
  const int64_t first = static_cast<int64_t>(tokens.size()) - 1;
  const int32_t k = static_cast<int32_t>(drafts.size());
  plan.batch.token_ids = {tokens.back()};
  plan.batch.token_ids.insert(plan.batch.token_ids.end(), drafts.begin(), drafts.end());
  SequenceChunk chunk{first, k + 1, BlockTable(0, first + k + 1)};
  chunk.num_draft = k;
  plan.batch.sequences = {chunk};
  for (int32_t i = 0; i <= k; ++i) {
    plan.batch.logit_rows.push_back(i);
    SampleRow row;
    row.sampling = sampling;
    row.seed = seed;
    row.position = static_cast<uint32_t>(tokens.size() + i);
    row.prompt_len = prompt_len;
    if (sampling.penalized()) {
      row.history = tokens;
      row.history.insert(row.history.end(), drafts.begin(), drafts.begin() + i);
    }
    row.logprobs = 1;
    plan.samples.push_back(std::move(row));
  }
  return plan;
}

// Decodes `n` tokens after `prompt` with up to `k` drafts a step from `propose` (given the
// tokens so far and how many to propose); returns the tokens and counts the drafts kept.
std::vector<int32_t> DecodeWithDrafts(
    Executor& executor, const std::vector<int32_t>& prompt, int n, int k, const SamplingParams& sampling, uint64_t seed,
    const std::function<std::vector<int32_t>(const std::vector<int32_t>&, int)>& propose, int* drafted, int* accepted) {
  std::vector<int32_t> tokens = prompt;
  auto first = executor.Execute(PrefillPlan({prompt}, sampling, seed));
  EXPECT_TRUE(first.ok()) << first.status();
  if (!first.ok()) return {};
  tokens.push_back(first->sequences[0].tokens[0]);
  const int end = static_cast<int>(prompt.size()) + n;
  while (static_cast<int>(tokens.size()) < end) {
    const int most = std::min(k, end - static_cast<int>(tokens.size()) - 1);
    const StepPlan plan = DraftPlan(tokens, propose(tokens, most), static_cast<int>(prompt.size()), sampling, seed);
    auto step = executor.Execute(plan);
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) return {};
    const SequenceResult& r = step->sequences.at(0);
    EXPECT_TRUE(r.error.ok()) << r.error;
    EXPECT_EQ(r.drafted, plan.batch.sequences[0].num_draft);
    EXPECT_EQ(r.tokens.size(), static_cast<size_t>(r.accepted) + 1);
    EXPECT_EQ(r.logprobs.size(), r.tokens.size());
    *drafted += r.drafted;
    *accepted += r.accepted;
    tokens.insert(tokens.end(), r.tokens.begin(), r.tokens.end());
  }
  return std::vector<int32_t>(tokens.begin() + prompt.size(), tokens.end());
}

// Speculation changes nothing: drafts that greedy (or seeded) decoding would produce are all kept,
// drafts that differ are all rejected, and either way the tokens are those of plain decoding.
TEST_F(ModelExecutorTest, DraftsChangeNothing) {
  const std::vector<int32_t> prompt = {3, 17, 17, 42, 5, 9};
  SamplingParams greedy;
  SamplingParams seeded;
  seeded.temperature = 1.2f;
  seeded.top_p = 0.95f;
  SamplingParams penalized;
  penalized.repetition_penalty = 1.6f;
  penalized.frequency_penalty = 0.4f;
  constexpr int kTokens = 14, kDraft = 3;
  for (const SamplingParams& sampling : {greedy, seeded, penalized}) {
    auto executor = NewExecutor();
    ASSERT_NE(executor, nullptr);
    const std::vector<int32_t> plain = Generate(*executor, prompt, kTokens, sampling, 77);
    ASSERT_EQ(plain.size(), static_cast<size_t>(kTokens));
    const int vocab = model_->spec().vocab_size;
    // What plain decoding produces next, or tokens that differ from it.
    auto right = [&](const std::vector<int32_t>& tokens, int most) {
      const size_t at = tokens.size() - prompt.size();
      return std::vector<int32_t>(plain.begin() + at, plain.begin() + at + most);
    };
    auto wrong = [&](const std::vector<int32_t>& tokens, int most) {
      std::vector<int32_t> drafts = right(tokens, most);
      for (int32_t& t : drafts) t = (t + 1) % vocab;
      return drafts;
    };
    auto half = [&](const std::vector<int32_t>& tokens, int most) {  // the first right, then wrong
      std::vector<int32_t> drafts = right(tokens, most);
      for (size_t i = 1; i < drafts.size(); ++i) drafts[i] = (drafts[i] + 1) % vocab;
      return drafts;
    };
    int drafted = 0, accepted = 0;
    EXPECT_EQ(DecodeWithDrafts(*executor, prompt, kTokens, kDraft, sampling, 77, right, &drafted, &accepted), plain);
    EXPECT_GT(drafted, 0);
    EXPECT_EQ(accepted, drafted);
    drafted = accepted = 0;
    EXPECT_EQ(DecodeWithDrafts(*executor, prompt, kTokens, kDraft, sampling, 77, wrong, &drafted, &accepted), plain);
    EXPECT_GT(drafted, 0);
    EXPECT_EQ(accepted, 0);
    drafted = accepted = 0;
    EXPECT_EQ(DecodeWithDrafts(*executor, prompt, kTokens, kDraft, sampling, 77, half, &drafted, &accepted), plain);
    EXPECT_GT(accepted, 0);
    EXPECT_LT(accepted, drafted);
  }
}

TEST_F(ModelExecutorTest, DraftsWhoseRowsAreNotTheChunksLastAreRefused) {
  auto executor = NewExecutor();
  ASSERT_NE(executor, nullptr);
  StepPlan plan = PrefillPlan({{1, 2, 3, 4}}, SamplingParams{}, 1);
  plan.batch.sequences[0].num_draft = 2;  // wants rows 1, 2, 3; the plan asks row 3 only
  auto s = executor->Execute(plan);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("carries 2 drafts but its logit rows are not its last 3 rows"));
  plan.batch.sequences[0].num_draft = 4;
  EXPECT_THAT(executor->Execute(plan).status().message(), HasSubstr("carries 4 drafts in a chunk of 4 tokens"));
}

// The hidden states beside the logits: the residual stream of the logit rows before the final
// norm, which the final norm and the LM head turn into those logits.
TEST_F(ModelExecutorTest, AStepCanReturnTheHiddenStatesOfItsLogitRows) {
  auto cache = model_->NewKvCache(16, kBlockSize);
  ASSERT_TRUE(cache.ok());
  ForwardBatch batch = PrefillPlan({{3, 17, 17, 42, 5, 9}}, SamplingParams{}, 1).batch;
  batch.logit_rows = {1, 5};
  auto plain = model_->ForwardOnDevice(batch, **cache);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->hidden);
  batch.want_hidden = true;
  auto out = model_->ForwardOnDevice(batch, **cache);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(out->hidden);
  const int hidden = model_->spec().hidden_size;
  EXPECT_EQ(out->hidden.rows, 2);
  EXPECT_EQ(out->hidden.cols, hidden);
  EXPECT_EQ(out->hidden.dtype, core::DType::kF32);
  // Row 5's state is row 5's alone: the same as in a step that asks for it only.
  std::vector<float> both(out->hidden.as<float>(), out->hidden.as<float>() + 2 * hidden);
  batch.logit_rows = {5};
  auto last = model_->ForwardOnDevice(batch, **cache);
  ASSERT_TRUE(last.ok());
  const std::vector<float> alone(last->hidden.as<float>(), last->hidden.as<float>() + hidden);
  EXPECT_EQ(std::vector<float>(both.begin() + hidden, both.end()), alone);
  EXPECT_NE(std::vector<float>(both.begin(), both.begin() + hidden), alone);
  // The final norm turns each into that row's normed state: normed / (hidden * rsqrt(mean(hidden^2)))
  // is the norm's weight vector, the same for both rows.
  std::vector<float> normed;
  model_->SetStepTap([&](std::string_view what, int, const Tensor& t) {
    if (what == "final_norm") normed.assign(t.as<float>(), t.as<float>() + t.numel());
  });
  batch.logit_rows = {1, 5};
  ASSERT_TRUE(model_->ForwardOnDevice(batch, **cache).ok());
  model_->SetStepTap(nullptr);
  ASSERT_EQ(normed.size(), static_cast<size_t>(6 * hidden));
  auto weights = [&](int row, const float* h) {
    double ss = 0;
    for (int j = 0; j < hidden; ++j) ss += double{h[j]} * h[j];
    const double inv = 1.0 / std::sqrt(ss / hidden + model_->spec().rms_norm_eps);
    std::vector<double> w(hidden);
    for (int j = 0; j < hidden; ++j) w[j] = normed[static_cast<size_t>(row) * hidden + j] / (h[j] * inv);
    return w;
  };
  const std::vector<double> w1 = weights(1, both.data()), w5 = weights(5, both.data() + hidden);
  for (int j = 0; j < hidden; ++j) EXPECT_NEAR(w1[j], w5[j], 1e-3 * std::abs(w5[j]) + 1e-4) << "element " << j;
}

TEST_F(ModelExecutorTest, MalformedSampleRowsFailTheStep) {
  auto executor = NewExecutor();
  ASSERT_NE(executor, nullptr);
  SamplingParams penalized;
  penalized.frequency_penalty = 1.0f;
  StepPlan extra_row = PrefillPlan({{1, 2, 3}}, SamplingParams{}, 1);
  extra_row.samples.push_back(extra_row.samples[0]);
  auto s = executor->Execute(extra_row);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("2 sample rows for 1 logit rows"));

  StepPlan no_history = PrefillPlan({{1, 2, 3}}, penalized, 1);
  no_history.samples[0].history.clear();
  s = executor->Execute(no_history);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("sample row 0 is penalized but its history has 0 tokens for position 3"));

  // A malformed batch is the model's error, as before.
  StepPlan bad_token = PrefillPlan({{1, 2, 9999}}, SamplingParams{}, 1);
  s = executor->Execute(bad_token);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("outside the vocabulary"));
}

}  // namespace
}  // namespace moe::runtime
