#include "moe/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe::runtime {

absl::Status SamplingParams::Validate() const {
  if (std::isnan(temperature) || temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be >= 0, got ", temperature));
  }
  if (std::isnan(top_p) || top_p <= 0 || top_p > 1) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  if (top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", top_k));
  if (std::isnan(min_p) || min_p < 0 || min_p > 1) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", min_p));
  }
  return absl::OkStatus();
}

int32_t ArgMax(const float* values, int n) {
  return static_cast<int32_t>(std::max_element(values, values + n) - values);
}

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  rng_.seed(params.seed.has_value() ? *params.seed : std::random_device{}());
}

int32_t Sampler::Sample(const float* logits, int vocab) {
  if (params_.greedy()) return ArgMax(logits, vocab);
  // Candidates sorted by logit, best first; filters only ever cut the tail.
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  int keep = vocab;
  if (params_.top_k > 0 && params_.top_k < vocab) {
    keep = params_.top_k;
    std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  } else {
    std::sort(order.begin(), order.end(),
              [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  }
  std::vector<double> probs(keep);
  const double inv_t = 1.0 / params_.temperature;
  const double top = logits[order[0]];
  double sum = 0;
  for (int i = 0; i < keep; ++i) sum += probs[i] = std::exp((logits[order[i]] - top) * inv_t);
  for (double& p : probs) p /= sum;
  if (params_.min_p > 0) {
    const double floor = params_.min_p * probs[0];
    while (keep > 1 && probs[keep - 1] < floor) --keep;
  }
  if (params_.top_p < 1) {
    double cum = 0;
    int n = 0;
    while (n < keep) {
      cum += probs[n++];
      if (cum >= params_.top_p) break;
    }
    keep = std::max(n, 1);
  }
  double total = std::accumulate(probs.begin(), probs.begin() + keep, 0.0);
  double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (int i = 0; i < keep; ++i) {
    u -= probs[i];
    if (u < 0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace moe::runtime
