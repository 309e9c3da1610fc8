// The scheduler over the real model of a fixture: batching, chunked prefill and preemption
// must not change what greedy decoding produces, and every way a request ends frees its blocks.
#include "moe/scheduler/scheduler.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/generate.h"
#include "moe/runtime/model_executor.h"
#include "nlohmann/json.hpp"

namespace moe::scheduler {
namespace {

using ::testing::HasSubstr;

std::string FixtureDir(const std::string& arch) {
  const char* env = std::getenv("MOE_TESTDATA_DIR");
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/fixtures/" + arch;
}

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    runtime::ModelOptions options;
    options.pool.progress = false;
    options.threads = 2;
    options.pool.threads = 2;
    auto model = runtime::Model::Load(FixtureDir(arch_), options);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    std::ifstream in(FixtureDir(arch_) + "/golden.json");
    const nlohmann::json golden = nlohmann::json::parse(in);
    for (const auto& c : golden["cases"]) prompts_.push_back(c["prompt_ids"]);
  }

  // An executor with `num_blocks` KV blocks of 4 positions, as Config says.
  std::unique_ptr<runtime::ModelExecutor> NewExecutor(int num_blocks) {
    auto executor = runtime::ModelExecutor::Create(*model_, num_blocks, 4);
    EXPECT_TRUE(executor.ok()) << executor.status();
    return executor.ok() ? *std::move(executor) : nullptr;
  }

  SchedulerConfig Config(int num_blocks, int max_batch_tokens = 64) {
    SchedulerConfig c;
    c.num_blocks = num_blocks;
    c.block_size = 4;
    c.max_batch_tokens = max_batch_tokens;
    c.vocab_size = model_->spec().vocab_size;
    c.context = 256;
    return c;
  }

