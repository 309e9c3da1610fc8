// A routing profile: how often the router of each MoE layer picked each expert over some prompts
// (`moeserve profile-experts` writes one). Hybrid execution holds each CPU layer's most used
// experts on the GPU too (--gpu-experts-per-layer N --expert-profile FILE).
//
// The file is JSON:
//   {"format": "moeserve routing profile", "model_type": "qwen3_moe", "num_layers": 48,
//    "num_experts": 128, "top_k": 8, "tokens": 4096,
//    "layers": [{"layer": 0, "counts": [128 integers]}, ...]}   (MoE layers, by model layer index)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/model_spec.h"

namespace moe::runtime {

struct RoutingProfile {
  std::string model_type;
  int num_layers = 0;
  int num_experts = 0;
  int top_k = 0;
  int64_t tokens = 0;                          // tokens routed
  std::map<int, std::vector<int64_t>> counts;  // model layer -> picks per expert

  // An empty profile for `spec`: every MoE layer, zero counts.
  static RoutingProfile For(const ModelSpec& spec);
};

// Reads `path` and checks it against `spec`. kInvalidArgument naming the file and what is wrong:
// not JSON, another model (type, layers, experts), a MoE layer without counts or with the wrong
// number of them (naming the layer), a negative count. kNotFound if there is no such file.
absl::StatusOr<RoutingProfile> LoadRoutingProfile(const std::string& path, const ModelSpec& spec);
absl::Status SaveRoutingProfile(const std::string& path, const RoutingProfile& profile);

// The `n` experts of `layer` picked most often, most first (ties: the lower id first).
std::vector<int> MostUsedExperts(const RoutingProfile& profile, int layer, int n);

// The share of `layer`'s picks that went to `experts` (0 when it has none).
double ShareOfPicks(const RoutingProfile& profile, int layer, const std::vector<int>& experts);

// The mean over `layers` (every layer of the profile when empty) of the share of picks that each
// layer's `n` most used experts took.
double MeanShareOfMostUsed(const RoutingProfile& profile, const std::vector<int>& layers, int n);

// The experts a GPU holds of a CPU layer when they are chosen while serving: given each expert's
// score (its decayed pick count) and the experts held now, the swaps {held expert out, expert in}
// that move the held set toward the top |held| by score, the best newcomer taking the place of the
// weakest holder first. A newcomer replaces a holder only when its score is above `margin` times
// the holder's and the gap is beyond two standard deviations of a pick count (a Poisson count's
// is its square root), so that noise in the counts does not churn the GPU's copies.
std::vector<std::pair<int, int>> PlanHeldExpertSwaps(const std::vector<double>& scores, const std::vector<int>& held,
                                                     double margin);

}  // namespace moe::runtime
