#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/gather.h"

namespace moe::runtime::cuda {
namespace {

// One block per output row, 16-byte words where the row allows, else bytes.
__global__ void GatherRowsKernel(const char* __restrict__ src, int64_t row_bytes, const int32_t* __restrict__ rows,
                                 char* __restrict__ dst) {
  const char* from = src + static_cast<int64_t>(rows[blockIdx.x]) * row_bytes;
  char* to = dst + static_cast<int64_t>(blockIdx.x) * row_bytes;
  if (row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const int64_t words = row_bytes / 16;
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
      reinterpret_cast<int4*>(to)[i] = reinterpret_cast<const int4*>(from)[i];
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) to[i] = from[i];
}

// Non-finite values: each row's first bad index, or -1.
__global__ void FirstNonFiniteKernel(const float* __restrict__ x, int64_t cols, int32_t* __restrict__ first) {
  const float* row = x + blockIdx.x * cols;
  __shared__ int found;
  if (threadIdx.x == 0) found = 0x7fffffff;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    if (!isfinite(row[i])) atomicMin(&found, static_cast<int>(i));
  }
  __syncthreads();
  if (threadIdx.x == 0) first[blockIdx.x] = found == 0x7fffffff ? -1 : found;
}

__global__ void F32ToBf16Kernel(const float* __restrict__ src, int64_t n, __nv_bfloat16* __restrict__ dst) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

__global__ void NarrowColumnsKernel(const float* __restrict__ src, int rows, int src_cols, int cols,
                                    const float* __restrict__ bias, void* __restrict__ dst, bool dst_f32) {
  const int64_t n = int64_t{rows} * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols;
    const int c = static_cast<int>(i % cols);
    const float v = src[r * src_cols + c] + (bias != nullptr ? bias[c] : 0.0f);
    if (dst_f32) {
      static_cast<float*>(dst)[i] = v;
    } else {
      static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(v);
    }
  }
}

// One block per row: the row's hidden state widened to fp32 (pairs of bf16 to float2 where the
// width is even), then its top-k ids and weights.
__global__ void PackHostExpertInputsKernel(const __nv_bfloat16* __restrict__ x, int hidden,
                                           const int32_t* __restrict__ ids, const float* __restrict__ weights,
                                           int top_k, float* __restrict__ host_x, int32_t* __restrict__ host_ids,
                                           float* __restrict__ host_weights) {
  const int64_t r = blockIdx.x;
  const __nv_bfloat16* row = x + r * hidden;
  float* to = host_x + r * hidden;
  if (hidden % 2 == 0) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(row);
    for (int i = threadIdx.x; i < hidden / 2; i += blockDim.x) {
      reinterpret_cast<float2*>(to)[i] = __bfloat1622float2(pairs[i]);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) to[i] = __bfloat162float(row[i]);
  }
  for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
    host_ids[r * top_k + j] = ids[r * top_k + j];
    host_weights[r * top_k + j] = weights[r * top_k + j];
  }
  __threadfence_system();  // before a request the host polls for is posted
}

__global__ void PostHostRequestKernel(uint32_t* counter, HostMailbox* mailbox, int layer, long long rows) {
  const uint32_t seq = *counter + 1;
  *counter = seq;
  volatile HostMailbox* m = mailbox;
  m->layer = layer;
  m->rows = rows;
  __threadfence_system();
  m->request = seq;
  __threadfence_system();
}

__global__ void WaitHostDoneKernel(const uint32_t* counter, const HostMailbox* mailbox) {
  const uint32_t seq = *counter;
  const volatile uint32_t* done = &mailbox->done;
  while (*done != seq) __nanosleep(200);
  __threadfence_system();
}

__global__ void HoldKernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

void HoldStream(int64_t ns, cudaStream_t stream) {
  if (ns > 0) HoldKernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(ns));
}

void NarrowColumns(const float* src, int rows, int src_cols, int cols, const float* bias, void* dst, bool dst_f32,
                   cudaStream_t stream) {
  const int64_t n = int64_t{rows} * cols;
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  NarrowColumnsKernel<<<blocks, 256, 0, stream>>>(src, rows, src_cols, cols, bias, dst, dst_f32);
}

void F32ToBf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream) {
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  F32ToBf16Kernel<<<blocks, 256, 0, stream>>>(src, n, reinterpret_cast<__nv_bfloat16*>(dst));
}

void GatherRowsBytes(const void* src, int64_t row_bytes, const int32_t* rows, int n, void* dst, cudaStream_t stream) {
  if (n == 0) return;
  GatherRowsKernel<<<n, 128, 0, stream>>>(static_cast<const char*>(src), row_bytes, rows, static_cast<char*>(dst));
}

void PackHostExpertInputs(const uint16_t* x, int rows, int hidden, const int32_t* ids, const float* weights, int top_k,
                          float* host_x, int32_t* host_ids, float* host_weights, cudaStream_t stream) {
  if (rows == 0) return;
  PackHostExpertInputsKernel<<<rows, 256, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(x), hidden, ids, weights,
                                                       top_k, host_x, host_ids, host_weights);
}

void PostHostRequest(uint32_t* counter, HostMailbox* mailbox, int layer, int64_t rows, cudaStream_t stream) {
  PostHostRequestKernel<<<1, 1, 0, stream>>>(counter, mailbox, layer, static_cast<long long>(rows));
}

void WaitHostDone(const uint32_t* counter, const HostMailbox* mailbox, cudaStream_t stream) {
  WaitHostDoneKernel<<<1, 1, 0, stream>>>(counter, mailbox);
}

void FirstNonFinite(const float* x, int rows, int64_t cols, int32_t* first, cudaStream_t stream) {
  if (rows == 0) return;
  FirstNonFiniteKernel<<<rows, 256, 0, stream>>>(x, cols, first);
}

}  // namespace moe::runtime::cuda