  // What one sequence alone produces.
  std::vector<int32_t> Alone(const std::vector<int32_t>& prompt, int n) {
    runtime::GenerateOptions o;
    o.max_new_tokens = n;
    o.stop_at_eos = false;
    auto r = runtime::Generate(*model_, prompt, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->generated_ids : std::vector<int32_t>{};
  }

  Request Make(const std::string& id, const std::vector<int32_t>& prompt, int n) {
    Request r;
    r.id = id;
    r.prompt = prompt;
    r.stopping.max_new_tokens = n;
    return r;
  }

  // Steps until idle; collects tokens and finish reasons by id.
  void RunToEnd(Scheduler& s, runtime::Executor& e, std::map<std::string, std::vector<int32_t>>* tokens,
                std::map<std::string, FinishReason>* reasons, int max_steps = 2000) {
    for (int step = 0; step < max_steps && !s.idle(); ++step) {
      for (const Output& o : s.Step(e)) {
        auto& t = (*tokens)[o.id];
        t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
        if (o.finished) (*reasons)[o.id] = *o.finished;
      }
    }
    EXPECT_TRUE(s.idle());
  }

  // Submits every fixture prompt (10 new tokens each), runs them together to the end and checks
  // that each got what it gets alone; returns how each ended.
  std::map<std::string, FinishReason> RunEveryPromptAndCompare(Scheduler& scheduler, runtime::Executor& executor) {
    std::map<std::string, std::vector<int32_t>> want, got;
    for (size_t i = 0; i < prompts_.size(); ++i) {
      const std::string id = "r" + std::to_string(i);
      EXPECT_TRUE(scheduler.Add(Make(id, prompts_[i], 10)).ok());
      want[id] = Alone(prompts_[i], 10);
    }
    std::map<std::string, FinishReason> reasons;
    RunToEnd(scheduler, executor, &got, &reasons);
    EXPECT_EQ(got, want);
    return reasons;
  }

  std::string arch_ = "qwen3_moe";
  std::unique_ptr<runtime::Model> model_;
  std::vector<std::vector<int32_t>> prompts_;
};

// DeepSeek-V3's paged latent cache (MLA) under the same batching, chunking and preemption.
class MlaSchedulerTest : public SchedulerTest {
 protected:
  void SetUp() override {
    arch_ = "deepseek_v3";
    SchedulerTest::SetUp();
  }
};

TEST_F(SchedulerTest, BatchingAndChunkedPrefillChangeNothing) {
  auto executor = NewExecutor(128);
  Scheduler scheduler(Config(128, /*max_batch_tokens=*/24));  // the 91-token prompt takes several steps
  const std::map<std::string, FinishReason> reasons = RunEveryPromptAndCompare(scheduler, *executor);
  for (const auto& [id, reason] : reasons) EXPECT_EQ(reason, FinishReason::kLength) << id;
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

TEST_F(SchedulerTest, RunningOutOfBlocksPreemptsAndRecomputes) {
  // 26 blocks of 4 positions: enough for the longest request (101 positions) alone; the three
  // admitted first (8, 36 and 38 prompt tokens) outgrow the cache while they decode.
  auto executor = NewExecutor(26);
  Scheduler scheduler(Config(26, 64));
  RunEveryPromptAndCompare(scheduler, *executor);
  EXPECT_GT(scheduler.stats().preemptions, 0);
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

TEST_F(MlaSchedulerTest, BatchingAndChunkedPrefillChangeNothing) {
  auto executor = NewExecutor(128);
  Scheduler scheduler(Config(128, /*max_batch_tokens=*/24));
  RunEveryPromptAndCompare(scheduler, *executor);
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

TEST_F(MlaSchedulerTest, RunningOutOfBlocksPreemptsAndRecomputes) {
  auto executor = NewExecutor(26);
  Scheduler scheduler(Config(26, 64));
  RunEveryPromptAndCompare(scheduler, *executor);
  EXPECT_GT(scheduler.stats().preemptions, 0);
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

TEST_F(SchedulerTest, AbortDeadlineAndErrorsFreeBlocksWhileOthersFinish) {
  auto executor = NewExecutor(128);
  Scheduler scheduler(Config(128));
  ASSERT_TRUE(scheduler.Add(Make("keep", prompts_[0], 12)).ok());
  ASSERT_TRUE(scheduler.Add(Make("abort", prompts_[1], 12)).ok());
  Request late = Make("late", prompts_[2], 12);
  late.deadline = Clock::now() + std::chrono::hours(1);
  ASSERT_TRUE(scheduler.Add(late).ok());
  std::map<std::string, std::vector<int32_t>> got;
  std::map<std::string, FinishReason> reasons;
  for (int i = 0; i < 3; ++i) {
    for (const Output& o : scheduler.Step(*executor)) got[o.id].insert(got[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
  }
  EXPECT_GT(scheduler.stats().blocks_used, 0);
  scheduler.Abort("abort");
  // The deadline passes: the step after it ends the request with kDeadline.
  for (const Output& o : scheduler.Step(*executor, Clock::now() + std::chrono::hours(2))) {
    got[o.id].insert(got[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
    if (o.finished) reasons[o.id] = *o.finished;
    if (o.id == "late" && o.finished) {
      EXPECT_EQ(o.error.code(), absl::StatusCode::kDeadlineExceeded);
    }
  }
  EXPECT_EQ(reasons["abort"], FinishReason::kAborted);
  EXPECT_EQ(reasons["late"], FinishReason::kDeadline);
  EXPECT_EQ(scheduler.stats().running, 1);
  RunToEnd(scheduler, *executor, &got, &reasons);
  EXPECT_EQ(got["keep"], Alone(prompts_[0], 12));
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

// An executor that fails one chosen step, as a lost worker would.
class FailingOnce : public runtime::Executor {
 public:
  FailingOnce(runtime::Executor& inner, int fail_at) : inner_(inner), fail_at_(fail_at) {}
  absl::StatusOr<runtime::StepResult> Execute(const runtime::StepPlan& plan) override {
    if (step_++ == fail_at_) return absl::UnavailableError("worker 1 lost");
    return inner_.Execute(plan);
  }
  runtime::KvCapacity kv_capacity() const override { return inner_.kv_capacity(); }
  const runtime::ModelInfo& model_info() const override { return inner_.model_info(); }
  std::string Describe() const override { return "fails once, then " + inner_.Describe(); }

 private:
  runtime::Executor& inner_;
  int fail_at_;
  int step_ = 0;
};

TEST_F(SchedulerTest, AFailedStepFailsItsRequestsAndTheNextOnesRun) {
  auto model_executor = NewExecutor(128);
  FailingOnce failing(*model_executor, 1);
  Scheduler scheduler(Config(128));
  ASSERT_TRUE(scheduler.Add(Make("a", prompts_[0], 8)).ok());
  std::map<std::string, std::vector<int32_t>> got;
  std::map<std::string, FinishReason> reasons;
  absl::Status error;
  for (int i = 0; i < 3 && !scheduler.idle(); ++i) {
    for (const Output& o : scheduler.Step(failing)) {
      if (o.finished) {
        reasons[o.id] = *o.finished;
        error = o.error;
      }
    }
  }
  EXPECT_EQ(reasons["a"], FinishReason::kError);
  EXPECT_THAT(error.message(), HasSubstr("worker 1 lost"));
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
  ASSERT_TRUE(scheduler.Add(Make("b", prompts_[4], 6)).ok());
  RunToEnd(scheduler, failing, &got, &reasons);
  EXPECT_EQ(got["b"], Alone(prompts_[4], 6));
}

TEST_F(SchedulerTest, StopTokensMinTokensAndSeeds) {
  auto executor = NewExecutor(128);
  Scheduler scheduler(Config(128));
  const std::vector<int32_t> alone = Alone(prompts_[2], 12);
  Request stop = Make("stop", prompts_[2], 12);
  stop.stopping.stop_token_ids = {alone[3]};
  Request min = Make("min", prompts_[2], 12);
  min.stopping.stop_token_ids = {alone[0]};
  min.stopping.min_new_tokens = 12;  // the stop token is ignored until then
  Request seeded_a = Make("seed_a", prompts_[1], 10), seeded_b = Make("seed_b", prompts_[1], 10);
  seeded_a.sampling.temperature = seeded_b.sampling.temperature = 1.0f;
  seeded_a.sampling.seed = seeded_b.sampling.seed = 99;
  for (Request* r : {&stop, &min, &seeded_a, &seeded_b}) ASSERT_TRUE(scheduler.Add(*r).ok());
  std::map<std::string, std::vector<int32_t>> got;
  std::map<std::string, FinishReason> reasons;
  RunToEnd(scheduler, *executor, &got, &reasons);
  const size_t stop_at = std::find(alone.begin(), alone.end(), alone[3]) - alone.begin();
  EXPECT_EQ(got["stop"], std::vector<int32_t>(alone.begin(), alone.begin() + stop_at + 1));
  EXPECT_EQ(reasons["stop"], FinishReason::kStopToken);
  EXPECT_EQ(got["min"].size(), 12u);
  EXPECT_EQ(reasons["min"], FinishReason::kLength);
  EXPECT_EQ(got["seed_a"], got["seed_b"]);
}

// Runs plans on another executor and keeps a copy of each.
class Recording : public runtime::Executor {
 public:
  explicit Recording(runtime::Executor& inner) : inner_(inner) {}
  absl::StatusOr<runtime::StepResult> Execute(const runtime::StepPlan& plan) override {
    plans.push_back(plan);
    return inner_.Execute(plan);
  }
  runtime::KvCapacity kv_capacity() const override { return inner_.kv_capacity(); }
  const runtime::ModelInfo& model_info() const override { return inner_.model_info(); }
  std::string Describe() const override { return "recording " + inner_.Describe(); }

  std::vector<runtime::StepPlan> plans;

 private:
  runtime::Executor& inner_;
};

TEST_F(SchedulerTest, PlansCarrySeedsAndPositionsAndTheHistoryOnlyForPenalties) {
  auto model_executor = NewExecutor(128);
  Recording recording(*model_executor);
  Scheduler scheduler(Config(128));
  Request plain = Make("plain", prompts_[0], 4);
  Request seeded = Make("seeded", prompts_[1], 4);
  seeded.sampling.temperature = 1.0f;
  seeded.sampling.seed = 5;
  Request penalized = Make("penalized", prompts_[2], 4);
  penalized.sampling.repetition_penalty = 1.3f;
  for (Request* r : {&plain, &seeded, &penalized}) ASSERT_TRUE(scheduler.Add(*r).ok());
  std::map<std::string, std::vector<int32_t>> got;
  std::map<std::string, FinishReason> reasons;
  RunToEnd(scheduler, recording, &got, &reasons);

  // The fixture's prompts differ in length: a row's prompt_len says whose it is.
  std::map<int32_t, std::string> by_length;
  by_length[static_cast<int32_t>(prompts_[0].size())] = "plain";
  by_length[static_cast<int32_t>(prompts_[1].size())] = "seeded";
  by_length[static_cast<int32_t>(prompts_[2].size())] = "penalized";
  ASSERT_EQ(by_length.size(), 3u);
  std::map<std::string, std::vector<runtime::SampleRow>> rows;
  for (const runtime::StepPlan& plan : recording.plans) {
    ASSERT_EQ(plan.samples.size(), plan.batch.logit_rows.size());
    for (const runtime::SampleRow& row : plan.samples) rows[by_length.at(row.prompt_len)].push_back(row);
  }
  std::vector<int32_t> penalized_tokens = prompts_[2];
  for (const auto& [id, list] : rows) {
    ASSERT_EQ(list.size(), 4u) << id;  // one row per token drawn
    for (size_t i = 0; i < list.size(); ++i) {
      const runtime::SampleRow& row = list[i];
      EXPECT_EQ(row.position, row.prompt_len + i) << id;
      EXPECT_EQ(row.sequence, 0u) << id;
      // A seed drawn once, when the request came, and kept for all its steps.
      EXPECT_EQ(row.seed, list[0].seed) << id;
      if (id == "penalized") {
        EXPECT_EQ(row.history, penalized_tokens);
        penalized_tokens.push_back(got["penalized"][i]);
      } else {
        EXPECT_TRUE(row.history.empty()) << id;
      }
    }
  }
  EXPECT_EQ(rows["seeded"][0].seed, 5u);
  EXPECT_NE(rows["plain"][0].seed, rows["penalized"][0].seed);
}

TEST_F(SchedulerTest, TheSameSeedsGiveTheSameTokensOnAnotherExecutor) {
  // Two schedulers, each over its own executor on the one model, as a frontend and a worker
  // process that replays its plans would be.
  auto executor_a = NewExecutor(128), executor_b = NewExecutor(128);
  Scheduler a(Config(128)), b(Config(128));
  for (size_t i = 0; i < 3; ++i) {
    Request r = Make("r" + std::to_string(i), prompts_[i], 8);
    r.sampling.temperature = 1.5f;
    r.sampling.top_k = 40;
    r.sampling.seed = 100 + i;
    ASSERT_TRUE(a.Add(r).ok());
    ASSERT_TRUE(b.Add(r).ok());
  }
  std::map<std::string, std::vector<int32_t>> got_a, got_b;
  for (int step = 0; step < 100 && !(a.idle() && b.idle()); ++step) {
    for (const Output& o : a.Step(*executor_a)) {
      got_a[o.id].insert(got_a[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
    }
    for (const Output& o : b.Step(*executor_b)) {
      got_b[o.id].insert(got_b[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  ASSERT_TRUE(a.idle() && b.idle());
  EXPECT_EQ(got_a, got_b);
  for (const auto& [id, tokens] : got_a) EXPECT_EQ(tokens.size(), 8u) << id;
}

// Drafts from a script: what each request produces alone (so every draft is kept), or tokens
// that differ from it after the first (so most are rejected and the sequence rolls back).
class ScriptedProposer : public DraftProposer {
 public:
  ScriptedProposer(std::map<std::string, std::vector<int32_t>> full, int vocab, bool wrong_after_first)
      : full_(std::move(full)), vocab_(vocab), wrong_after_first_(wrong_after_first) {}
  void Propose(const std::string& id, std::span<const int32_t> tokens, int max_draft,
               std::vector<int32_t>* draft) override {
    const std::vector<int32_t>& full = full_.at(id);
    ++calls;
    for (size_t i = tokens.size(); i < full.size() && static_cast<int>(draft->size()) < max_draft; ++i) {
      const bool wrong = wrong_after_first_ && !draft->empty();
      draft->push_back(wrong ? (full[i] + 1) % vocab_ : full[i]);
    }
  }
  int calls = 0;

 private:
  std::map<std::string, std::vector<int32_t>> full_;  // prompt, then what the request produces
  int vocab_;
  bool wrong_after_first_;
};

// An executor with a drafter of its own, as an MTP head would be: after each step it proposes, for
// every sequence that asked (want_drafts), what that sequence's request produces alone. It knows a
// sequence by its prompt, which its first chunk starts with.
class DraftingExecutor : public runtime::Executor {
 public:
  DraftingExecutor(runtime::Executor& inner, std::vector<std::vector<int32_t>> full)
      : inner_(inner), full_(std::move(full)) {}
  absl::StatusOr<runtime::StepResult> Execute(const runtime::StepPlan& plan) override {
    auto result = inner_.Execute(plan);
    if (!result.ok()) return result;
    const std::vector<std::vector<int>> rows = runtime::LogitRowsBySequence(plan.batch);
    size_t next = 0;
    int64_t row = 0;
    for (size_t s = 0; s < plan.batch.sequences.size(); ++s) {
      const runtime::SequenceChunk& c = plan.batch.sequences[s];
      if (c.first_position == 0) {
        for (size_t f = 0; f < full_.size(); ++f) {
          if (std::equal(plan.batch.token_ids.begin() + row, plan.batch.token_ids.begin() + row + c.num_tokens,
                         full_[f].begin())) {
            which_[c.seq_id] = f;
          }
        }
      }
      row += c.num_tokens;
      if (rows[s].empty()) continue;
      runtime::SequenceResult& r = result->sequences[next++];
      const std::vector<int32_t>& full = full_[which_.at(c.seq_id)];
      const size_t length = c.first_position + c.num_tokens - c.num_draft + r.tokens.size();
      for (size_t i = length; i < full.size() && static_cast<int>(r.drafts.size()) < c.want_drafts; ++i) {
        r.drafts.push_back(full[i]);
      }
      proposed += static_cast<int>(r.drafts.size());
    }
    return result;
  }
  runtime::KvCapacity kv_capacity() const override { return inner_.kv_capacity(); }
  const runtime::ModelInfo& model_info() const override { return inner_.model_info(); }
  std::string Describe() const override { return "drafting " + inner_.Describe(); }
  int proposed = 0;

 private:
  runtime::Executor& inner_;
  std::vector<std::vector<int32_t>> full_;  // prompt, then what the request produces alone
  std::map<uint64_t, size_t> which_;        // seq_id -> its request's entry in full_
};

TEST_F(SchedulerTest, DraftsFromTheExecutorsDrafterChangeNothing) {
  std::map<std::string, std::vector<int32_t>> want;
  std::vector<std::vector<int32_t>> full;
  for (size_t i = 0; i < 3; ++i) {
    const std::string id = "r" + std::to_string(i);
    want[id] = Alone(prompts_[i], 10);
    full.push_back(prompts_[i]);
    full.back().insert(full.back().end(), want[id].begin(), want[id].end());
  }
  auto executor = NewExecutor(128);
  DraftingExecutor drafting(*executor, full);
  Recording recording(drafting);
  SchedulerConfig config = Config(128);
  config.max_draft = 2;
  Scheduler scheduler(config);
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(scheduler.Add(Make("r" + std::to_string(i), prompts_[i], 10)).ok());
  std::map<std::string, std::vector<int32_t>> got;
  std::map<std::string, FinishReason> reasons;
  RunToEnd(scheduler, recording, &got, &reasons);
  EXPECT_EQ(got, want);
  EXPECT_GT(drafting.proposed, 0);
  int drafts = 0, asked = 0;
  for (const runtime::StepPlan& plan : recording.plans) {
    for (const runtime::SequenceChunk& c : plan.batch.sequences) {
      drafts += c.num_draft;
      asked += c.want_drafts > 0 ? 1 : 0;
      EXPECT_LE(c.num_draft, 2);
    }
  }
  EXPECT_GT(asked, 0);
  EXPECT_GT(drafts, 0);
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

TEST_F(SchedulerTest, SpeculationChangesNothing) {
  for (const bool wrong : {false, true}) {
    std::map<std::string, std::vector<int32_t>> want, full;
    for (size_t i = 0; i < 3; ++i) {
      const std::string id = "r" + std::to_string(i);
      want[id] = Alone(prompts_[i], 10);
      full[id] = prompts_[i];
      full[id].insert(full[id].end(), want[id].begin(), want[id].end());
    }
    // A penalized, seeded request: its draft rows read the drafts before them.
    Request penalized = Make("p", prompts_[1], 10);
    penalized.sampling.temperature = 0.9f;
    penalized.sampling.repetition_penalty = 1.4f;
    penalized.sampling.seed = 8;
    {
      auto executor = NewExecutor(128);
      Scheduler plain(Config(128));
      ASSERT_TRUE(plain.Add(penalized).ok());
      std::map<std::string, std::vector<int32_t>> got;
      std::map<std::string, FinishReason> reasons;
      RunToEnd(plain, *executor, &got, &reasons);
      want["p"] = got["p"];
      full["p"] = prompts_[1];
      full["p"].insert(full["p"].end(), got["p"].begin(), got["p"].end());
    }
    ScriptedProposer proposer(full, model_->spec().vocab_size, wrong);
    SchedulerConfig config = Config(128);
    config.max_draft = 3;
    Scheduler scheduler(config);
    scheduler.set_proposer(&proposer);
    auto executor = NewExecutor(128);
    Recording recording(*executor);
    for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(scheduler.Add(Make("r" + std::to_string(i), prompts_[i], 10)).ok());
    ASSERT_TRUE(scheduler.Add(penalized).ok());
    std::map<std::string, std::vector<int32_t>> got;
    std::map<std::string, FinishReason> reasons;
    RunToEnd(scheduler, recording, &got, &reasons);
    EXPECT_EQ(got, want) << (wrong ? "wrong drafts" : "right drafts");
    for (const auto& [id, reason] : reasons) EXPECT_EQ(reason, FinishReason::kLength) << id;
    EXPECT_EQ(scheduler.stats().blocks_used, 0);
    int drafts = 0;
    for (const runtime::StepPlan& plan : recording.plans) {
      for (const runtime::SequenceChunk& c : plan.batch.sequences) drafts += c.num_draft;
    }
    EXPECT_GT(proposer.calls, 0);
    EXPECT_GT(drafts, 0);
    // Right drafts are all kept: fewer steps than one token a step would take.
    if (!wrong) {
      EXPECT_LT(recording.plans.size(), 10u);
    }
  }
}

TEST_F(SchedulerTest, BadRequestsAreRefusedNamingTheField) {
  SchedulerConfig config = Config(8);
  config.max_seqs = 1;
  config.max_queue = 1;
  config.max_prompt_tokens = 100;
  Scheduler scheduler(config);
  struct Case {
    Request request;
    absl::StatusCode code;
    const char* message;
  };
  Request empty = Make("e", {}, 4);
  Request oov = Make("o", {1, 2, 700}, 4);
  Request too_long = Make("l", {1, 2, 3}, 300);
  Request bad_temp = Make("t", {1, 2}, 4);
  bad_temp.sampling.temperature = -1;
  Request bad_p = Make("p", {1, 2}, 4);
  bad_p.sampling.top_p = 0;
  Request min_over = Make("m", {1, 2}, 4);
  min_over.stopping.min_new_tokens = 5;
  Request huge = Make("h", std::vector<int32_t>(40, 1), 4);  // 44 positions > 8 blocks of 4
  Request over_limit = Make("ol", std::vector<int32_t>(101, 1), 4);
  SchedulerConfig no_limit = config;
  no_limit.max_prompt_tokens = 0;
  Scheduler whole_context(no_limit);
  Request fills_context = Make("f", std::vector<int32_t>(256, 1), 1);
  for (const Case& c : std::vector<Case>{
           {empty, absl::StatusCode::kInvalidArgument, "token_ids: empty prompt"},
           {oov, absl::StatusCode::kInvalidArgument, "token_ids[2]: 700 is outside the vocabulary [0, 512)"},
           {too_long, absl::StatusCode::kInvalidArgument, "exceeds the context of 256"},
           {bad_temp, absl::StatusCode::kInvalidArgument, "sampling.temperature"},
           {bad_p, absl::StatusCode::kInvalidArgument, "sampling.top_p"},
           {min_over, absl::StatusCode::kInvalidArgument, "min_new_tokens: 5"},
           {huge, absl::StatusCode::kResourceExhausted, "needs 11 KV blocks; the cache has 8"},
           {over_limit, absl::StatusCode::kInvalidArgument,
            "token_ids: prompt of 101 tokens is longer than this server accepts (max_prompt_tokens=100)"},
       }) {
    absl::Status s = scheduler.Add(c.request);
    EXPECT_EQ(s.code(), c.code) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
  // A prompt that fills the context is blamed on the prompt, not on max_new_tokens.
  absl::Status s = whole_context.Add(fills_context);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("token_ids: prompt of 256 tokens leaves no room in the context of 256"));

  // One slot (max_seqs=1): x takes it, y waits (max_queue=1), z is refused.
  ASSERT_TRUE(scheduler.Add(Make("x", {1, 2}, 2)).ok());
  EXPECT_THAT(scheduler.Add(Make("x", {1}, 2)).message(), HasSubstr("request_id: 'x' is already in use"));
  ASSERT_TRUE(scheduler.Add(Make("y", {1, 2}, 2)).ok());
  absl::Status full = scheduler.Add(Make("z", {1, 2}, 2));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("queue full: 1 waiting for a slot (max_queue=1)"));
  EXPECT_EQ(scheduler.stats().waiting, 2);
}

TEST_F(SchedulerTest, NoWaitingRoomAcceptsWhatCanStartAtOnceAndRefusesTheRest) {
  SchedulerConfig config = Config(64);
  config.max_seqs = 2;
  config.max_queue = 0;
  Scheduler scheduler(config);
  auto executor = NewExecutor(64);
  ASSERT_TRUE(scheduler.Add(Make("a", {1, 2}, 2)).ok());
  ASSERT_TRUE(scheduler.Add(Make("b", {1, 2}, 2)).ok());
  absl::Status busy = scheduler.Add(Make("c", {1, 2}, 2));
  EXPECT_EQ(busy.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(busy.message(), HasSubstr("all 2 slots are taken (max_seqs) and there is no waiting room (max_queue=0)"));
  // Once one finishes, a new request starts again.
  for (int i = 0; i < 10 && scheduler.stats().running + scheduler.stats().waiting == 2; ++i) {
    scheduler.Step(*executor);
  }
  EXPECT_TRUE(scheduler.Add(Make("c", {1, 2}, 2)).ok());
}

}  // namespace
}  // namespace moe::scheduler
