// The kernels behind Linear (linear.h) that are ours rather than cuBLASLt's. Private to linear.cc
// and its tests; the same pointer contract as Linear::Run, checked there, not here.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace moe::runtime::cuda::internal {

// out [m x n] = x [m x k] . w^T (+ bias) for 1 <= m <= 8, bf16 x and w, fp32 accumulation, out
// bf16 or fp32. n and k are multiples of 8; x and w are 16-byte aligned. `sm_count` sizes the
// split of k across the warps of a block, so that small n still fills the device.
void LaunchGemv(const uint16_t* x, int m, const uint16_t* w, int n, int k, const float* bias, void* out, bool out_f32,
                int sm_count, cudaStream_t stream);

// out [m x n] bf16 = bf16(float(out) + bias) with bias fp32 [n]; n a multiple of 8, out and bias
// 16-byte aligned.
void LaunchAddBiasBf16(uint16_t* out, int m, int n, const float* bias, cudaStream_t stream);

}  // namespace moe::runtime::cuda::internal
