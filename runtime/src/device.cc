#include "moe/runtime/device.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moe/runtime/backend_cpu.h"
#if MOE_HAVE_CUDA
#include "moe/runtime/backend_cuda.h"
#endif

namespace moe::runtime {

std::string Device::ToString() const {
  switch (kind) {
    case Kind::kAuto: return "auto";
    case Kind::kCpu: return "cpu";
    case Kind::kCuda: return absl::StrCat("cuda:", index);
  }
  return "?";
}

absl::StatusOr<Device> ParseDevice(std::string_view view) {
  const std::string text(view);
  Device d;
  if (text == "auto") return d;
  if (text == "cpu") {
    d.kind = Device::Kind::kCpu;
    return d;
  }
  if (text == "cuda" || text.rfind("cuda:", 0) == 0) {
    d.kind = Device::Kind::kCuda;
    if (text.size() > 5 && (!absl::SimpleAtoi(text.substr(5), &d.index) || d.index < 0)) {
      return absl::InvalidArgumentError(absl::StrCat("--device ", text, ": the GPU index must be a number >= 0"));
    }
    if (text == "cuda:") return absl::InvalidArgumentError("--device cuda: needs a GPU index (cuda:0)");
    return d;
  }
  return absl::InvalidArgumentError(absl::StrCat("--device ", text, ": expected auto, cpu, cuda or cuda:N"));
}

#if MOE_HAVE_CUDA
int CudaDeviceCount() { return CudaBackendDeviceCount(); }
absl::StatusOr<std::pair<int64_t, int64_t>> CudaMemoryInfo(int index) { return CudaBackendMemoryInfo(index); }
std::string CudaDeviceName(int index) { return CudaBackendDeviceName(index); }
#else
int CudaDeviceCount() { return 0; }
absl::StatusOr<std::pair<int64_t, int64_t>> CudaMemoryInfo(int) {
  return absl::UnavailableError("this build of moeserve has no CUDA backend");
}
std::string CudaDeviceName(int index) { return absl::StrCat("GPU ", index); }
#endif

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const Device& device, int cpu_threads,
                                                       const WeightPolicy& cpu_weights) {
  switch (device.kind) {
    case Device::Kind::kCpu:
      return CreateCpuBackend(cpu_threads, cpu_weights);
    case Device::Kind::kAuto: return absl::InvalidArgumentError("CreateBackend needs a concrete device, not auto");
    case Device::Kind::kCuda: break;
  }
#if MOE_HAVE_CUDA
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device ", device.ToString(), ": no GPU is visible (no NVIDIA driver, or "
                     "CUDA_VISIBLE_DEVICES hides them); use --device cpu"));
  }
  if (device.index >= count) {
    return absl::FailedPreconditionError(absl::StrCat("--device ", device.ToString(), ": there is no GPU ",
                                                      device.index, "; this machine has ", count,
                                                      count == 1 ? " GPU (cuda:0)" : absl::StrCat(" GPUs (cuda:0 to cuda:", count - 1, ")")));
  }
  return CreateCudaBackend(device.index);
#else
  return absl::FailedPreconditionError(absl::StrCat("--device ", device.ToString(),
                                                    ": this build of moeserve has no CUDA backend (it was built "
                                                    "without a CUDA compiler); use --device cpu"));
#endif
}

}  // namespace moe::runtime
