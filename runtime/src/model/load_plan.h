// What Model::Load decides from its options before it reads a weight, every option checked against
// the spec and the backend first: a function of the options, so that another loader (a draft model,
// an MTP head) asks the same questions and gets the same refusals.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/parallel.h"

namespace moe::runtime::internal {

struct LoadPlan {
  std::vector<int> pool_layers;  // the layers whose routed experts the CPU pool holds, sorted
  // Per model layer, the routed experts the backend holds: every one, none (a pool layer), or a pool
  // layer's held ones (backend_experts, or the first held_experts_per_layer until the policy swaps).
  std::vector<std::vector<int>> backend_experts;
};

// kInvalidArgument unless max_step_tokens and max_logit_rows are positive.
absl::Status CheckStepLimits(const ModelOptions& options);

// The plan for the layers [layers.begin, layers.end) this rank holds on `backend`.
// kInvalidArgument naming the option for a pool layer without routed experts, a KV dtype the backend
// does not keep, expert deferral out of range or without a pool, backend_experts outside the pool
// or not distinct ids, held experts out of range; kUnimplemented for held experts in a tensor
// split; kFailedPrecondition for a pool beside a host backend without fp32 activations.
absl::StatusOr<LoadPlan> PlanLoad(const ModelSpec& spec, const ModelOptions& options, Range layers,
                                  const Backend& backend);

}  // namespace moe::runtime::internal
