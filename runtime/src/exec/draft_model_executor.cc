#include "moe/runtime/draft_model_executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"
#include "moe/runtime/cache.h"
#include "moe/runtime/speculative.h"

namespace moe::runtime {

absl::StatusOr<std::unique_ptr<DraftModelExecutor>> DraftModelExecutor::Create(std::unique_ptr<Executor> target,
                                                                               Model& draft, int max_seqs) {
  if (target == nullptr) return absl::InvalidArgumentError("a draft model needs a target executor, got none");
  const ModelInfo& info = target->model_info();
  if (draft.spec().vocab_size != info.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("the draft model's vocabulary has ", draft.spec().vocab_size,
                                                   " ids, the target's ", info.vocab_size,
                                                   "; a draft must share the target's vocabulary"));
  }
  const KvCapacity kv = target->kv_capacity();
  // A proposal writes at most kMaxDraftTokens positions past the step, which may start anywhere in
  // a block: that many positions more, and one block for the partial one.
  const int per_seq = BlocksFor(kMaxDraftTokens, kv.block_size) + 1;
  const int seqs = std::max(max_seqs, 1);
  MOE_ASSIGN_OR_RETURN(auto cache, ModelExecutor::Create(draft, kv.num_blocks + seqs * per_seq, kv.block_size));
  return std::unique_ptr<DraftModelExecutor>(new DraftModelExecutor(std::move(target), std::move(cache),
                                                                    draft.spec().model_type, kv.num_blocks, per_seq,
                                                                    seqs));
}

DraftModelExecutor::DraftModelExecutor(std::unique_ptr<Executor> target, std::unique_ptr<ModelExecutor> draft,
                                       std::string draft_name, int scratch_first, int scratch_per_seq, int max_seqs)
    : target_(std::move(target)),
      draft_(std::move(draft)),
      draft_name_(std::move(draft_name)),
      scratch_first_(scratch_first),
      scratch_per_seq_(scratch_per_seq),
      max_seqs_(max_seqs) {}

std::string DraftModelExecutor::Describe() const {
  return absl::StrCat(target_->Describe(), ", drafts from a ", draft_name_, " draft model on the CPU");
}

absl::StatusOr<StepResult> DraftModelExecutor::Execute(const StepPlan& plan) {
  MOE_ASSIGN_OR_RETURN(StepResult result, target_->Execute(plan));
  // The draft's cache takes the same rows at the same positions in the same blocks; it needs no
  // logits of them (the step's last token is fed again, at its own position, to start a proposal).
  StepPlan mirror;
  mirror.batch = plan.batch;
  mirror.batch.logit_rows.clear();
  for (SequenceChunk& c : mirror.batch.sequences) {
    c.num_draft = 0;
    c.want_drafts = 0;
  }
  mirror.released = plan.released;
  // The target's tokens stand whatever happens to the draft (a position past its context, say):
  // a step it cannot follow proposes nothing, and only later drafts may be worse for it.
  if (!draft_->Execute(mirror).ok()) return result;
  if (absl::Status s = Propose(plan, &result); !s.ok()) {
    for (SequenceResult& r : result.sequences) r.drafts.clear();
  }
  return result;
}

absl::Status DraftModelExecutor::Propose(const StepPlan& plan, StepResult* result) {
  const ForwardBatch& batch = plan.batch;
  const std::vector<std::vector<int>> rows = LogitRowsBySequence(batch);
  const int block_size = kv_capacity().block_size;
  struct Chain {
    SequenceResult* out;
    int64_t position;  // where the next fed token goes
    int32_t token;     // the next token to feed
    int want;
    std::vector<int32_t> table;
  };
  std::vector<Chain> chains;
  size_t next = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    if (rows[s].empty()) continue;
    if (next >= result->sequences.size()) break;
    SequenceResult& r = result->sequences[next++];
    const SequenceChunk& c = batch.sequences[s];
    const int want = std::min(c.want_drafts, kMaxDraftTokens);
    if (want <= 0 || !r.error.ok() || r.tokens.empty() || static_cast<int>(chains.size()) >= max_seqs_) continue;
    Chain chain{&r, c.first_position + c.num_tokens - c.num_draft + r.accepted, r.tokens.back(), want,
                c.block_table};
    // Positions past the table go to this chain's scratch blocks.
    const int first_scratch = scratch_first_ + static_cast<int>(chains.size()) * scratch_per_seq_;
    const int need = BlocksFor(chain.position + want, block_size) - static_cast<int>(chain.table.size());
    for (int b = 0; b < std::min(need, scratch_per_seq_); ++b) chain.table.push_back(first_scratch + b);
    if (need > scratch_per_seq_) continue;  // a table shorter than its own tokens: not this step's to fix
    chains.push_back(std::move(chain));
  }
  // One greedy token per chain per round, every chain in one batch.
  for (int round = 0; !chains.empty(); ++round) {
    StepPlan step;
    std::vector<Chain*> live;
    for (Chain& chain : chains) {
      if (round >= chain.want) continue;
      step.batch.token_ids.push_back(chain.token);
      SequenceChunk& c = step.batch.sequences.emplace_back();
      c.first_position = chain.position;
      c.num_tokens = 1;
      c.block_table = chain.table;
      step.batch.logit_rows.push_back(static_cast<int32_t>(step.batch.token_ids.size()) - 1);
      SampleRow& row = step.samples.emplace_back();
      row.position = static_cast<uint32_t>(chain.position + 1);  // greedy: temperature 0
      live.push_back(&chain);
    }
    if (live.empty()) break;
    MOE_ASSIGN_OR_RETURN(StepResult drawn, draft_->Execute(step));
    if (drawn.sequences.size() != live.size()) return absl::InternalError("draft model: a proposal lost its rows");
    for (size_t i = 0; i < live.size(); ++i) {
      const SequenceResult& d = drawn.sequences[i];
      if (!d.error.ok() || d.tokens.empty()) {
        live[i]->want = round;  // stop this chain; what it proposed stands
        continue;
      }
      live[i]->out->drafts.push_back(d.tokens.back());
      live[i]->token = d.tokens.back();
      ++live[i]->position;
    }
  }
  return absl::OkStatus();
}

}  // namespace moe::runtime
