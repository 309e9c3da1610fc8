#include "cuda/linear_kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace moe::runtime::cuda::internal {
namespace {

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;

// A weight chunk (8 bf16, 16 bytes) is read once per call: the non-coherent path without an L1
// allocation keeps L1 for the activations, which every warp of the block reads again.
__device__ __forceinline__ uint4 LoadStreamed(const uint16_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// The two bf16 of a 32-bit word as floats (bf16 is the top half of an fp32).
__device__ __forceinline__ float LowBf16(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float HighBf16(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// acc[t][r] += dot(x chunk of token t, w chunk of row r) over one chunk of 8 elements.
template <int M, int R>
__device__ __forceinline__ void FmaChunk(const uint4 (&wv)[R], const uint4 (&xv)[M], float (&acc)[M][R]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float w_lo[R], w_hi[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t word = Word(wv[r], i);
      w_lo[r] = LowBf16(word);
      w_hi[r] = HighBf16(word);
    }
#pragma unroll
    for (int t = 0; t < M; ++t) {
      const uint32_t word = Word(xv[t], i);
      const float x_lo = LowBf16(word), x_hi = HighBf16(word);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[t][r] = fmaf(w_lo[r], x_lo, acc[t][r]);
        acc[t][r] = fmaf(w_hi[r], x_hi, acc[t][r]);
      }
    }
  }
}

// out [M x n] = x [M x k] . w^T (+ bias). A block of 8 warps covers (8 / k_split) groups of R
// weight rows; the k_split warps of a group take interleaved 8-element chunks of k, each lane
// streaming one 16-byte chunk of each of its R rows and reusing every activation chunk for all R
// rows. Bound by HBM bandwidth: each weight byte is read once, the activations come from L1/L2.
template <int M, int R>
__global__ void __launch_bounds__(kGemvThreads)
    GemvKernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w, int n, int k, int k_split,
               const float* __restrict__ bias, void* __restrict__ out, bool out_f32) {
  constexpr int kUnroll = (M + R) <= 4 ? 4 : ((M + R) <= 8 ? 2 : 1);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int groups = kGemvWarps / k_split;
  const int group = warp / k_split;
  const int part = warp % k_split;
  const int first_row = (blockIdx.x * groups + group) * R;
  const int chunks = k / 8;
  const int stride = 32 * k_split;

  float acc[M][R];
#pragma unroll
  for (int t = 0; t < M; ++t) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.0f;
  }
  // R divides 8 and n is a multiple of 8, so a group's rows are all in range or all out.
  if (first_row < n) {
    const uint16_t* w_rows = w + static_cast<int64_t>(first_row) * k;
    int c = part * 32 + lane;
    for (; c + (kUnroll - 1) * stride < chunks; c += kUnroll * stride) {
      uint4 wv[kUnroll][R];
      uint4 xv[kUnroll][M];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t offset = static_cast<int64_t>(c + u * stride) * 8;
#pragma unroll
        for (int r = 0; r < R; ++r) wv[u][r] = LoadStreamed(w_rows + static_cast<int64_t>(r) * k + offset);
#pragma unroll
        for (int t = 0; t < M; ++t) {
          xv[u][t] = __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * k + offset));
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) FmaChunk<M, R>(wv[u], xv[u], acc);
    }
    for (; c < chunks; c += stride) {
      const int64_t offset = static_cast<int64_t>(c) * 8;
      uint4 wv[R];
      uint4 xv[M];
#pragma unroll
      for (int r = 0; r < R; ++r) wv[r] = LoadStreamed(w_rows + static_cast<int64_t>(r) * k + offset);
#pragma unroll
      for (int t = 0; t < M; ++t)
        xv[t] = __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * k + offset));
      FmaChunk<M, R>(wv, xv, acc);
    }
  }

  // Sum each warp's lanes, then the k_split warps of each group through shared memory.
  __shared__ float partial[kGemvWarps][M * R];
