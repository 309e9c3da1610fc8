// Prefix caching over the real models of the fixtures: a request that starts on blocks another
// request computed must produce exactly what it produces without the cache, whatever the shared
// length (around block boundaries), with sharers running at once, preempted, cancelled or evicted;
// no block found in the cache is ever written, and every block comes back.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/model_executor.h"
#include "moe/scheduler/scheduler.h"

namespace moe::scheduler {
namespace {

constexpr int kBlockSize = 4;

std::string FixtureDir(const std::string& arch) {
  const char* env = std::getenv("MOE_TESTDATA_DIR");
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/fixtures/" + arch;
}

// Runs plans on another executor and checks every write of every plan: a chunk writes positions
// [first_position, first_position + num_tokens) of its sequence, and none of them may fall in a
// block the sequence found cached (the blocks below its first chunk's start) or in a block another
// live sequence holds.
class CacheWriteChecker : public runtime::Executor {
 public:
  explicit CacheWriteChecker(runtime::Executor& inner) : inner_(inner) {}
  absl::StatusOr<runtime::StepResult> Execute(const runtime::StepPlan& plan) override {
    for (uint64_t id : plan.released) {
      tables_.erase(id);
      cached_.erase(id);
    }
    for (const runtime::SequenceChunk& c : plan.batch.sequences) {
      auto [it, added] = tables_.try_emplace(c.seq_id);
      it->second = c.block_table;
      if (added) {
        const int64_t hit = c.first_position / kBlockSize;
        cached_[c.seq_id] = std::set<int32_t>(c.block_table.begin(), c.block_table.begin() + hit);
        if (hit > 0) {
          ++hits;
          EXPECT_EQ(c.prefix.size(), static_cast<size_t>(c.first_position)) << "a hit carries its prefix";
        }
      }
    }
    std::map<int32_t, int> holders;
    for (const auto& [id, table] : tables_) {
      for (int32_t b : std::set<int32_t>(table.begin(), table.end())) ++holders[b];
    }
    for (const runtime::SequenceChunk& c : plan.batch.sequences) {
      for (int64_t p = c.first_position; p < c.first_position + c.num_tokens; ++p) {
        const int32_t block = c.block_table[p / kBlockSize];
        EXPECT_EQ(cached_[c.seq_id].count(block), 0u) << "sequence " << c.seq_id << " writes position " << p
                                                      << " into block " << block << ", which it found cached";
        EXPECT_EQ(holders[block], 1) << "sequence " << c.seq_id << " writes position " << p << " into block "
                                     << block << ", which " << holders[block] << " sequences hold";
      }
    }
    return inner_.Execute(plan);
  }
  runtime::KvCapacity kv_capacity() const override { return inner_.kv_capacity(); }
  const runtime::ModelInfo& model_info() const override { return inner_.model_info(); }
  std::string Describe() const override { return "checked " + inner_.Describe(); }

  int hits = 0;  // sequences whose first chunk started on cached blocks

 private:
  runtime::Executor& inner_;
  std::map<uint64_t, std::vector<int32_t>> tables_;  // live sequences' block tables
  std::map<uint64_t, std::set<int32_t>> cached_;     // blocks each found cached
};

struct Served {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, FinishReason> reasons;
  std::map<std::string, int> cached;
};

class PrefixCacheTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    runtime::ModelOptions options;
    options.pool.progress = false;
    options.threads = 2;
    options.pool.threads = 2;
    auto model = runtime::Model::Load(FixtureDir(arch()), options);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    // A long prompt of ordinary token ids, different at every position (ids of a fixture's 512).
    for (int i = 0; i < 64; ++i) base_.push_back(3 + (i * 37) % 400);
  }
  std::string arch() const { return GetParam(); }

  std::unique_ptr<runtime::ModelExecutor> NewExecutor(int num_blocks) {
    auto executor = runtime::ModelExecutor::Create(*model_, num_blocks, kBlockSize);
    EXPECT_TRUE(executor.ok()) << executor.status();
    return executor.ok() ? *std::move(executor) : nullptr;
  }

  SchedulerConfig Config(int num_blocks, bool prefix_cache, int max_batch_tokens = 64) {
    SchedulerConfig c;
    c.num_blocks = num_blocks;
    c.block_size = kBlockSize;
    c.max_batch_tokens = max_batch_tokens;
    c.vocab_size = model_->spec().vocab_size;
    c.context = 256;
    c.prefix_cache = prefix_cache;
    return c;
  }

