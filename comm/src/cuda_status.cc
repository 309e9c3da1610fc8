#include "cuda_status.h"

#include "absl/strings/str_cat.h"

namespace moe::comm::internal {

absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  (void)cudaGetLastError();  // clear the error that is not sticky
  const std::string message =
      absl::StrCat(call, " failed at ", file, ":", line, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (err == cudaErrorInvalidDevice) return absl::InvalidArgumentError(message);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

int VisibleGpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

#if MOE_COMM_HAS_NCCL
absl::Status NcclStatus(ncclResult_t result, ncclComm_t comm, const char* call, const char* file, int line) {
  if (result == ncclSuccess || result == ncclInProgress) return absl::OkStatus();
  std::string message = absl::StrCat(call, " failed at ", file, ":", line, ": ", ncclGetErrorString(result));
  if (const char* last = ncclGetLastError(comm); last != nullptr && last[0] != '\0') {
    absl::StrAppend(&message, " (NCCL: ", last, ")");
  }
  switch (result) {
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(message);
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}
#endif

}  // namespace moe::comm::internal
