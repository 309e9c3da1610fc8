// The model split over real processes joined by Gloo on loopback (comm::RunLocalRanks forks them),
// against the same model in one process: a tensor split of 2 (its experts in the pool, or on the
// backend's reference path, each rank owning half) and a layer split of 2, on every fixture. Teacher
// forced, so that every step (a prefill, then one decode token at a time over the KV cache) is
// compared: the logits within 1e-4 and the same greedy token at every position.
//
// Every model is loaded in a child process: the test process itself starts no thread, as forking
// needs.
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "moe/comm/gloo_communicator.h"
#include "moe/comm/local_ranks.h"
#include "moe/core/status.h"
#include "moe/runtime/model.h"
#include "moe/runtime/sampler.h"
#include "test_util.h"

namespace moe {
namespace {

using runtime::ForwardBatch;
using runtime::Model;
using runtime::ParallelMode;
using runtime::SequenceChunk;

struct SplitCase {
  std::string arch;
  ParallelMode mode;
  runtime::RoutedExpertsMode experts;
  std::string name;
};

// The logits of every prompt position (one prefill), then of each golden greedy token fed one at
// a time (decode steps over the cache), as rows; none on a rank without logits.
absl::StatusOr<std::vector<std::vector<float>>> TeacherForced(Model& model, const std::vector<int32_t>& prompt,
                                                              const std::vector<int32_t>& continuation) {
  const int total = static_cast<int>(prompt.size() + continuation.size());
  MOE_ASSIGN_OR_RETURN(auto cache, model.NewKvCache(runtime::BlocksFor(total, 16)));
  std::vector<int32_t> table(runtime::BlocksFor(total, 16));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
  std::vector<std::vector<float>> rows;
  const int vocab = model.spec().vocab_size;
  auto step = [&](std::vector<int32_t> ids, int64_t first, std::vector<int32_t> logit_rows) -> absl::Status {
    ForwardBatch batch;
    batch.token_ids = std::move(ids);
    batch.sequences = {SequenceChunk{first, static_cast<int32_t>(batch.token_ids.size()), table}};
    batch.logit_rows = std::move(logit_rows);
    std::vector<float> logits;
    MOE_RETURN_IF_ERROR(model.Forward(batch, *cache, &logits));
    for (size_t r = 0; r * vocab < logits.size(); ++r) {
      rows.emplace_back(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
    }
    return absl::OkStatus();
  };
  std::vector<int32_t> all_rows(prompt.size());
  for (size_t i = 0; i < all_rows.size(); ++i) all_rows[i] = static_cast<int32_t>(i);
  MOE_RETURN_IF_ERROR(step(prompt, 0, all_rows));
  for (size_t i = 0; i + 1 < continuation.size(); ++i) {
    MOE_RETURN_IF_ERROR(step({continuation[i]}, static_cast<int64_t>(prompt.size() + i), {0}));
  }
  return rows;
}

std::string Serialize(const std::vector<std::vector<float>>& rows) {
  std::string out;
  for (const auto& row : rows) {
    for (float v : row) absl::StrAppendFormat(&out, "%a ", v);
    out += "| ";
  }
  return out;
}

std::vector<std::vector<float>> Parse(const std::string& text) {
  std::vector<std::vector<float>> rows;
  for (absl::string_view row : absl::StrSplit(text, '|', absl::SkipWhitespace())) {
    std::vector<float>& r = rows.emplace_back();
    for (absl::string_view v : absl::StrSplit(row, ' ', absl::SkipWhitespace()))
      r.push_back(std::strtof(std::string(v).c_str(), nullptr));
  }
  return rows;
}

// One rank's share of the run, in its own process: its communicator, its model, its rows.
absl::StatusOr<std::string> RunRank(const SplitCase& c, int rank, int size, const std::string& store) {
  runtime::ModelOptions options;
  options.threads = 1;
  options.pool.threads = 1;
  options.pool.progress = false;
  options.experts = c.experts;
  std::unique_ptr<comm::Communicator> comm;
  if (size > 1) {
    comm::GlooOptions g;
    g.rank = rank;
    g.size = size;
    g.store_address = store;
    MOE_ASSIGN_OR_RETURN(comm, comm::GlooCommunicator::Create(g));
    options.parallel = runtime::ParallelConfig{c.mode, rank, size, comm.get()};
  }
  MOE_ASSIGN_OR_RETURN(auto model, Model::Load(testing::FixtureDir(c.arch), options));
  const nlohmann::json golden = testing::LoadGolden(c.arch);
  std::string out;
  for (const auto& gc : golden["cases"]) {
    MOE_ASSIGN_OR_RETURN(auto rows, TeacherForced(*model, gc["prompt_ids"].get<std::vector<int32_t>>(),
                                                  gc["greedy_ids"].get<std::vector<int32_t>>()));
    out += Serialize(rows) + "# ";
  }
  return out;
}

// Every case's rows from the rank that holds the logits.
std::vector<std::vector<std::vector<float>>> RunSplit(const SplitCase& c, int size) {
  auto results = comm::RunLocalRanks(comm::LocalRanksOptions{size, absl::Seconds(120)},
                                     [&](int rank, const std::string& store) { return RunRank(c, rank, size, store); });
  EXPECT_TRUE(results.ok()) << results.status();
  if (!results.ok()) return {};
  for (int rank = 0; rank < size; ++rank) {
    EXPECT_TRUE((*results)[rank].ok()) << c.name << " rank " << rank << ": " << (*results)[rank].status();
    if (!(*results)[rank].ok()) return {};
  }
  const int holder = c.mode == ParallelMode::kLayer ? size - 1 : 0;
  std::vector<std::vector<std::vector<float>>> cases;
  for (absl::string_view text : absl::StrSplit(*(*results)[holder], '#', absl::SkipWhitespace())) {
    cases.push_back(Parse(std::string(text)));
  }
  return cases;
}

class SplitTest : public ::testing::TestWithParam<SplitCase> {};

TEST_P(SplitTest, SameLogitsAndGreedyTokensAsOneProcess) {
  const SplitCase& c = GetParam();
  const auto one = RunSplit(SplitCase{c.arch, ParallelMode::kNone, c.experts, c.name}, 1);
  const auto split = RunSplit(c, 2);
  ASSERT_FALSE(one.empty());
  ASSERT_EQ(split.size(), one.size());
  float worst = 0;
  int compared = 0;
  for (size_t k = 0; k < one.size(); ++k) {
    ASSERT_EQ(split[k].size(), one[k].size()) << "case " << k;
    for (size_t r = 0; r < one[k].size(); ++r) {
      ASSERT_EQ(split[k][r].size(), one[k][r].size());
      worst = std::max(worst, testing::MaxAbsDiff(split[k][r], one[k][r]));
      const int vocab = static_cast<int>(one[k][r].size());
      EXPECT_EQ(runtime::ArgMax(split[k][r].data(), vocab), runtime::ArgMax(one[k][r].data(), vocab))
          << c.name << " case " << k << " row " << r;
      ++compared;
    }
  }
  // And against transformers: the prompts' golden rows.
  const nlohmann::json golden = testing::LoadGolden(c.arch);
  float worst_golden = 0;
  for (size_t k = 0; k < split.size(); ++k) {
    const auto& gc = golden["cases"][k];
    const size_t from = gc["logits_from_position"];
    for (size_t r = 0; r < gc["logits"].size(); ++r) {
      worst_golden = std::max(worst_golden, testing::MaxAbsDiff(split[k][from + r], gc["logits"][r]));
    }
  }
  EXPECT_LT(worst_golden, 1e-3f) << c.name;
  std::cout << "[ split ] " << c.name << ": " << compared << " rows, largest logit difference " << worst
            << " from one process, " << worst_golden << " from transformers\n";
  EXPECT_LT(worst, 1e-4f) << c.name;
  EXPECT_GT(compared, 0);
}

std::vector<SplitCase> SplitCases() {
  std::vector<SplitCase> cases;
  for (const char* arch : {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"}) {
    cases.push_back({arch, ParallelMode::kTensor, runtime::RoutedExpertsMode::kPool, absl::StrCat(arch, "_tensor2")});
    cases.push_back({arch, ParallelMode::kTensor, runtime::RoutedExpertsMode::kBackend,
                     absl::StrCat(arch, "_tensor2_reference_experts")});
    cases.push_back({arch, ParallelMode::kLayer, runtime::RoutedExpertsMode::kPool, absl::StrCat(arch, "_layer2")});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SplitTest, ::testing::ValuesIn(SplitCases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace moe
