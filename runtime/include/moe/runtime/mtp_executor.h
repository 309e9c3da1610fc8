// MtpExecutor: the target checkpoint's MTP (nextn) head as the drafter of speculative decoding.
//
// After each step of the target, the head takes the step's rows (each position's hidden state from
// the target, before its final norm, with the token that followed it), so that its own KV cache
// follows the target's sequences block for block, as a draft model's does; the row of a sequence's
// newest token (its hidden state and the token just sampled after it) gives the first draft, and the
// head's own output hidden state with that draft the next, chained up to SequenceChunk::want_drafts
// (greedy), positions past the sequence's blocks in scratch blocks of the head's cache. The target's
// sampler decides what is kept, so the tokens served are those of decoding without drafts.
//
// The head runs on the CPU backend (Model loaded with ModelOptions::nextn_head), its routed experts
// on the backend. A prefill chunk's last position waits for the next chunk's first token: its
// hidden state is kept for one step (found by the block and position it belongs to), and written
// with the next chunk.
//
// Thread-safety: as Executor (one Execute at a time).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moe/runtime/cache.h"
#include "moe/runtime/executor.h"
#include "moe/runtime/model_executor.h"

namespace moe::runtime {

class MtpExecutor final : public Executor {
 public:
  // `target` runs the plans on a host backend and holds the KV capacity the scheduler plans with;
  // `head` (a Model loaded with nextn_head from the target's checkpoint) is not owned and must
  // outlive the executor, and take steps of the target's largest plus one row per sequence (a
  // prefill chunk's waiting row). `max_seqs`: sequences that may ask for drafts in one step.
  // kInvalidArgument when the head is not one, or not of this target's shape.
  static absl::StatusOr<std::unique_ptr<MtpExecutor>> Create(std::unique_ptr<ModelExecutor> target, Model& head,
                                                             int max_seqs);

  absl::StatusOr<StepResult> Execute(const StepPlan& plan) override;
  KvCapacity kv_capacity() const override { return target_->kv_capacity(); }
  uint64_t cache_generation() const override { return target_->cache_generation(); }
  const ModelInfo& model_info() const override { return target_->model_info(); }
  std::string Describe() const override;

 private:
  MtpExecutor(std::unique_ptr<ModelExecutor> target, Model& head, std::unique_ptr<KvCache> cache, int scratch_first,
              int scratch_per_seq, int max_seqs);
  // Runs the head over the step's rows and chains the drafts of every sequence of `plan` that
  // asked, into `result`.
  absl::Status Propose(const StepPlan& plan, StepResult* result);

  std::unique_ptr<ModelExecutor> target_;
  Model& head_;
  std::unique_ptr<KvCache> cache_;
  int scratch_first_;    // the first scratch block of the head's cache
  int scratch_per_seq_;  // scratch blocks each proposing sequence may use
  int max_seqs_;
  // The target's hidden state at the last position of each prefill chunk of the step before, by
  // (the block holding that position, the position): a block's ids and contents at a position
  // are one sequence's prefix, or a prefix shared token for token.
  std::map<std::pair<int32_t, int64_t>, std::vector<float>> waiting_;
};

}  // namespace moe::runtime
