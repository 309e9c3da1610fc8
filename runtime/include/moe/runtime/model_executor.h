// ModelExecutor: runs step plans on a model in this process, with a KV cache of its own that the
// scheduler's block ids index. It is the executor of a one-process server, and what a worker
// process runs behind its control stream.
//
// Thread-safety: as Executor: one Execute at a time; and since a Model runs one Forward at a
// time, executors sharing a model must not Execute at once either.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/cache.h"
#include "moe/runtime/executor.h"
#include "moe/runtime/model.h"

namespace moe::runtime {

class ModelExecutor final : public Executor {
 public:
  // Creates a KV cache of `num_blocks` blocks of `block_size` positions on the model's backend.
  // `model` is not owned and must outlive the executor. kInvalidArgument for a non-positive
  // size, kResourceExhausted when the backend cannot hold the cache.
  static absl::StatusOr<std::unique_ptr<ModelExecutor>> Create(Model& model, int num_blocks, int block_size = 16);

  absl::StatusOr<StepResult> Execute(const StepPlan& plan) override;
  // Execute, sampling on the host whatever the backend, and leaving the step's logits
  // [logit rows x vocab] fp32 in `logits` (Generate: the logits it returns, and the host's sampling
  // on every backend).
  absl::StatusOr<StepResult> ExecuteOnHost(const StepPlan& plan, std::vector<float>* logits);
  KvCapacity kv_capacity() const override;
  const ModelInfo& model_info() const override { return info_; }
  std::string Describe() const override { return description_; }
  // Keeps every row's hidden state of each step (the residual after the last layer, before the
  // final norm), for a drafter that reads them (an MTP head): hidden() is the last Execute's,
  // [rows x hidden_size] fp32, rows as the plan's batch. Host backends only (the step fails
  // otherwise).
  void set_keep_hidden(bool on) { keep_hidden_ = on; }
  const std::vector<float>& hidden() const { return hidden_; }
  Model& model() { return model_; }

 private:
  ModelExecutor(Model& model, std::unique_ptr<KvCache> cache);
  // Execute; with `host_logits`, ExecuteOnHost.
  absl::StatusOr<StepResult> Run(const StepPlan& plan, std::vector<float>* host_logits);
  // One sample per logit row of the step, from `device_logits` [rows x vocab] on the backend
  // (sampled there when the backend samples and `on_host` is false, else on the host, leaving the
  // logits in logits_).
  absl::StatusOr<std::vector<SampledToken>> SampleLogitRows(const StepPlan& plan, const Tensor& device_logits,
                                                            bool on_host);
  // Samples row `row` of the step from its logits[vocab], penalties applied.
  int32_t Sample(const SampleRow& row, const float* logits, int vocab);

  Model& model_;
  const std::unique_ptr<KvCache> cache_;
  const ModelInfo info_;
  const std::string description_;
  // Reused across steps, so a step allocates nothing once sizes settle.
  std::vector<float> logits_;
  std::vector<float> penalized_;
  std::vector<float> masked_;
  bool keep_hidden_ = false;
  std::vector<float> hidden_;
};

// The ModelInfo of a model with this spec.
ModelInfo ModelInfoFor(const ModelSpec& spec);

}  // namespace moe::runtime
