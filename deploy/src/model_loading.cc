#include "model_loading.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"
#include "moe/runtime/memory_plan.h"
#include "moe/runtime/weight_source.h"

namespace moe::deploy {
void DeviceFlags::Add(CLI::App* app) {
  app->add_option("--device", device,
                  "where the model runs: auto (the GPU when one is visible and the model fits in its memory, else "
                  "the CPU), cpu, cuda (GPU 0) or cuda:N")
      ->capture_default_str();
  app->add_flag("--eager", eager, "on a GPU, run every step op by op instead of replaying CUDA graphs (debugging)");
}

absl::StatusOr<int64_t> GpuWeightBytes(const std::string& model_dir) {
  MOE_ASSIGN_OR_RETURN(auto source, runtime::OpenSafetensors(model_dir));
  int64_t bytes = 0;
  for (const std::string& name : source->Names()) {
    MOE_ASSIGN_OR_RETURN(core::TensorView view, source->Get(name));
    bytes += view.numel() * (name.find("norm") != std::string::npos || view.shape.size() == 1 ? 4 : 2);
  }
  return bytes;
}

absl::Status CheckModelFlags(const DeviceFlags& device_flags, const ExpertFlags& experts, const std::string& command) {
  auto device = runtime::ParseDevice(device_flags.device);
  if (!device.ok()) return device.status();
  runtime::ModelOptions options;
  MOE_RETURN_IF_ERROR(experts.Apply(&options, command));
  if (device->kind == runtime::Device::Kind::kCuda && experts.mode == "pool") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--experts pool with --device ", device->ToString(),
        ": routed experts in the CPU pool beside a GPU (hybrid execution) is not supported yet; use --experts "
        "auto (on the GPU) or --device cpu"));
  }
  if (device->kind == runtime::Device::Kind::kCpu && experts.mode == "gpu") {
    return absl::InvalidArgumentError("--experts gpu needs a GPU: --device cuda or auto");
  }
  return absl::OkStatus();
}

absl::StatusOr<runtime::Device> ResolveDevice(const DeviceFlags& flags, const std::string& model_dir,
                                              int64_t extra_bytes, std::string* why) {
  auto device = runtime::ParseDevice(flags.device);
  if (!device.ok()) return device.status();
  if (device->kind == runtime::Device::Kind::kCpu) {
    *why = "asked for";
    return device;
  }
  const int gpus = runtime::CudaDeviceCount();
  if (device->kind == runtime::Device::Kind::kCuda) {
    *why = "asked for";
    return device;  // CreateBackend says what is wrong with an absent GPU
  }
  if (gpus == 0) {
    *why = "no GPU is visible";
    return runtime::Device{runtime::Device::Kind::kCpu, 0};
  }
  if (flags.experts_pool) {
    *why = "--experts pool runs the routed experts on the CPU";
    return runtime::Device{runtime::Device::Kind::kCpu, 0};
  }
  MOE_ASSIGN_OR_RETURN(const int64_t weights, GpuWeightBytes(model_dir));
  MOE_ASSIGN_OR_RETURN(const auto memory, runtime::CudaMemoryInfo(0));
  const int64_t need = weights + extra_bytes + runtime::kGpuHeadroomBytes;
  if (need > memory.first) {
    *why = absl::StrCat("the model needs ", runtime::FormatGiB(need), " on a GPU (", runtime::FormatGiB(weights),
                        " of weights) and cuda:0 has ", runtime::FormatGiB(memory.first), " free");
    return runtime::Device{runtime::Device::Kind::kCpu, 0};
  }
  *why = absl::StrCat("the model's ", runtime::FormatGiB(weights), " of weights fit in ",
                      runtime::FormatGiB(memory.first), " free on ", runtime::CudaDeviceName(0));
  return runtime::Device{runtime::Device::Kind::kCuda, 0};
}

absl::StatusOr<std::unique_ptr<runtime::Model>> LoadModelForCommand(const std::string& model_dir,
                                                                    const DeviceFlags& device_flags,
                                                                    const ExpertFlags& experts,
                                                                    runtime::ModelOptions options, int64_t extra_bytes,
                                                                    const std::string& command) {
  MOE_RETURN_IF_ERROR(experts.Apply(&options, command));
  DeviceFlags resolved = device_flags;
  resolved.experts_pool = experts.mode == "pool";
  std::string why;
  auto device = ResolveDevice(resolved, model_dir, extra_bytes, &why);
  if (!device.ok()) return device.status();
  const bool gpu = device->kind == runtime::Device::Kind::kCuda;
  if (gpu) options.experts = runtime::RoutedExpertsMode::kBackend;
  options.graphs = !device_flags.eager;
  options.progress = gpu;
  auto backend = runtime::CreateBackend(*device, options.threads);
  if (!backend.ok()) return backend.status();
  std::cerr << "moeserve " << command << ": device " << (*backend)->name() << ": " << why << "\n";
  return runtime::Model::Load(model_dir, options, std::shared_ptr<runtime::Backend>(std::move(*backend)));
}

}  // namespace moe::deploy
