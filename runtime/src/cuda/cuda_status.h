// CUDA errors become an absl::Status in one place, with the call, file and line; the error is
// cleared so the next call starts clean. Nothing here aborts.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"

namespace moe::runtime::cuda {

absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line);

// Number of GPUs this process can use; 0 when there is no GPU or no driver.
int VisibleDeviceCount();

}  // namespace moe::runtime::cuda

#define MOE_CUDA_RETURN_IF_ERROR(call)                                                   \
  do {                                                                                   \
    cudaError_t moe_cuda_err_ = (call);                                                  \
    if (moe_cuda_err_ != cudaSuccess) {                                                  \
      return ::moe::runtime::cuda::CudaStatus(moe_cuda_err_, #call, __FILE__, __LINE__); \
    }                                                                                    \
  } while (0)
