// A target executor with a draft model beside it (speculative decoding's kDraft): every step runs
// on the target, then the same rows run on the draft model, whose KV cache therefore follows the
// target's sequences block for block (same block ids, same positions, the same rollbacks); then,
// for each sequence that asked (SequenceChunk::want_drafts), the draft model decodes greedily from
// the step's last token, chained, and its tokens come back in SequenceResult::drafts for the next
// step to verify. The target's sampler checks every draft, so the tokens served do not depend on
// the draft model; a draft that agrees with the target only makes steps serve more tokens.
//
// The draft model never fails a step: one it cannot run (a position past its context) proposes
// nothing. The draft's cache holds the target's blocks plus scratch blocks for the chained proposals
// (positions past a sequence's block table), so a proposal never writes a block the scheduler gave
// another sequence. The caller checks that the two models share a vocabulary (the tokenizer's
// token texts) before pairing them.
//
// Thread-safety: as Executor (one Execute at a time).
#pragma once

#include <memory>
#include <string>

#include "moe/runtime/executor.h"
#include "moe/runtime/model_executor.h"

namespace moe::runtime {

class DraftModelExecutor final : public Executor {
 public:
  // `target` runs the plans and holds the KV capacity the scheduler plans with; `draft` is not
  // owned and must outlive the executor, and must have the target's vocabulary size
  // (kInvalidArgument otherwise). `max_seqs`: sequences that may ask for drafts in one step.
  static absl::StatusOr<std::unique_ptr<DraftModelExecutor>> Create(std::unique_ptr<Executor> target, Model& draft,
                                                                    int max_seqs);

  absl::StatusOr<StepResult> Execute(const StepPlan& plan) override;
  KvCapacity kv_capacity() const override { return target_->kv_capacity(); }
  uint64_t cache_generation() const override { return target_->cache_generation(); }
  const ModelInfo& model_info() const override { return target_->model_info(); }
  std::string Describe() const override;

 private:
  DraftModelExecutor(std::unique_ptr<Executor> target, std::unique_ptr<ModelExecutor> draft, std::string draft_name,
                     int scratch_first, int scratch_per_seq, int max_seqs);
  // Proposes the drafts of every sequence of `plan` that asked, into `result`.
  absl::Status Propose(const StepPlan& plan, StepResult* result);

  std::unique_ptr<Executor> target_;
  std::unique_ptr<ModelExecutor> draft_;
  std::string draft_name_;
  int scratch_first_;    // the first scratch block of the draft's cache
  int scratch_per_seq_;  // scratch blocks each proposing sequence may use
  int max_seqs_;
};

}  // namespace moe::runtime