#pragma unroll
  for (int t = 0; t < M; ++t) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[t][r];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
      if (lane == 0) partial[warp][t * R + r] = v;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < groups * M * R; i += kGemvThreads) {
    const int g = i / (M * R);
    const int slot = i % (M * R);
    const int t = slot / R;
    const int row = (blockIdx.x * groups + g) * R + slot % R;
    if (row >= n) continue;
    float sum = 0.0f;
    for (int p = 0; p < k_split; ++p) sum += partial[g * k_split + p][slot];
    if (bias != nullptr) sum += bias[row];
    const int64_t at = static_cast<int64_t>(t) * n + row;
    if (out_f32) {
      static_cast<float*>(out)[at] = sum;
    } else {
      static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16_rn(sum);
    }
  }
}

template <int M, int R>
void LaunchGemvFor(const uint16_t* x, const uint16_t* w, int n, int k, const float* bias, void* out, bool out_f32,
                   int sm_count, cudaStream_t stream) {
  // Split k over more warps of a group until there are about two blocks per SM, as long as each
  // lane keeps at least two chunks of each row to stream.
  const int chunks = k / 8;
  auto blocks_for = [&](int split) { return (n + R * (kGemvWarps / split) - 1) / (R * (kGemvWarps / split)); };
  int k_split = 1;
  while (k_split < kGemvWarps && blocks_for(k_split) < 2 * sm_count && chunks >= 2 * 32 * (2 * k_split)) k_split *= 2;
  GemvKernel<M, R><<<blocks_for(k_split), kGemvThreads, 0, stream>>>(x, w, n, k, k_split, bias, out, out_f32);
}

// out[i] = bf16(float(out[i]) + bias[i % n]) over 8-element chunks.
__global__ void AddBiasBf16Kernel(__nv_bfloat16* __restrict__ out, int64_t total_chunks, int n_chunks,
                                  const float* __restrict__ bias) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int col = static_cast<int>(i % n_chunks) * 8;
    uint4 v = reinterpret_cast<const uint4*>(out)[i];
    const float4 b0 = reinterpret_cast<const float4*>(bias + col)[0];
    const float4 b1 = reinterpret_cast<const float4*>(bias + col)[1];
    const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
    uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float lo = LowBf16(words[j]) + b[2 * j];
      const float hi = HighBf16(words[j]) + b[2 * j + 1];
      const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x (lo) is the lower address
      words[j] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    v = make_uint4(words[0], words[1], words[2], words[3]);
    reinterpret_cast<uint4*>(out)[i] = v;
  }
}

}  // namespace

void LaunchGemv(const uint16_t* x, int m, const uint16_t* w, int n, int k, const float* bias, void* out, bool out_f32,
                int sm_count, cudaStream_t stream) {
  // Rows per warp: enough that the activation reads (from L1) stay below the weight stream.
  switch (m) {
    case 1:
      return LaunchGemvFor<1, 2>(x, w, n, k, bias, out, out_f32, sm_count, stream);
    case 2:
      return LaunchGemvFor<2, 2>(x, w, n, k, bias, out, out_f32, sm_count, stream);
    case 3:
      return LaunchGemvFor<3, 4>(x, w, n, k, bias, out, out_f32, sm_count, stream);
    case 4:
      return LaunchGemvFor<4, 4>(x, w, n, k, bias, out, out_f32, sm_count, stream);
    case 5:
      return LaunchGemvFor<5, 4>(x, w, n, k, bias, out, out_f32, sm_count, stream);
    case 6:
      return LaunchGemvFor<6, 4>(x, w, n, k, bias, out, out_f32, sm_count, stream);
    case 7:
      return LaunchGemvFor<7, 4>(x, w, n, k, bias, out, out_f32, sm_count, stream);
    case 8:
      return LaunchGemvFor<8, 4>(x, w, n, k, bias, out, out_f32, sm_count, stream);
    default:
      return;
  }
}

void LaunchAddBiasBf16(uint16_t* out, int m, int n, const float* bias, cudaStream_t stream) {
  const int n_chunks = n / 8;
  const int64_t total = static_cast<int64_t>(m) * n_chunks;
  if (total == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 16);
  AddBiasBf16Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(reinterpret_cast<__nv_bfloat16*>(out),
                                                                            total, n_chunks, bias);
}

}  // namespace moe::runtime::cuda::internal
