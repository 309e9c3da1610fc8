#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>

#include "cuda/cuda_status.h"
#include "cuda/rms_norm.h"

namespace moe::runtime::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: each thread sums squares over a strided slice, warps reduce with shuffles,
// then the scaled row is written. Bound by HBM bandwidth (one read, one write per element).
__global__ void RmsNormKernel(const float* __restrict__ x, const __nv_bfloat16* __restrict__ w, int64_t cols,
                              float eps, float* __restrict__ out) {
  const float* row = x + blockIdx.x * cols;
  float* dst = out + blockIdx.x * cols;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) ss += row[i] * row[i];
  for (int offset = 16; offset > 0; offset >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, offset);
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float inv_rms;
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int i = 0; i < kThreads / 32; ++i) total += warp_sums[i];
    inv_rms = rsqrtf(total / static_cast<float>(cols) + eps);
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = __bfloat162float(w[i]) * (row[i] * inv_rms);
}

struct DeviceFree {
  void operator()(void* p) const noexcept { cudaFree(p); }
};
struct StreamDestroy {
  void operator()(cudaStream_t s) const noexcept { cudaStreamDestroy(s); }
};

template <typename T>
absl::Status DeviceAlloc(size_t count, std::unique_ptr<T, DeviceFree>* out) {
  void* p = nullptr;
  MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, count * sizeof(T)));
  out->reset(static_cast<T*>(p));
  return absl::OkStatus();
}

}  // namespace

absl::Status RmsNormOnDevice(const float* host_x, const uint16_t* host_w_bf16, int64_t rows, int64_t cols, float eps,
                             float* host_out) {
  cudaStream_t raw_stream;
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking));
  std::unique_ptr<CUstream_st, StreamDestroy> stream(raw_stream);
  std::unique_ptr<float, DeviceFree> x, out;
  std::unique_ptr<__nv_bfloat16, DeviceFree> w;
  for (absl::Status s : {DeviceAlloc(rows * cols, &x), DeviceAlloc(rows * cols, &out), DeviceAlloc(cols, &w)}) {
    if (!s.ok()) return s;
  }
  MOE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(x.get(), host_x, rows * cols * sizeof(float), cudaMemcpyHostToDevice, stream.get()));
  MOE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(w.get(), host_w_bf16, cols * sizeof(uint16_t), cudaMemcpyHostToDevice, stream.get()));
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream.get()>>>(x.get(), w.get(), cols, eps, out.get());
  MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  MOE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_out, out.get(), rows * cols * sizeof(float), cudaMemcpyDeviceToHost, stream.get()));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream.get()));
  return absl::OkStatus();
}

}  // namespace moe::runtime::cuda
