// Routing: from a router's logits to each token's top-k experts and their weights. Plain
// functions, replicated on every rank; they follow transformers' definitions exactly
// (including masking dropped groups to 0, not -inf, for the sigmoid routers).
#pragma once

#include <cstdint>

#include "moe/runtime/model_spec.h"

namespace moe::runtime {

// router_logits: [num_tokens x spec.num_experts]; correction_bias: [num_experts] or null.
// Writes topk_ids and topk_weights, [num_tokens x spec.top_k] each, best expert first.
void RouteTokens(const RoutingSpec& spec, const float* router_logits, int64_t num_tokens,
                 const float* correction_bias, int32_t* topk_ids, float* topk_weights);

}  // namespace moe::runtime
