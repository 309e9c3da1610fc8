#include "cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace moe::runtime::cuda {

absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  (void)cudaGetLastError();  // clear the sticky-free error state
  const std::string message =
      absl::StrCat(call, " failed at ", file, ":", line, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

int VisibleDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace moe::runtime::cuda
