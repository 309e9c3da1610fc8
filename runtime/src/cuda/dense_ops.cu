// The dense element-wise and per-row kernels of ops.h. All are bound by HBM bandwidth: each
// takes 16-byte loads and stores where the row length and the pointers allow it, and a scalar
// path otherwise (odd widths only occur in tests and tiny models).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/ops.h"

namespace moe::runtime::cuda {
namespace {

constexpr int kThreads = 256;
// Element-wise kernels loop over their work, so a grid this large already fills any GPU.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

unsigned BlocksFor(int64_t work) {
  return static_cast<unsigned>(std::min<int64_t>((work + kThreads - 1) / kThreads, kMaxBlocks));
}

bool Aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// The two bf16 of a 32-bit word as floats (bf16 is the top half of an fp32); the lower address
// holds the low half.
__device__ __forceinline__ float LowBf16(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float HighBf16(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ __forceinline__ float Silu(float g) { return g / (1.0f + expf(-g)); }
__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

#define MOE_GRID_STRIDE_LOOP(i, n)                                                       \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---- Embed ----

// Chunks of 8 bf16 (16 bytes) become 2 float4; chunks_per_row = hidden / 8.
__global__ void EmbedVecKernel(const uint4* __restrict__ table, const int32_t* __restrict__ ids, int64_t chunks_per_row,
                               int64_t total, float4* __restrict__ x) {
  MOE_GRID_STRIDE_LOOP(i, total) {
    const int64_t t = i / chunks_per_row;
    const int64_t c = i - t * chunks_per_row;
    const uint4 v = table[static_cast<int64_t>(ids[t]) * chunks_per_row + c];
    x[2 * i] = make_float4(LowBf16(v.x), HighBf16(v.x), LowBf16(v.y), HighBf16(v.y));
    x[2 * i + 1] = make_float4(LowBf16(v.z), HighBf16(v.z), LowBf16(v.w), HighBf16(v.w));
  }
}

__global__ void EmbedScalarKernel(const __nv_bfloat16* __restrict__ table, const int32_t* __restrict__ ids,
                                  int64_t hidden, int64_t total, float* __restrict__ x) {
  MOE_GRID_STRIDE_LOOP(i, total) {
    const int64_t t = i / hidden;
    x[i] = __bfloat162float(table[static_cast<int64_t>(ids[t]) * hidden + (i - t * hidden)]);
  }
}

// ---- AddRmsNorm ----

// Each thread keeps up to this many float4 of its row in registers between the sum of squares
// and the scaled write, so x is read once.
constexpr int kNormVecsPerThread = 8;
constexpr int kNormMaxVecCols = 8 * 32 * kNormVecsPerThread * 4;  // 8 warps per row: 8192

// kWarpsPerRow warps per row, 8 / kWarpsPerRow rows per block of 256 threads: small rows take a
// warp each (no shared memory, no block barrier in the reduction), long rows up to 8 warps.
template <int kWarpsPerRow>
__global__ void __launch_bounds__(kThreads)
    AddRmsNormVecKernel(float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w, float eps,
                        int rows, int cols, __nv_bfloat16* __restrict__ out) {
  constexpr int kRowThreads = kWarpsPerRow * 32;
  constexpr int kRowsPerBlock = kThreads / kRowThreads;
  const int local_row = threadIdx.x / kRowThreads;
  const int tid = threadIdx.x % kRowThreads;
  const int row = blockIdx.x * kRowsPerBlock + local_row;
  const bool active = row < rows;
  const int vecs = cols / 4;
  float4* xr = reinterpret_cast<float4*>(x + static_cast<int64_t>(row) * cols);
  const float4* dr =
      delta != nullptr ? reinterpret_cast<const float4*>(delta + static_cast<int64_t>(row) * cols) : nullptr;

  float4 v[kNormVecsPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormVecsPerThread; ++j) {
    const int i = tid + j * kRowThreads;
    if (active && i < vecs) {
      float4 a = xr[i];
      if (dr != nullptr) {
        const float4 d = dr[i];
        a.x += d.x;
        a.y += d.y;
        a.z += d.z;
        a.w += d.w;
        xr[i] = a;
      }
      v[j] = a;
      ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    }
  }
  ss = WarpSum(ss);
  if constexpr (kWarpsPerRow > 1) {
    __shared__ float warp_sums[kThreads / 32];
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) warp_sums[warp] = ss;
    __syncthreads();
    ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kWarpsPerRow; ++i) ss += warp_sums[local_row * kWarpsPerRow + i];
  }
  if (!active) return;
  // As the CPU reference: 1 / sqrt (IEEE, not rsqrtf), then w * (x * inv).
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(cols) + eps);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  uint2* o = reinterpret_cast<uint2*>(out + static_cast<int64_t>(row) * cols);
#pragma unroll
  for (int j = 0; j < kNormVecsPerThread; ++j) {
    const int i = tid + j * kRowThreads;
    if (i < vecs) {
      const float4 g = w4[i];
      o[i] = make_uint2(PackBf16(g.x * (v[j].x * inv), g.y * (v[j].y * inv)),
                        PackBf16(g.z * (v[j].z * inv), g.w * (v[j].w * inv)));
    }
  }
}

// Any width and alignment: one block per row, x read twice (the second time from L1/L2).
__global__ void __launch_bounds__(kThreads)
    AddRmsNormLoopKernel(float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w, float eps,
                         int cols, __nv_bfloat16* __restrict__ out) {
  float* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
  const float* dr = delta != nullptr ? delta + static_cast<int64_t>(blockIdx.x) * cols : nullptr;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < cols; i += kThreads) {
    float a = xr[i];
    if (dr != nullptr) {
      a += dr[i];
      xr[i] = a;  // read back below by this same thread
    }
    ss += a * a;
  }
  ss = WarpSum(ss);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) ss += warp_sums[i];
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(cols) + eps);
  __nv_bfloat16* o = out + static_cast<int64_t>(blockIdx.x) * cols;
  for (int i = threadIdx.x; i < cols; i += kThreads) o[i] = __float2bfloat16_rn(w[i] * (xr[i] * inv));
}

