// Hybrid prefill's threshold, measured at load: from how many tokens a step streams a CPU pool
// layer's packed experts to the GPU over PCIe and computes them there, rather than on the host's
// cores (--prefill-offload-tokens -1, the default).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/experts/expert_pool.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/model_spec.h"

namespace moe::runtime::internal {

struct PrefillOffload {
  int tokens = 0;    // steps of at least this many tokens stream the experts
  std::string note;  // what was measured, for the load log
};

// One layer of random tokens (at most max_step_tokens, at most 512) on the pool (best of three),
// then streamed to the backend and computed there (the second of two runs: the first loads the
// kernels); the CPU's time grows with the tokens, the stream's hardly, so the threshold is where
// they cross (never below 32). The backend must already hold the streamed experts
// (Backend::SetStreamedExperts) and `host` must be the model's routed experts; its stream
// threshold is left at 1 (the caller sets the result).
absl::StatusOr<PrefillOffload> MeasurePrefillOffload(Backend& backend, experts::ExpertPool& pool,
                                                     HostExpertCompute& host, const ModelSpec& spec,
                                                     const std::vector<int>& pool_layers, int max_step_tokens);

}  // namespace moe::runtime::internal
