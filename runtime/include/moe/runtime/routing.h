// Routing: from a router's logits to each token's top-k experts and their weights. Plain
// functions, replicated on every rank; they follow transformers' definitions exactly
// (including masking dropped groups to 0, not -inf, for the sigmoid routers).
#pragma once

#include <cstdint>

#include "moe/runtime/model_spec.h"

namespace moe::runtime {

// router_logits: [num_tokens x spec.num_experts]; correction_bias: [num_experts] or null.
// Writes topk_ids and topk_weights, [num_tokens x spec.top_k] each, best expert first.
void RouteTokens(const RoutingSpec& spec, const float* router_logits, int64_t num_tokens, const float* correction_bias,
                 int32_t* topk_ids, float* topk_weights);

// Hybrid execution with some of a CPU layer's experts held by the backend too (or a tensor split's
// experts of this rank): one row's k picks (ids, weights) split by backend_index[expert], the
// expert's index among the backend's, or -1. host_ids/host_weights keep the picks of the experts
// that are not on the backend; backend_ids/backend_weights take the others, as backend indices. A
// pick that goes to the other side leaves its slot skipped (experts::kSkippedSlot, weight 0): the
// expert pool and the GPU's MoE kernels pass over such slots, so neither side reads an expert for
// it (a row with all its picks on one side costs the other nothing).
void SplitPicks(const int32_t* ids, const float* weights, int k, const int32_t* backend_index, int32_t* host_ids,
                float* host_weights, int32_t* backend_ids, float* backend_weights);

// Expert deferral (--defer-experts): one row's k picks split into those computed now and the `n`
// lowest-weighted ones (ties: the later slot), which finish later, beside the next layer's
// attention. Slots of weight 0 (SplitPicks' fillers) and skipped slots never count among the n.
// The other side's slots are experts::kSkippedSlot with weight 0 on each side.
void SplitDeferredPicks(const int32_t* ids, const float* weights, int k, int n, int32_t* now_ids, float* now_weights,
                        int32_t* later_ids, float* later_weights);

}  // namespace moe::runtime