template <int kWarpsPerRow>
void LaunchAddRmsNormVec(float* x, const float* delta, const float* w, float eps, int rows, int cols,
                         __nv_bfloat16* out, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kThreads / (kWarpsPerRow * 32);
  const unsigned blocks = static_cast<unsigned>((static_cast<int64_t>(rows) + kRowsPerBlock - 1) / kRowsPerBlock);
  AddRmsNormVecKernel<kWarpsPerRow><<<blocks, kThreads, 0, stream>>>(x, delta, w, eps, rows, cols, out);
}

// ---- SiluMul ----

// Chunks of 8: chunks_per_row = width / 8; the gate chunk is at 2 * chunks_per_row * r + c, the
// up chunk chunks_per_row after it.
__global__ void SiluMulVecKernel(const uint4* __restrict__ gate_up, int64_t chunks_per_row, int64_t total,
                                 uint4* __restrict__ out) {
  MOE_GRID_STRIDE_LOOP(i, total) {
    const int64_t r = i / chunks_per_row;
    const int64_t c = i - r * chunks_per_row;
    const uint4 g = gate_up[2 * r * chunks_per_row + c];
    const uint4 u = gate_up[(2 * r + 1) * chunks_per_row + c];
    const uint32_t gw[4] = {g.x, g.y, g.z, g.w};
    const uint32_t uw[4] = {u.x, u.y, u.z, u.w};
    uint32_t ow[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      ow[j] = PackBf16(Silu(LowBf16(gw[j])) * LowBf16(uw[j]), Silu(HighBf16(gw[j])) * HighBf16(uw[j]));
    }
    out[i] = make_uint4(ow[0], ow[1], ow[2], ow[3]);
  }
}

__global__ void SiluMulScalarKernel(const __nv_bfloat16* __restrict__ gate_up, int64_t width, int64_t total,
                                    __nv_bfloat16* __restrict__ out) {
  MOE_GRID_STRIDE_LOOP(i, total) {
    const int64_t r = i / width;
    const int64_t c = i - r * width;
    const float g = __bfloat162float(gate_up[2 * r * width + c]);
    const float u = __bfloat162float(gate_up[(2 * r + 1) * width + c]);
    out[i] = __float2bfloat16_rn(Silu(g) * u);
  }
}

// ---- AddSharedExpert ----

__global__ void AddSharedExpertVecKernel(float4* __restrict__ out, const float4* __restrict__ shared,
                                         const float* __restrict__ gate, int64_t vecs_per_row, int64_t total) {
  MOE_GRID_STRIDE_LOOP(i, total) {
    const float s = gate != nullptr ? Sigmoid(gate[i / vecs_per_row]) : 1.0f;
    const float4 v = shared[i];
    float4 o = out[i];
    o.x += v.x * s;
    o.y += v.y * s;
    o.z += v.z * s;
    o.w += v.w * s;
    out[i] = o;
  }
}

__global__ void AddSharedExpertScalarKernel(float* __restrict__ out, const float* __restrict__ shared,
                                            const float* __restrict__ gate, int64_t cols, int64_t total) {
  MOE_GRID_STRIDE_LOOP(i, total) {
    const float s = gate != nullptr ? Sigmoid(gate[i / cols]) : 1.0f;
    out[i] += shared[i] * s;
  }
}

// ---- GatherRows ----

__global__ void GatherRowsVecKernel(const float4* __restrict__ src, int64_t vecs_per_row,
                                    const int32_t* __restrict__ rows, int64_t total, float4* __restrict__ out) {
  MOE_GRID_STRIDE_LOOP(i, total) {
    const int64_t r = i / vecs_per_row;
    out[i] = src[static_cast<int64_t>(rows[r]) * vecs_per_row + (i - r * vecs_per_row)];
  }
}

