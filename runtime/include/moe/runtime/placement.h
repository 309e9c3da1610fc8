// Where each tensor of a checkpoint lives when a GPU runs the model beside the CPU (hybrid
// execution), decided from its name by the rules users know from llama.cpp:
//   --override-tensor REGEX=cpu|cuda[:N]  (repeatable; the first rule whose regex is found in the
//                                          name wins, before any other rule)
//   --cpu-moe                              every routed expert on the CPU
//   --n-cpu-moe N                          the routed experts of the first N MoE layers on the CPU
// Everything else goes to the GPU. Shared experts, the router, norms, attention and the LM head
// are read whole for every token, so a rule that puts one on the CPU is honoured with a warning
// giving what it costs: its bytes, read from host memory for every token.
//
// Plain functions of names and sizes: nothing here loads or allocates.
#pragma once

#include <cstdint>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/device.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/weight_source.h"

namespace moe::runtime {

struct OverrideRule {
  std::string text;  // as given, for messages
  std::regex pattern;
  Device device;
};
// "REGEX=cpu", "REGEX=cuda" or "REGEX=cuda:N" (the last '=' splits). kInvalidArgument naming the
// rule and what is wrong: no '=', an empty or invalid regex, a device other than cpu or cuda[:N].
absl::StatusOr<OverrideRule> ParseOverrideRule(std::string_view text);

struct PlacementOptions {
  Device gpu{Device::Kind::kCuda, 0};
  bool cpu_moe = false;
  int n_cpu_moe = 0;
  std::vector<OverrideRule> overrides;
};

struct TensorInfo {
  std::string name;
  int64_t bytes = 0;     // as stored in the checkpoint
  int64_t elements = 0;  // 0: bytes / 2 (a bf16 checkpoint)
  int rank = 2;
  int64_t rows = 0;  // the first dimension (0: unknown)
};

struct TensorPlace {
  std::string name;
  TensorKind kind;
  Device device;
  int64_t bytes = 0;  // as stored
  int64_t elements = 0;
  int rank = 2;
  int64_t rows = 0;
  std::string rule;  // what decided it: "--override-tensor R", "--cpu-moe", "--n-cpu-moe N", "default"
};

struct Placement {
  std::vector<TensorPlace> tensors;  // in the order given
  // One per (rule, role) that puts per-token tensors on the CPU, with their bytes.
  std::vector<std::string> warnings;
  int64_t BytesOn(Device::Kind kind) const;
};

// Every tensor of a checkpoint, by its header (nothing is read).
absl::StatusOr<std::vector<TensorInfo>> CheckpointTensors(const WeightSource& source);
// The tensors the model loader reads from a bf16 checkpoint of `spec`, from config.json alone
// (planning before the weights are downloaded), named as `container` names them (the name table:
// checkpoint.h), in the order a Hugging Face checkpoint lists them (make-model writes this list).
std::vector<TensorInfo> ExpectedTensors(const ModelSpec& spec, Container container = Container::kSafetensors);

// kInvalidArgument for n_cpu_moe outside [0, the model's MoE layers], or a cuda:N override
// naming another GPU than options.gpu (one GPU per process for now).
absl::StatusOr<Placement> PlaceTensors(const ModelSpec& spec, const std::vector<TensorInfo>& tensors,
                                       const PlacementOptions& options);

// What the runtime can run of a placement: the model layers whose routed experts it puts on the
// CPU (ModelOptions::pool_layers), in order. kInvalidArgument naming the tensor and the rule for
// what it cannot run that way yet: a tensor other than a routed expert on the CPU, or a layer
// whose routed experts are split between the CPU and the GPU.
absl::StatusOr<std::vector<int>> CpuExpertLayers(const Placement& placement);

}  // namespace moe::runtime