  static Request Make(const std::string& id, std::vector<int32_t> prompt, int n, bool sampled = false) {
    Request r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.stopping.max_new_tokens = n;
    r.stopping.ignore_eos = true;
    if (sampled) {
      r.sampling.temperature = 1.0f;
      r.sampling.seed = 1234;
    }
    return r;
  }

  std::vector<int32_t> Prompt(int shared, std::vector<int32_t> tail) const {
    std::vector<int32_t> p(base_.begin(), base_.begin() + shared);
    p.insert(p.end(), tail.begin(), tail.end());
    return p;
  }

  static void RunToEnd(Scheduler& s, runtime::Executor& e, Served* run) {
    for (int step = 0; step < 4000 && !s.idle(); ++step) {
      for (const Output& o : s.Step(e)) {
        auto& t = run->tokens[o.id];
        t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
        if (o.finished) {
          run->reasons[o.id] = *o.finished;
          run->cached[o.id] = o.cached_tokens;
        }
      }
    }
    EXPECT_TRUE(s.idle());
  }

  // What `requests` produce on a scheduler without the prefix cache, all at once.
  std::map<std::string, std::vector<int32_t>> Uncached(const std::vector<Request>& requests) {
    auto executor = NewExecutor(256);
    Scheduler scheduler(Config(256, /*prefix_cache=*/false));
    for (const Request& r : requests) EXPECT_TRUE(scheduler.Add(r).ok());
    Served run;
    RunToEnd(scheduler, *executor, &run);
    for (const auto& [id, cached] : run.cached) EXPECT_EQ(cached, 0) << id;
    return run.tokens;
  }

  std::unique_ptr<runtime::Model> model_;
  std::vector<int32_t> base_;
};

// A second request shares the first one's first `shared` tokens, for every length around the block
// boundaries, greedy and sampled: it gets what it gets without the cache, and the cache gave it
// every full block of the shared part (never the block of its last token).
TEST_P(PrefixCacheTest, APrefixHitChangesNothing) {
  for (bool sampled : {false, true}) {
    for (int shared : {1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 16, 17}) {
      SCOPED_TRACE(::testing::Message() << "shared " << shared << (sampled ? " sampled" : " greedy"));
      const Request first = Make("first", Prompt(shared, {500, 501, 502, 503, 504}), 6, sampled);
      const Request second = Make("second", Prompt(shared, {510, 511, 12}), 6, sampled);
      const std::map<std::string, std::vector<int32_t>> want = Uncached({first, second});
      auto model_executor = NewExecutor(64);
      CacheWriteChecker executor(*model_executor);
      Scheduler scheduler(Config(64, /*prefix_cache=*/true));
      Served run;
      ASSERT_TRUE(scheduler.Add(first).ok());
      RunToEnd(scheduler, executor, &run);
      ASSERT_TRUE(scheduler.Add(second).ok());
      RunToEnd(scheduler, executor, &run);
      EXPECT_EQ(run.tokens, want);
      EXPECT_EQ(run.cached["first"], 0);
      EXPECT_EQ(run.cached["second"], shared / kBlockSize * kBlockSize);
      EXPECT_EQ(executor.hits, shared >= kBlockSize ? 1 : 0);
      EXPECT_EQ(scheduler.stats().blocks_used, 0);
      EXPECT_GT(scheduler.stats().blocks_cached, 0);
    }
  }
}

