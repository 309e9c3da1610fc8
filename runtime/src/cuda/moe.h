// The routed-expert kernels of moe.cu behind one more entry point than ops.h gives: the caller
// may force the decode or the grouped-GEMM path, so that tests run both on the same inputs and
// benchmarks can find where one overtakes the other. The serving path calls MoeExperts.
#pragma once

#include <cstdint>

#include "cuda/ops.h"

namespace moe::runtime::cuda {

enum class MoePath {
  kAuto,     // what MoeExperts does: MoeAutoPath(num_tokens, top_k)
  kDecode,   // tensor-core GEMV: each selected expert's weights streamed once, 8 tokens at a time
  kGrouped,  // grouped GEMM over 64-row tiles of each expert's tokens (prefill)
};

// The path MoeExperts takes for a call of num_tokens * top_k (token, slot) pairs.
MoePath MoeAutoPath(int num_tokens, int top_k);

// MoeExperts with the path chosen by the caller; the same contract as MoeExperts (ops.h).
void MoeExpertsOnPath(MoePath path, const uint16_t* x, int num_tokens, const int32_t* ids, const float* weights,
                      int top_k, const ExpertWeights& w, void* workspace, float* out, cudaStream_t stream);

}  // namespace moe::runtime::cuda