__global__ void GatherRowsScalarKernel(const float* __restrict__ src, int64_t cols, const int32_t* __restrict__ rows,
                                       int64_t total, float* __restrict__ out) {
  MOE_GRID_STRIDE_LOOP(i, total) {
    const int64_t r = i / cols;
    out[i] = src[static_cast<int64_t>(rows[r]) * cols + (i - r * cols)];
  }
}

}  // namespace

void Embed(const uint16_t* table, const int32_t* token_ids, int num_tokens, int hidden, float* x, cudaStream_t stream) {
  if (num_tokens <= 0 || hidden <= 0) return;
  if (hidden % 8 == 0 && Aligned(table, 16) && Aligned(x, 16)) {
    const int64_t chunks_per_row = hidden / 8;
    const int64_t total = chunks_per_row * num_tokens;
    EmbedVecKernel<<<BlocksFor(total), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(table), token_ids,
                                                              chunks_per_row, total, reinterpret_cast<float4*>(x));
    return;
  }
  const int64_t total = static_cast<int64_t>(hidden) * num_tokens;
  EmbedScalarKernel<<<BlocksFor(total), kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(table), token_ids,
                                                               hidden, total, x);
}

void AddRmsNorm(float* x, const float* delta, const float* w, float eps, int rows, int cols, uint16_t* out,
                cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(out);
  const bool vec = cols % 4 == 0 && cols <= kNormMaxVecCols && Aligned(x, 16) && Aligned(delta, 16) && Aligned(w, 16) &&
                   Aligned(out, 8);
  if (!vec) {
    AddRmsNormLoopKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, delta, w, eps, cols, o);
    return;
  }
  // The fewest warps per row whose registers hold the row.
  constexpr int kColsPerWarp = 32 * kNormVecsPerThread * 4;
  if (cols <= kColsPerWarp) return LaunchAddRmsNormVec<1>(x, delta, w, eps, rows, cols, o, stream);
  if (cols <= 2 * kColsPerWarp) return LaunchAddRmsNormVec<2>(x, delta, w, eps, rows, cols, o, stream);
  if (cols <= 4 * kColsPerWarp) return LaunchAddRmsNormVec<4>(x, delta, w, eps, rows, cols, o, stream);
  LaunchAddRmsNormVec<8>(x, delta, w, eps, rows, cols, o, stream);
}

void SiluMul(const uint16_t* gate_up, int rows, int width, uint16_t* out, cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return;
  if (width % 8 == 0 && Aligned(gate_up, 16) && Aligned(out, 16)) {
    const int64_t chunks_per_row = width / 8;
    const int64_t total = chunks_per_row * rows;
    SiluMulVecKernel<<<BlocksFor(total), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(gate_up), chunks_per_row,
                                                                total, reinterpret_cast<uint4*>(out));
    return;
  }
  const int64_t total = static_cast<int64_t>(width) * rows;
  SiluMulScalarKernel<<<BlocksFor(total), kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(gate_up), width,
                                                                 total, reinterpret_cast<__nv_bfloat16*>(out));
}

void AddSharedExpert(float* out, const float* shared, const float* gate, int rows, int cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  if (cols % 4 == 0 && Aligned(out, 16) && Aligned(shared, 16)) {
    const int64_t vecs_per_row = cols / 4;
    const int64_t total = vecs_per_row * rows;
    AddSharedExpertVecKernel<<<BlocksFor(total), kThreads, 0, stream>>>(
        reinterpret_cast<float4*>(out), reinterpret_cast<const float4*>(shared), gate, vecs_per_row, total);
    return;
  }
  const int64_t total = static_cast<int64_t>(cols) * rows;
  AddSharedExpertScalarKernel<<<BlocksFor(total), kThreads, 0, stream>>>(out, shared, gate, cols, total);
}

void GatherRows(const float* src, int cols, const int32_t* rows, int n, float* out, cudaStream_t stream) {
  if (n <= 0 || cols <= 0) return;
  if (cols % 4 == 0 && Aligned(src, 16) && Aligned(out, 16)) {
    const int64_t vecs_per_row = cols / 4;
    const int64_t total = vecs_per_row * n;
    GatherRowsVecKernel<<<BlocksFor(total), kThreads, 0, stream>>>(reinterpret_cast<const float4*>(src), vecs_per_row,
                                                                   rows, total, reinterpret_cast<float4*>(out));
    return;
  }
  const int64_t total = static_cast<int64_t>(cols) * n;
  GatherRowsScalarKernel<<<BlocksFor(total), kThreads, 0, stream>>>(src, cols, rows, total, out);
}

}  // namespace moe::runtime::cuda
