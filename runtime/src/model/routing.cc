#include "moe/runtime/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "moe/experts/expert_pool.h"

namespace moe::runtime {
namespace {

// Indices of the k largest values, best first; ties go to the lower index (as torch.topk on CPU
// returns them for distinct values; exact ties do not occur with real logits).
void TopK(const float* values, int n, int k, int32_t* out) {
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return values[a] > values[b] || (values[a] == values[b] && a < b); });
  std::copy(idx.begin(), idx.begin() + k, out);
}

void RouteSoftmax(const RoutingSpec& spec, const float* logits, int32_t* ids, float* weights) {
  const int e = spec.num_experts;
  std::vector<float> probs(e);
  const float max_logit = *std::max_element(logits, logits + e);
  float sum = 0;
  for (int i = 0; i < e; ++i) sum += probs[i] = std::exp(logits[i] - max_logit);
  for (float& p : probs) p /= sum;
  TopK(probs.data(), e, spec.top_k, ids);
  float chosen = 0;
  for (int i = 0; i < spec.top_k; ++i) chosen += weights[i] = probs[ids[i]];
  for (int i = 0; i < spec.top_k; ++i) {
    if (spec.normalize_top_k) weights[i] /= chosen;
    weights[i] *= spec.routed_scaling_factor;
  }
}

// Sigmoid scores; the correction bias shifts the choice only; groups ranked by the sum of their
// two best biased scores; experts outside the best `topk_group` groups score 0 for the choice.
void RouteSigmoid(const RoutingSpec& spec, const float* logits, const float* bias, int32_t* ids, float* weights) {
  const int e = spec.num_experts;
  const int per_group = e / spec.n_group;
  std::vector<float> scores(e), choice(e);
  for (int i = 0; i < e; ++i) {
    scores[i] = 1.0f / (1.0f + std::exp(-logits[i]));
    choice[i] = scores[i] + (bias != nullptr ? bias[i] : 0.0f);
  }
  if (spec.n_group > 1) {
    std::vector<float> group_score(spec.n_group);
    const int best_of = std::min(2, per_group);
    for (int g = 0; g < spec.n_group; ++g) {
      std::vector<float> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::partial_sort(members.begin(), members.begin() + best_of, members.end(), std::greater<float>());
      group_score[g] = std::accumulate(members.begin(), members.begin() + best_of, 0.0f);
    }
    std::vector<int32_t> kept(spec.topk_group);
    TopK(group_score.data(), spec.n_group, spec.topk_group, kept.data());
    std::vector<bool> keep(spec.n_group, false);
    for (int32_t g : kept) keep[g] = true;
    for (int i = 0; i < e; ++i) {
      if (!keep[i / per_group]) choice[i] = 0.0f;
    }
  }
  TopK(choice.data(), e, spec.top_k, ids);
  float chosen = 0;
  for (int i = 0; i < spec.top_k; ++i) chosen += weights[i] = scores[ids[i]];
  for (int i = 0; i < spec.top_k; ++i) {
    if (spec.normalize_top_k) weights[i] /= (chosen + 1e-20f);
    weights[i] *= spec.routed_scaling_factor;
  }
}

}  // namespace

void RouteTokens(const RoutingSpec& spec, const float* router_logits, int64_t num_tokens, const float* correction_bias,
                 int32_t* topk_ids, float* topk_weights) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* logits = router_logits + t * spec.num_experts;
    int32_t* ids = topk_ids + t * spec.top_k;
    float* weights = topk_weights + t * spec.top_k;
    if (spec.scoring == ScoringFunction::kSoftmax) {
      RouteSoftmax(spec, logits, ids, weights);
    } else {
      RouteSigmoid(spec, logits, correction_bias, ids, weights);
    }
  }
}

void SplitPicks(const int32_t* ids, const float* weights, int k, const int32_t* backend_index, int32_t* host_ids,
                float* host_weights, int32_t* backend_ids, float* backend_weights) {
  for (int j = 0; j < k; ++j) {
    const int32_t local = ids[j] >= 0 ? backend_index[ids[j]] : -1;
    const bool host = ids[j] >= 0 && local < 0;
    host_ids[j] = host ? ids[j] : experts::kSkippedSlot;
    host_weights[j] = host ? weights[j] : 0.0f;
    backend_ids[j] = local >= 0 ? local : experts::kSkippedSlot;
    backend_weights[j] = local >= 0 ? weights[j] : 0.0f;
  }
}

void SplitDeferredPicks(const int32_t* ids, const float* weights, int k, int n, int32_t* now_ids, float* now_weights,
                        int32_t* later_ids, float* later_weights) {
  for (int j = 0; j < k; ++j) {
    now_ids[j] = ids[j];
    now_weights[j] = weights[j];
    later_ids[j] = experts::kSkippedSlot;
    later_weights[j] = 0.0f;
  }
  for (int d = 0; d < n; ++d) {
    int lowest = -1;
    for (int j = k - 1; j >= 0; --j) {
      if (now_ids[j] < 0 || !(now_weights[j] > 0.0f)) continue;
      if (lowest < 0 || now_weights[j] < now_weights[lowest]) lowest = j;
    }
    if (lowest < 0) return;  // fewer than n real picks: the rest stay now
    later_ids[lowest] = now_ids[lowest];
    later_weights[lowest] = now_weights[lowest];
    now_ids[lowest] = experts::kSkippedSlot;
    now_weights[lowest] = 0.0f;
  }
}

}  // namespace moe::runtime
