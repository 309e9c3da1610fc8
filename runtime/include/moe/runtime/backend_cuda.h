// The CUDA backend: bf16 activations and weights with fp32 accumulation, fp32 norms, softmax and
// routing, a bf16 paged KV cache, cuBLASLt linears, own kernels for the rest (runtime/src/cuda/),
// decode steps replayed as CUDA graphs. Everything is queued on one stream of one GPU.
// Only in builds with CUDA (MOE_HAVE_CUDA); reach it through device.h.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "moe/runtime/backend.h"

namespace moe::runtime {

// kFailedPrecondition when GPU `device` is not there; kInternal when its context cannot start.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

int CudaBackendDeviceCount();
absl::StatusOr<std::pair<int64_t, int64_t>> CudaBackendMemoryInfo(int device);
std::string CudaBackendDeviceName(int device);

}  // namespace moe::runtime
