// RouteTopK: the routing of runtime/src/routing.cc on the GPU, one warp per token. The same fp32
// operations in the same order wherever the order decides a rounding (the group sums, the sum
// of the chosen weights, the normalisation and the scaling), and the same total order for the
// choice (larger first, ties to the lower index), so ids agree with the CPU except on near-ties
// that the two exp implementations or the softmax sum order resolve differently.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "cuda/routing.h"

namespace moe::runtime::cuda {
namespace {

constexpr int kWarps = 4;  // tokens per block

struct KernelParams {
  const float* correction_bias;
  int num_experts;
  int top_k;
  int n_group;
  int topk_group;
  float routed_scaling_factor;
  bool sigmoid;
  bool normalize_top_k;
};

// The order of the CPU TopK: larger value first, equal values to the lower index. An empty
// candidate (index < 0) loses to everything. NaN never reaches it (it is ranked as -inf), so
// this is a total order and every lane of a butterfly reduction ends with the same winner.
__device__ __forceinline__ bool Better(float v, int idx, float best_v, int best_idx) {
  return best_idx < 0 || v > best_v || (v == best_v && idx < best_idx);
}

__device__ __forceinline__ float Ranked(float v) { return isnan(v) ? -INFINITY : v; }

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Lane l holds experts l, l + 32, ... in its kSlots slots. Bound by nothing much: a token is a
// few hundred floats; the top-k rounds are k warp reductions.
template <int kSlots>
__global__ void __launch_bounds__(kWarps * 32)
    RouteKernel(const float* __restrict__ logits, int num_tokens, KernelParams p, int32_t* __restrict__ ids,
                float* __restrict__ weights) {
  __shared__ float choice_shared[kWarps][kRouterMaxExperts];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int token = blockIdx.x * kWarps + warp;
  if (token >= num_tokens) return;  // the whole warp; nothing below waits on other warps
  const int e_count = p.num_experts;
  const float* row = logits + static_cast<int64_t>(token) * e_count;

  float choice[kSlots];      // what the top-k ranks
  float weight[kSlots];      // what a chosen expert's weight is made from
  uint32_t out_of_play = 0;  // slot j: beyond the experts, or already chosen
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int e = lane + 32 * j;
    choice[j] = e < e_count ? row[e] : -INFINITY;
    weight[j] = 0.0f;
    if (e >= e_count) out_of_play |= 1u << j;
  }

  if (!p.sigmoid) {
    // Softmax over all experts, then the top-k of the probabilities.
    float max_logit = -INFINITY;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (lane + 32 * j < e_count) max_logit = fmaxf(max_logit, choice[j]);
    }
    max_logit = WarpMax(max_logit);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (lane + 32 * j < e_count) {
        choice[j] = expf(choice[j] - max_logit);
        sum += choice[j];
      }
    }
    sum = WarpSum(sum);
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (lane + 32 * j < e_count) {
        choice[j] = choice[j] / sum;
        weight[j] = choice[j];
      }
    }
  } else {
    // Sigmoid scores; the correction bias shifts the choice only.
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const int e = lane + 32 * j;
      if (e < e_count) {
        const float score = 1.0f / (1.0f + expf(-choice[j]));
        weight[j] = score;
        choice[j] = score + (p.correction_bias != nullptr ? p.correction_bias[e] : 0.0f);
      }
    }
    if (p.n_group > 1) {
      // Groups are contiguous runs of experts, so they go through shared memory to be scanned.
      const int per_group = e_count / p.n_group;
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        const int e = lane + 32 * j;
        if (e < e_count) choice_shared[warp][e] = choice[j];
      }
      __syncwarp();
      // Each group's score: the sum of its two best biased scores (its best alone for groups
      // of one), added as the CPU does: (0 + best) + second.
      float group_score[kRouterMaxGroups];
