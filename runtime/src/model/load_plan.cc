#include "model/load_plan.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "moe/core/dtype.h"

namespace moe::runtime::internal {

absl::Status CheckStepLimits(const ModelOptions& options) {
  if (options.max_step_tokens <= 0 || options.max_logit_rows <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_step_tokens (", options.max_step_tokens,
                                                   ") and max_logit_rows (", options.max_logit_rows,
                                                   ") must be positive"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadPlan> PlanLoad(const ModelSpec& spec, const ModelOptions& options, Range layers, const Backend& b) {
  LoadPlan plan;
  std::vector<int>& pool_layers = plan.pool_layers;
  if (options.experts == RoutedExpertsMode::kPool) {
    if (options.pool_layers) {
      pool_layers = *options.pool_layers;
      std::sort(pool_layers.begin(), pool_layers.end());
      pool_layers.erase(std::unique(pool_layers.begin(), pool_layers.end()), pool_layers.end());
      for (int l : pool_layers) {
        if (l < 0 || l >= spec.num_layers || !spec.IsMoeLayer(l)) {
          return absl::InvalidArgumentError(
              absl::StrCat("routed experts of layer ", l, " in the CPU pool: the model's ", spec.num_layers,
                           " layers have routed experts in ", spec.num_moe_layers(), " of them, and not in layer ", l));
        }
      }
    } else {
      for (int l = 0; l < spec.num_layers; ++l) {
        if (spec.IsMoeLayer(l)) pool_layers.push_back(l);
      }
    }
    // A layer split's stage holds only its own layers' experts.
    pool_layers.erase(std::remove_if(pool_layers.begin(), pool_layers.end(),
                                     [&](int l) { return l < layers.begin || l >= layers.end; }),
                      pool_layers.end());
  }
  const bool tensor = options.parallel.mode == ParallelMode::kTensor && options.parallel.split();
  if (tensor && (options.held_experts_per_layer > 0 || !options.backend_experts.empty())) {
    return absl::UnimplementedError(
        "a tensor split owns its share of the routed experts; holding a pool layer's experts on the GPU too "
        "(--gpu-experts-per-layer) is not built for it yet");
  }
  const bool pool = !pool_layers.empty();
  if (options.kv_cache_dtype && !b.SupportsKvDtype(*options.kv_cache_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV cache in ", core::DTypeName(*options.kv_cache_dtype), ": ", b.name(), " keeps it in ",
                     core::DTypeName(b.activation_dtype()),
                     *options.kv_cache_dtype == core::DType::kF8E4M3 ? " (an fp8 KV cache is for a GPU)" : ""));
  }
  if (options.defer_experts < 0 || options.defer_experts >= spec.routing.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("defer_experts ", options.defer_experts, ": the model picks ",
                                                   spec.routing.top_k, " experts a token, so at most ",
                                                   spec.routing.top_k - 1, " can be deferred"));
  }
  if (options.defer_experts > 0 && !pool) {
    return absl::InvalidArgumentError(
        "expert deferral finishes routed experts in the CPU pool beside the next layer's attention: it needs "
        "routed experts in the pool (--experts auto or pool on the CPU, --cpu-moe or --n-cpu-moe on a GPU)");
  }
  if (pool && b.HostAddressable() && b.activation_dtype() != core::DType::kF32) {
    return absl::FailedPreconditionError(absl::StrCat("routed experts in the CPU expert pool need fp32 activations; ",
                                                      b.name(), " has ", core::DTypeName(b.activation_dtype())));
  }
  // The routed experts each layer's backend holds: all of them, or for a pool layer the ones
  // options.backend_experts names (--gpu-experts-per-layer).
  std::vector<std::vector<int>>& backend_experts = plan.backend_experts;
  backend_experts.resize(spec.num_layers);
  for (int l = 0; l < spec.num_layers; ++l) {
    backend_experts[l].resize(spec.routing.num_experts);
    std::iota(backend_experts[l].begin(), backend_experts[l].end(), 0);
  }
  for (int l : pool_layers) backend_experts[l].clear();
  for (const auto& [layer, ids] : options.backend_experts) {
    if (std::find(pool_layers.begin(), pool_layers.end(), layer) == pool_layers.end()) {
      return absl::InvalidArgumentError(absl::StrCat("experts of layer ", layer,
                                                     " held on the backend too: the layer's experts are not in the "
                                                     "CPU pool"));
    }
    std::vector<int> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    if (std::unique(sorted.begin(), sorted.end()) != sorted.end() || sorted.empty() || sorted.front() < 0 ||
        sorted.back() >= spec.routing.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("experts of layer ", layer,
                                                     " held on the backend too: distinct ids in [0, ",
                                                     spec.routing.num_experts, ") expected"));
    }
    backend_experts[layer] = ids;
  }
  const int held_n = options.held_experts_per_layer;
  if (held_n != 0) {
    if (held_n < 0 || held_n > spec.routing.num_experts || !options.backend_experts.empty() || pool_layers.empty() ||
        options.held_experts_refresh_steps < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "experts held on the backend while serving: ", held_n, " of each pool layer's ", spec.routing.num_experts,
          " (1 to ", spec.routing.num_experts, "), refreshed every ", options.held_experts_refresh_steps,
          " steps (1 or more), with routed experts in the pool and no backend_experts (a profile's choice)"));
    }
    for (int l : pool_layers) {
      backend_experts[l].resize(held_n);
      std::iota(backend_experts[l].begin(), backend_experts[l].end(), 0);
    }
  }
  return plan;
}

}  // namespace moe::runtime::internal
