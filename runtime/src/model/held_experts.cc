#include "model/held_experts.h"

#include <utility>

#include "moe/core/logging.h"
#include "moe/core/status.h"
#include "moe/runtime/routing_profile.h"

namespace moe::runtime::internal {
namespace {

// A newcomer takes a held expert's place on the backend only when its score is this much higher.
constexpr double kHeldExpertsMargin = 1.25;
// At each refresh the scores so far are multiplied by this before the new counts are added: the
// ranking remembers about four refreshes' worth of picks.
constexpr double kHeldExpertsDecay = 0.75;

}  // namespace

absl::StatusOr<std::unique_ptr<HeldExpertsPolicy>> HeldExpertsPolicy::Start(Backend& backend,
                                                                            const Checkpoint& checkpoint,
                                                                            Model::Weights& weights,
                                                                            std::vector<int> pool_layers,
                                                                            int refresh_steps) {
  const ModelSpec& spec = checkpoint.spec();
  const int e = spec.routing.num_experts;
  std::unique_ptr<HeldExpertsPolicy> p(
      new HeldExpertsPolicy(backend, checkpoint, weights, std::move(pool_layers), refresh_steps));
  MOE_ASSIGN_OR_RETURN(p->counts_, backend.Allocate(core::DType::kI32, spec.num_layers, e));
  MOE_ASSIGN_OR_RETURN(p->host_counts_, backend.AllocateHost(int64_t{spec.num_layers} * e * 4));
  p->zeros_.assign(static_cast<size_t>(spec.num_layers) * e, 0);
  p->scores_.assign(spec.num_layers, std::vector<double>(e, 0.0));
  backend.CopyFromHost(p->zeros_.data(), p->counts_->tensor());
  MOE_RETURN_IF_ERROR(backend.Synchronize());
  return p;
}

absl::Status HeldExpertsPolicy::BeforeStep() {
  MOE_RETURN_IF_ERROR(ApplyOneSwap());
  if (++steps_ < refresh_steps_) return absl::OkStatus();
  steps_ = 0;
  return Refresh();
}

// One swap a step: one expert's weights copied to the backend, queued before the step.
absl::Status HeldExpertsPolicy::ApplyOneSwap() {
  while (!pending_.empty()) {
    const Swap swap = pending_.front();
    pending_.pop_front();
    LayerWeights& lw = weights_.layers[swap.layer];
    const int slot = lw.backend_index_host[swap.out];
    if (slot < 0 || lw.backend_index_host[swap.in] >= 0) continue;  // no longer applies
    std::vector<float> storage[3];
    core::TensorView views[3];
    const TensorId ids[3] = {TensorId::kExpertGate, TensorId::kExpertUp, TensorId::kExpertDown};
    for (int i = 0; i < 3; ++i) {
      MOE_ASSIGN_OR_RETURN(const WeightView stored, checkpoint_.Get({ids[i], swap.layer, swap.in}));
      MOE_ASSIGN_OR_RETURN(views[i], ExpandToFloats(stored, &storage[i]));
    }
    MOE_RETURN_IF_ERROR(backend_.ReplaceExpert(*lw.experts, slot, views[0], views[1], views[2]));
    // A dequantized copy (GGUF) must outlive the upload.
    if (!storage[0].empty() || !storage[1].empty() || !storage[2].empty()) MOE_RETURN_IF_ERROR(backend_.Synchronize());
    lw.backend_index_host[swap.out] = -1;
    lw.backend_index_host[swap.in] = slot;
    backend_.CopyFromHost(lw.backend_index_host.data(), lw.backend_index->tensor());
    ++stats_.swaps;
    break;
  }
  return absl::OkStatus();
}

absl::Status HeldExpertsPolicy::Refresh() {
  ++stats_.refreshes;
  backend_.CopyToHost(counts_->tensor(), host_counts_->data());
  MOE_RETURN_IF_ERROR(backend_.Synchronize());
  backend_.CopyFromHost(zeros_.data(), counts_->tensor());
  const int e = checkpoint_.spec().routing.num_experts;
  pending_.clear();
  for (int layer : pool_layers_) {
    const LayerWeights& lw = weights_.layers[layer];
    if (lw.backend_index == nullptr) continue;
    const int32_t* counts = host_counts_->as<int32_t>() + static_cast<int64_t>(layer) * e;
    std::vector<double>& scores = scores_[layer];
    std::vector<int> held;
    for (int x = 0; x < e; ++x) {
      scores[x] = kHeldExpertsDecay * scores[x] + counts[x];
      stats_.picks += counts[x];
      if (lw.backend_index_host[x] >= 0) {
        held.push_back(x);
        stats_.held_picks += counts[x];
      }
    }
    for (const auto& [out, in] : PlanHeldExpertSwaps(scores, held, kHeldExpertsMargin)) {
      pending_.push_back({layer, out, in});
    }
  }
  if (!pending_.empty()) {
    MOE_LOG(kInfo) << "experts held on " << backend_.name() << ": " << pending_.size()
                   << " swaps queued from the picks counted while serving (one a step)";
  }
  return absl::OkStatus();
}

}  // namespace moe::runtime::internal
