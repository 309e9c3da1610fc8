// Where a model runs: `--device auto|cpu|cuda[:N]`, and the backend for it.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "moe/experts/packed.h"
#include "moe/runtime/backend.h"

namespace moe::runtime {

struct Device {
  enum class Kind { kAuto, kCpu, kCuda };
  Kind kind = Kind::kAuto;
  int index = 0;  // the GPU, for kCuda
  std::string ToString() const;
};

// "auto", "cpu", "cuda" (GPU 0) or "cuda:N"; kInvalidArgument otherwise.
absl::StatusOr<Device> ParseDevice(std::string_view text);

// GPUs this process can use: 0 without a GPU, a driver or a CUDA build.
int CudaDeviceCount();
// Free and total bytes of GPU `index`; kUnavailable without one.
absl::StatusOr<std::pair<int64_t, int64_t>> CudaMemoryInfo(int index);
// "NVIDIA H200 (GPU 0, 139.7 GiB)"
std::string CudaDeviceName(int index);

// The backend for a concrete device (not kAuto). kFailedPrecondition for cuda:N when GPU N is
// not there (the message says how many are), or in a build without CUDA.
// `cpu_weights`: the CPU backend's weight policy (a GPU keeps bf16 matrices and fp32 vectors).
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const Device& device, int cpu_threads = 0,
                                                       const WeightPolicy& cpu_weights = {});

}  // namespace moe::runtime
