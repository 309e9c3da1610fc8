// The experts of the CPU pool's layers that a backend holds too, chosen while serving
// (ModelOptions::held_experts_per_layer without a profile): the router's picks are counted on the
// backend inside each step (graphs included), and every `refresh_steps` steps the decayed counts
// rank each layer's experts; a held expert that fell clearly out of the top is replaced by the
// newcomer (PlanHeldExpertSwaps), one expert's weights a step, so serving never pauses.
//
// Owned by the model; reads its weights' backend indices and swaps experts through the backend
// between steps. Thread-safety: the model's step thread only.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/model_weights.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/model.h"

namespace moe::runtime::internal {

class HeldExpertsPolicy {
 public:
  // `weights` and `checkpoint` must outlive the policy; `pool_layers` are the layers it watches.
  static absl::StatusOr<std::unique_ptr<HeldExpertsPolicy>> Start(Backend& backend, const Checkpoint& checkpoint,
                                                                  Model::Weights& weights, std::vector<int> pool_layers,
                                                                  int refresh_steps);

  // Before each step: applies one queued swap, and every refresh_steps steps ranks the counts and
  // queues the swaps. Errors are the backend's (a failed copy).
  absl::Status BeforeStep();
  // Where a MoE layer counts its picks: row `layer` of [num_layers x E] int32 on the backend.
  Tensor counts(int layer) const { return counts_->tensor().Rows(layer, 1); }
  Model::HeldExpertsStats stats() const { return stats_; }

 private:
  HeldExpertsPolicy(Backend& backend, const Checkpoint& checkpoint, Model::Weights& weights,
                    std::vector<int> pool_layers, int refresh_steps)
      : backend_(backend),
        checkpoint_(checkpoint),
        weights_(weights),
        pool_layers_(std::move(pool_layers)),
        refresh_steps_(refresh_steps) {}
  absl::Status ApplyOneSwap();
  absl::Status Refresh();

  struct Swap {
    int layer, out, in;
  };
  Backend& backend_;
  const Checkpoint& checkpoint_;
  Model::Weights& weights_;
  const std::vector<int> pool_layers_;
  const int refresh_steps_;
  std::unique_ptr<DeviceBuffer> counts_;  // [num_layers x E] int32 on the backend, rows of pool layers
  std::unique_ptr<HostBuffer> host_counts_;
  std::vector<int32_t> zeros_;
  std::vector<std::vector<double>> scores_;  // per model layer
  std::deque<Swap> pending_;
  int steps_ = 0;
  Model::HeldExpertsStats stats_;
};

}  // namespace moe::runtime::internal