// The same prompt twice, and a prompt that is a prefix of an earlier one: the last token is always
// computed again (its logits are needed), in a block of its own.
TEST_P(PrefixCacheTest, AWholePromptHitRecomputesItsLastToken) {
  for (int len : {4, 5, 8, 12, 15}) {
    SCOPED_TRACE(::testing::Message() << "prompt of " << len);
    const Request first = Make("first", Prompt(len + 6, {}), 5);
    const Request again = Make("again", Prompt(len, {}), 5);
    const Request same = Make("same", Prompt(len + 6, {}), 5);
    const std::map<std::string, std::vector<int32_t>> want = Uncached({first, again, same});
    auto model_executor = NewExecutor(64);
    CacheWriteChecker executor(*model_executor);
    Scheduler scheduler(Config(64, true));
    Served run;
    for (const Request& r : {first, again, same}) {
      ASSERT_TRUE(scheduler.Add(r).ok());
      RunToEnd(scheduler, executor, &run);
    }
    EXPECT_EQ(run.tokens, want);
    EXPECT_EQ(run.cached["again"], (len - 1) / kBlockSize * kBlockSize);
    EXPECT_EQ(run.cached["same"], (len + 6 - 1) / kBlockSize * kBlockSize);
    EXPECT_EQ(scheduler.stats().blocks_used, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PrefixCacheTest,
                         ::testing::Values("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

class PrefixCacheQwen3Test : public PrefixCacheTest {};

// Several requests with one system prompt, at once, after one that filled the cache, sampled and
// greedy; the cache's counters say what was looked up and found.
TEST_P(PrefixCacheQwen3Test, ConcurrentRequestsShareAPrefix) {
  std::vector<Request> requests;
  for (int i = 0; i < 6; ++i) requests.push_back(Make("r" + std::to_string(i), Prompt(23, {100 + i, 200 + i}), 8, i % 2 == 1));
  const Request warm = Make("warm", Prompt(23, {7}), 3);
  std::vector<Request> all = requests;
  all.push_back(warm);
  const std::map<std::string, std::vector<int32_t>> want = Uncached(all);
  auto model_executor = NewExecutor(128);
  CacheWriteChecker executor(*model_executor);
  Scheduler scheduler(Config(128, true, /*max_batch_tokens=*/16));
  Served run;
  ASSERT_TRUE(scheduler.Add(warm).ok());
  RunToEnd(scheduler, executor, &run);
  for (const Request& r : requests) ASSERT_TRUE(scheduler.Add(r).ok());
  RunToEnd(scheduler, executor, &run);
  EXPECT_EQ(run.tokens, want);
  for (const Request& r : requests) EXPECT_EQ(run.cached[r.id], 20) << r.id;
  EXPECT_EQ(scheduler.stats().prefix_queried_tokens, 24 + 6 * 25);
  EXPECT_EQ(scheduler.stats().prefix_hit_tokens, 6 * 20);
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

// A cache too small for the sharers together: the newest are preempted and recomputed (finding
// their own blocks and the shared ones again), and nothing changes.
TEST_P(PrefixCacheQwen3Test, PreemptedSharersRecomputeAndChangeNothing) {
  std::vector<Request> requests;
  for (int i = 0; i < 5; ++i) requests.push_back(Make("r" + std::to_string(i), Prompt(30, {100 + i}), 30, i % 2 == 1));
  const std::map<std::string, std::vector<int32_t>> want = Uncached(requests);
  auto model_executor = NewExecutor(40);
  CacheWriteChecker executor(*model_executor);
  Scheduler scheduler(Config(40, true));
  for (const Request& r : requests) ASSERT_TRUE(scheduler.Add(r).ok());
  Served run;
  RunToEnd(scheduler, executor, &run);
  EXPECT_EQ(run.tokens, want);
  EXPECT_GT(scheduler.stats().preemptions, 0);
  EXPECT_GT(executor.hits, 0);
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

// A sharer cancelled mid-prefill and another mid-decode: the others go on unchanged, the shared
// blocks stay cached for the next request, and every block comes back.
TEST_P(PrefixCacheQwen3Test, CancelledSharersLeaveTheOthersAndTheCacheIntact) {
  const Request warm = Make("warm", Prompt(40, {1}), 2);
  const Request keep = Make("keep", Prompt(40, {2, 3}), 10);
  const Request prefilling = Make("prefilling", Prompt(40, std::vector<int32_t>(30, 9)), 10);
  const Request decoding = Make("decoding", Prompt(40, {4}), 20);
  const Request later = Make("later", Prompt(40, {5}), 6);
  const std::map<std::string, std::vector<int32_t>> want = Uncached({warm, keep, decoding, later});
  auto model_executor = NewExecutor(128);
  CacheWriteChecker executor(*model_executor);
  Scheduler scheduler(Config(128, true, /*max_batch_tokens=*/8));
  Served run;
  ASSERT_TRUE(scheduler.Add(warm).ok());
  RunToEnd(scheduler, executor, &run);
  for (const Request& r : {keep, decoding, prefilling}) ASSERT_TRUE(scheduler.Add(r).ok());
  for (int i = 0; i < 3; ++i) {
    for (const Output& o : scheduler.Step(executor)) {
      run.tokens[o.id].insert(run.tokens[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  EXPECT_FALSE(run.tokens["decoding"].empty());
  EXPECT_TRUE(run.tokens["prefilling"].empty());
  scheduler.Abort("prefilling");
  scheduler.Abort("decoding");
  RunToEnd(scheduler, executor, &run);
  EXPECT_EQ(run.reasons["prefilling"], FinishReason::kAborted);
  EXPECT_EQ(run.reasons["decoding"], FinishReason::kAborted);
  EXPECT_EQ(run.tokens["keep"], want.at("keep"));
  const std::vector<int32_t>& cut = run.tokens["decoding"];
  EXPECT_EQ(cut, std::vector<int32_t>(want.at("decoding").begin(), want.at("decoding").begin() + cut.size()));
  ASSERT_TRUE(scheduler.Add(later).ok());
  RunToEnd(scheduler, executor, &run);
  EXPECT_EQ(run.tokens["later"], want.at("later"));
  EXPECT_EQ(run.cached["later"], 40);
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
}

// A full cache evicts the least recently freed blocks first: the oldest prompt is computed again
// (and still gives the same tokens), the newest is found.
TEST_P(PrefixCacheQwen3Test, AFullCacheEvictsTheOldestPrefixesFirst) {
  std::vector<Request> requests;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt(36);
    for (int j = 0; j < 36; ++j) prompt[j] = 5 + (i * 97 + j * 13) % 450;
    requests.push_back(Make("p" + std::to_string(i), prompt, 4));
  }
  const std::map<std::string, std::vector<int32_t>> want = Uncached(requests);
  auto model_executor = NewExecutor(24);  // room for two prompts' blocks, not four
  CacheWriteChecker executor(*model_executor);
  Scheduler scheduler(Config(24, true));
  Served run;
  for (const Request& r : requests) {
    ASSERT_TRUE(scheduler.Add(r).ok());
    RunToEnd(scheduler, executor, &run);
  }
  EXPECT_EQ(run.tokens, want);
  EXPECT_LE(scheduler.stats().blocks_cached, 24);
  Served again;
  Request oldest = requests[0], newest = requests[3];
  oldest.id = "oldest";
  newest.id = "newest";
  for (const Request& r : {oldest, newest}) {
    ASSERT_TRUE(scheduler.Add(r).ok());
    RunToEnd(scheduler, executor, &again);
  }
  EXPECT_EQ(again.cached["oldest"], 0);
  EXPECT_EQ(again.tokens["oldest"], want.at("p0"));
  EXPECT_EQ(again.cached["newest"], 32);
  EXPECT_EQ(again.tokens["newest"], want.at("p3"));
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

// After a failed step (a worker lost and restarted with an empty cache) nothing cached is trusted;
// with the cache off nothing is looked up.
TEST_P(PrefixCacheQwen3Test, AFailedStepForgetsTheCacheAndOffMeansOff) {
  auto model_executor = NewExecutor(64);
  FailingOnce failing(*model_executor, 2);
  Scheduler scheduler(Config(64, true));
  Served run;
  ASSERT_TRUE(scheduler.Add(Make("a", Prompt(20, {}), 1)).ok());
  RunToEnd(scheduler, failing, &run);  // step 0
  ASSERT_TRUE(scheduler.Add(Make("b", Prompt(20, {1}), 4)).ok());
  RunToEnd(scheduler, failing, &run);  // steps 1 and 2, which fails
  EXPECT_EQ(run.reasons["b"], FinishReason::kError);
  ASSERT_TRUE(scheduler.Add(Make("c", Prompt(20, {2}), 4)).ok());
  RunToEnd(scheduler, failing, &run);
  EXPECT_EQ(run.cached["c"], 0);
  EXPECT_EQ(run.tokens["c"], Uncached({Make("c", Prompt(20, {2}), 4)}).at("c"));

  Scheduler off(Config(64, false));
  for (const char* id : {"x", "y"}) {
    ASSERT_TRUE(off.Add(Make(id, Prompt(20, {}), 2)).ok());
    RunToEnd(off, *model_executor, &run);
  }
  EXPECT_EQ(run.cached["y"], 0);
  EXPECT_EQ(off.stats().prefix_queried_tokens, 0);
  EXPECT_EQ(off.stats().blocks_cached, 0);
}

INSTANTIATE_TEST_SUITE_P(Qwen3, PrefixCacheQwen3Test, ::testing::Values("qwen3_moe"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace moe::scheduler
