// What the GPU router (RouteTopK in ops.h, routing.cu) supports. The limits are checked when a
// model is loaded, since they come from its config.json; RouteTopK itself returns nothing.
#pragma once

#include "absl/status/status.h"
#include "cuda/ops.h"

namespace moe::runtime::cuda {

inline constexpr int kRouterMaxExperts = 512;
inline constexpr int kRouterMaxTopK = 16;
inline constexpr int kRouterMaxGroups = 16;

// OK when RouteTopK can route with `params`: 1 <= num_experts <= 512, 1 <= top_k <=
// min(16, num_experts), and for sigmoid routing 1 <= n_group <= 16 dividing num_experts and,
// when n_group > 1, 1 <= topk_group <= n_group (softmax routing is not grouped, as on the CPU).
// kFailedPrecondition otherwise, naming the limit. A
// RouteTopK call with parameters this refuses writes expert 0 with NaN weights for every token
// (memory-safe for the expert kernels, and loud in the logits) instead of routing.
absl::Status CheckRouterParams(const RouterParams& params);

// Each row's top_k picks split between the host and the GPU's copies of some experts, as the CPU's
// SplitPicks (routing.h of the runtime) does: backend_index [num_experts] int32 (-1: on the host
// only); all arrays [rows x top_k]. One thread a row.
void SplitRouting(const int32_t* ids, const float* weights, int rows, int top_k, const int32_t* backend_index,
                  int32_t* host_ids, float* host_weights, int32_t* backend_ids, float* backend_weights,
                  cudaStream_t stream);

// counts[e] += picks of expert e in ids [rows x top_k] (ids < 0 skipped), over the rows whose
// sequence's first block is not `scratch_block` (a graph step's padding rows): the routing
// statistics behind the experts a GPU holds while serving. One thread per pick, atomics.
void CountPicks(const int32_t* ids, int rows, int top_k, const int32_t* row_seq, const int32_t* block_table,
                int max_blocks, int scratch_block, int num_experts, int32_t* counts, cudaStream_t stream);

}  // namespace moe::runtime::cuda
