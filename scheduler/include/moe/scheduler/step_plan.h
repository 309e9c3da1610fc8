// The boundary between the scheduler and whatever runs the model: once per step the scheduler
// builds a StepPlan and an Executor runs it, returning one sampled token per logit row. The
// in-process executor wraps a runtime::Model; worker processes implement the same interface.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/kv_cache.h"
#include "moe/runtime/model.h"
#include "moe/runtime/sampler.h"

namespace moe::scheduler {

struct SampleRow {
  int64_t seq_id = 0;  // the sequence; its id seeds the draw when the request has no seed
  runtime::SamplingParams sampling;
  // The sequence's tokens so far (prompt, then output), for the penalties; valid during Execute.
  const int32_t* tokens = nullptr;
  int prompt_len = 0;
  int total_len = 0;
  int logprobs = 0;  // top alternatives to return with the token's log-probability (0: none)
};

struct SampledToken {
  int32_t token = 0;
  std::optional<runtime::TokenLogprobs> logprobs;  // when the row asked for them
  // Set when this row's logits could not be sampled (not finite): the sequence fails with it,
  // the others in the step go on.
  absl::Status error;
};

struct StepPlan {
  runtime::ForwardBatch batch;
  std::vector<SampleRow> samples;                   // one per batch.logit_rows entry, same order
  std::vector<int64_t> released_seq_ids;            // sequences that ended: drop their sampler state
};

class Executor {
 public:
  virtual ~Executor() = default;
  // One sampled token per logit row of the plan. An error fails the plan's sequences only.
  virtual absl::StatusOr<std::vector<SampledToken>> Execute(const StepPlan& plan) = 0;
};

// Runs plans on a model in this process, with the KV cache the scheduler's blocks index.
// Not thread-safe: one Execute at a time.
class ModelExecutor : public Executor {
 public:
  ModelExecutor(runtime::Model& model, runtime::KvCache& cache) : model_(model), cache_(cache) {}
  absl::StatusOr<std::vector<SampledToken>> Execute(const StepPlan& plan) override;

 private:
  runtime::Model& model_;
  runtime::KvCache& cache_;
  std::vector<float> logits_;
};

}  // namespace moe::scheduler