#pragma unroll
      for (int g = 0; g < kRouterMaxGroups; ++g) {
        group_score[g] = -INFINITY;
        if (g < p.n_group) {
          float first = -INFINITY, second = -INFINITY;
          for (int i = lane; i < per_group; i += 32) {
            const float v = Ranked(choice_shared[warp][g * per_group + i]);
            if (v > first) {
              second = first;
              first = v;
            } else if (v > second) {
              second = v;
            }
          }
#pragma unroll
          for (int offset = 16; offset > 0; offset >>= 1) {
            const float other_first = __shfl_xor_sync(0xffffffffu, first, offset);
            const float other_second = __shfl_xor_sync(0xffffffffu, second, offset);
            second = fmaxf(fminf(first, other_first), fmaxf(second, other_second));
            first = fmaxf(first, other_first);
          }
          group_score[g] = per_group >= 2 ? (0.0f + first) + second : 0.0f + first;
        }
      }
      // The best topk_group groups (ties to the lower group), the same on every lane.
      uint32_t kept = 0;
      for (int r = 0; r < p.topk_group; ++r) {
        float best_v = 0.0f;
        int best_g = -1;
#pragma unroll
        for (int g = 0; g < kRouterMaxGroups; ++g) {
          if (g < p.n_group && !((kept >> g) & 1u) && Better(group_score[g], g, best_v, best_g)) {
            best_v = group_score[g];
            best_g = g;
          }
        }
        kept |= 1u << best_g;
      }
      // Experts of dropped groups score 0 for the choice (transformers' masked_fill(..., 0.0)).
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        const int e = lane + 32 * j;
        if (e < e_count && !((kept >> (e / per_group)) & 1u)) choice[j] = 0.0f;
      }
    }
  }

  // k rounds of a warp-wide best; lane i keeps round i's winner. Every lane adds the chosen
  // weights in round order, the CPU's summation order.
  float chosen_sum = 0.0f;
  int my_id = 0;
  float my_weight = 0.0f;
  for (int i = 0; i < p.top_k; ++i) {
    float best_v = 0.0f, best_w = 0.0f;
    int best_e = -1;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const int e = lane + 32 * j;
      const float v = Ranked(choice[j]);
      if (!((out_of_play >> j) & 1u) && Better(v, e, best_v, best_e)) {
        best_v = v;
        best_e = e;
        best_w = weight[j];
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_v = __shfl_xor_sync(0xffffffffu, best_v, offset);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
      const float other_w = __shfl_xor_sync(0xffffffffu, best_w, offset);
      if (other_e >= 0 && Better(other_v, other_e, best_v, best_e)) {
        best_v = other_v;
        best_e = other_e;
        best_w = other_w;
      }
    }
    if ((best_e & 31) == lane) out_of_play |= 1u << (best_e >> 5);
    chosen_sum += best_w;
    if (lane == i) {
      my_id = best_e;
      my_weight = best_w;
    }
  }
  if (lane < p.top_k) {
    float w = my_weight;
    if (p.normalize_top_k) w /= p.sigmoid ? chosen_sum + 1e-20f : chosen_sum;
    w *= p.routed_scaling_factor;
    ids[static_cast<int64_t>(token) * p.top_k + lane] = my_id;
    weights[static_cast<int64_t>(token) * p.top_k + lane] = w;
  }
}

// For parameters CheckRouterParams refuses: expert 0 with a NaN weight, so that nothing reads
// out of bounds and the result is visibly wrong.
__global__ void PoisonRoutesKernel(int64_t count, int32_t* __restrict__ ids, float* __restrict__ weights) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    ids[i] = 0;
    weights[i] = NAN;
  }
}

template <int kSlots>
void LaunchRoute(const float* logits, int num_tokens, const KernelParams& p, int32_t* ids, float* weights,
                 cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((num_tokens + kWarps - 1) / kWarps);
  RouteKernel<kSlots><<<blocks, kWarps * 32, 0, stream>>>(logits, num_tokens, p, ids, weights);
}

}  // namespace

absl::Status CheckRouterParams(const RouterParams& params) {
  const int e = params.num_experts;
  if (e < 1 || e > kRouterMaxExperts) {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU routing: ", e, " experts, the GPU router supports 1..", kRouterMaxExperts));
  }
  if (params.top_k < 1 || params.top_k > kRouterMaxTopK || params.top_k > e) {
    return absl::FailedPreconditionError(absl::StrCat("GPU routing: top_k=", params.top_k,
                                                      ", the GPU router supports 1..", kRouterMaxTopK,
                                                      " and at most the number of experts (", e, ")"));
  }
  if (!params.sigmoid) return absl::OkStatus();  // softmax routers are not grouped
  if (params.n_group < 1 || params.n_group > kRouterMaxGroups || e % params.n_group != 0) {
    return absl::FailedPreconditionError(absl::StrCat("GPU routing: n_group=", params.n_group,
                                                      ", the GPU router supports 1..", kRouterMaxGroups,
                                                      " groups that divide the ", e, " experts"));
  }
  if (params.n_group > 1 && (params.topk_group < 1 || params.topk_group > params.n_group)) {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU routing: topk_group=", params.topk_group, " must be in 1..n_group (", params.n_group, ")"));
  }
  return absl::OkStatus();
}

