#include "moe/runtime/executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe::runtime {
namespace {

// For each row of the batch, the index of its sequence.
std::vector<int> RowSequences(const ForwardBatch& batch) {
  std::vector<int> owner;
  owner.reserve(batch.token_ids.size());
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    owner.insert(owner.end(), static_cast<size_t>(std::max(batch.sequences[s].num_tokens, 0)), static_cast<int>(s));
  }
  return owner;
}

}  // namespace

std::vector<std::vector<int>> LogitRowsBySequence(const ForwardBatch& batch) {
  const std::vector<int> owner = RowSequences(batch);
  std::vector<std::vector<int>> rows(batch.sequences.size());
  for (size_t j = 0; j < batch.logit_rows.size(); ++j) {
    const int32_t r = batch.logit_rows[j];
    if (r >= 0 && static_cast<size_t>(r) < owner.size()) rows[owner[r]].push_back(static_cast<int>(j));
  }
  return rows;
}

absl::Status CheckDrafts(const StepPlan& plan) {
  const ForwardBatch& batch = plan.batch;
  std::vector<std::vector<int>> rows;
  int64_t start = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceChunk& c = batch.sequences[s];
    const int64_t end = start + c.num_tokens;
    if (c.num_draft != 0) {
      if (rows.empty()) rows = LogitRowsBySequence(batch);
      if (c.num_draft < 0 || c.num_draft >= c.num_tokens) {
        return absl::InvalidArgumentError(absl::StrCat("step plan: sequence ", s, " carries ", c.num_draft,
                                                       " drafts in a chunk of ", c.num_tokens, " tokens"));
      }
      // The last num_draft + 1 rows, in order: row i of them verifies draft i.
      const std::vector<int>& mine = rows[s];
      bool fits = mine.size() == static_cast<size_t>(c.num_draft) + 1;
      for (size_t i = 0; fits && i < mine.size(); ++i) {
        fits = batch.logit_rows[mine[i]] == end - c.num_draft - 1 + static_cast<int64_t>(i);
      }
      if (!fits) {
        return absl::InvalidArgumentError(absl::StrCat("step plan: sequence ", s, " carries ", c.num_draft,
                                                       " drafts but its logit rows are not its last ", c.num_draft + 1,
                                                       " rows in order"));
      }
    }
    start = end;
  }
  return absl::OkStatus();
}

StepResult AcceptDrafts(const StepPlan& plan, std::vector<SampledToken> sampled) {
  const ForwardBatch& batch = plan.batch;
  const std::vector<std::vector<int>> rows = LogitRowsBySequence(batch);
  StepResult result;
  int64_t start = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceChunk& c = batch.sequences[s];
    const int64_t end = start + c.num_tokens;
    start = end;
    if (rows[s].empty()) continue;
    SequenceResult& out = result.sequences.emplace_back();
    out.drafted = c.num_draft;
    for (size_t i = 0; i < rows[s].size(); ++i) {
      SampledToken& row = sampled[rows[s][i]];
      if (!row.error.ok()) {
        out.error = std::move(row.error);
        break;
      }
      out.tokens.push_back(row.token);
      out.logprobs.push_back(std::move(row.logprobs));
      if (c.num_draft == 0) continue;
      // Row i's token is the target's choice after draft i - 1; draft i (the token fed at the
      // next row) survives only if it is that choice. The first disagreement's token is kept as
      // the bonus, and nothing after it counts.
      if (i == rows[s].size() - 1) break;
      const int32_t draft = batch.token_ids[end - c.num_draft + static_cast<int64_t>(i)];
      if (row.token != draft) break;
      ++out.accepted;
    }
  }
  return result;
}

}  // namespace moe::runtime
