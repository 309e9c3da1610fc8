// CUDA and NCCL errors become an absl::Status here, with the call, file and line (as
// runtime/src/cuda/cuda_status.h does for the runtime; comm sits below the runtime). A CUDA error
// is cleared so that the next call starts clean. Nothing here aborts.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"

#if MOE_COMM_HAS_NCCL
#include <nccl.h>
#endif

namespace moe::comm::internal {

absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line);

// Number of GPUs this process can use; 0 when there is no GPU or no driver.
int VisibleGpuCount();

#if MOE_COMM_HAS_NCCL
// ncclInProgress is not an error and never gets here. `comm` (may be null) adds NCCL's own last
// message. ncclRemoteError and ncclSystemError (a lost peer, the network) are kUnavailable;
// ncclInvalidArgument and ncclInvalidUsage kInvalidArgument; the rest kInternal.
absl::Status NcclStatus(ncclResult_t result, ncclComm_t comm, const char* call, const char* file, int line);
#endif

}  // namespace moe::comm::internal

#define MOE_COMM_CUDA_RETURN_IF_ERROR(call)                                               \
  do {                                                                                    \
    cudaError_t moe_cuda_err_ = (call);                                                   \
    if (moe_cuda_err_ != cudaSuccess) {                                                   \
      return ::moe::comm::internal::CudaStatus(moe_cuda_err_, #call, __FILE__, __LINE__); \
    }                                                                                     \
  } while (0)