void RouteTopK(const float* logits, int num_tokens, const RouterParams& params, int32_t* ids, float* weights,
               cudaStream_t stream) {
  if (num_tokens <= 0) return;
  if (!CheckRouterParams(params).ok()) {
    const int64_t count = static_cast<int64_t>(num_tokens) * (params.top_k > 0 ? params.top_k : 0);
    const int64_t blocks = (count + 255) / 256 < 65536 ? (count + 255) / 256 : 65536;
    if (count > 0) PoisonRoutesKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(count, ids, weights);
    return;
  }
  KernelParams p;
  p.correction_bias = params.sigmoid ? params.correction_bias : nullptr;
  p.num_experts = params.num_experts;
  p.top_k = params.top_k;
  p.n_group = params.sigmoid ? params.n_group : 1;  // the CPU groups sigmoid routers only
  p.topk_group = params.topk_group;
  p.routed_scaling_factor = params.routed_scaling_factor;
  p.sigmoid = params.sigmoid;
  p.normalize_top_k = params.normalize_top_k;
  const int slots = (params.num_experts + 31) / 32;
  if (slots <= 1) return LaunchRoute<1>(logits, num_tokens, p, ids, weights, stream);
  if (slots <= 2) return LaunchRoute<2>(logits, num_tokens, p, ids, weights, stream);
  if (slots <= 4) return LaunchRoute<4>(logits, num_tokens, p, ids, weights, stream);
  if (slots <= 8) return LaunchRoute<8>(logits, num_tokens, p, ids, weights, stream);
  LaunchRoute<16>(logits, num_tokens, p, ids, weights, stream);
}

namespace {

__global__ void SplitRoutingKernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int rows,
                                   int top_k, const int32_t* __restrict__ backend_index, int32_t* __restrict__ host_ids,
                                   float* __restrict__ host_weights, int32_t* __restrict__ backend_ids,
                                   float* __restrict__ backend_weights) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int64_t base = static_cast<int64_t>(r) * top_k;
  for (int j = 0; j < top_k; ++j) {
    const int32_t id = ids[base + j];
    const int32_t local = id >= 0 ? backend_index[id] : -1;
    const bool host = id >= 0 && local < 0;
    host_ids[base + j] = host ? id : -1;  // -1: a skipped slot, as SplitPicks leaves it
    host_weights[base + j] = host ? weights[base + j] : 0.0f;
    backend_ids[base + j] = local >= 0 ? local : -1;
    backend_weights[base + j] = local >= 0 ? weights[base + j] : 0.0f;
  }
}

__global__ void CountPicksKernel(const int32_t* __restrict__ ids, int rows, int top_k,
                                 const int32_t* __restrict__ row_seq, const int32_t* __restrict__ block_table,
                                 int max_blocks, int scratch_block, int num_experts, int32_t* __restrict__ counts) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * top_k) return;
  const int r = i / top_k;
  if (block_table[static_cast<int64_t>(row_seq[r]) * max_blocks] == scratch_block) return;
  const int32_t e = ids[i];
  if (e >= 0 && e < num_experts) atomicAdd(counts + e, 1);
}

}  // namespace

void CountPicks(const int32_t* ids, int rows, int top_k, const int32_t* row_seq, const int32_t* block_table,
                int max_blocks, int scratch_block, int num_experts, int32_t* counts, cudaStream_t stream) {
  if (rows == 0 || top_k == 0) return;
  const int n = rows * top_k;
  CountPicksKernel<<<(n + 255) / 256, 256, 0, stream>>>(ids, rows, top_k, row_seq, block_table, max_blocks,
                                                        scratch_block, num_experts, counts);
}

void SplitRouting(const int32_t* ids, const float* weights, int rows, int top_k, const int32_t* backend_index,
                  int32_t* host_ids, float* host_weights, int32_t* backend_ids, float* backend_weights,
                  cudaStream_t stream) {
  if (rows == 0) return;
  SplitRoutingKernel<<<(rows + 127) / 128, 128, 0, stream>>>(ids, weights, rows, top_k, backend_index, host_ids,
                                                             host_weights, backend_ids, backend_weights);
}

}  // namespace moe::runtime::cuda
