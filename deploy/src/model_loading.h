// Loading a model for a command: `--device` resolved (auto: the GPU when one is visible and the
// model fits, else the CPU), the choice printed, the backend made, the routed experts placed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "flags.h"
#include "moe/runtime/device.h"
#include "moe/runtime/executor.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_executor.h"
#include "moe/runtime/placement.h"

namespace moe::deploy {

// --device, --eager and --kv-cache-dtype, shared by generate, serve and bench.
struct DeviceFlags {
  std::string device = "auto";
  bool eager = false;
  std::string kv_cache_dtype = "auto";
  void Add(CLI::App* app);
};

// --kv-cache-dtype's value: unset for auto (the backend's activation dtype), else bf16 or fp8.
std::optional<core::DType> ParseKvCacheDtype(const std::string& text);

// Bytes a model's weights take on a GPU (bf16), from its checkpoint's headers.
absl::StatusOr<int64_t> GpuWeightBytes(const std::string& model_dir);

// The device for `flags.device`: auto picks cuda:0 when a GPU is visible and the weights but the
// `host_bytes` of routed experts kept in the CPU pool (hybrid execution), plus `extra_bytes` (KV
// cache, step buffers), fit in its free memory, else the CPU. `why` says why.
absl::StatusOr<runtime::Device> ResolveDevice(const DeviceFlags& flags, const std::string& model_dir,
                                              int64_t extra_bytes, int64_t host_bytes, std::string* why);

// Hybrid execution: where the placement flags put the checkpoint's tensors, and the model layers
// whose routed experts that leaves in the CPU pool (what the runtime can run of it: see
// runtime::CpuExpertLayers). --experts pool counts as --cpu-moe.
struct HybridPlan {
  runtime::ModelSpec spec;
  runtime::Placement placement;
  std::vector<int> pool_layers;
  int moe_layers = 0;
};
absl::StatusOr<HybridPlan> PlanHybrid(const std::string& model_dir, const ExpertFlags& experts);

// The flags' usage errors, before anything loads (exit 2): a malformed --device or
// --override-tensor rule, placement flags with --device cpu or with --experts gpu|reference,
// --experts gpu on the CPU, and the expert pool's own flags.
absl::Status CheckModelFlags(const DeviceFlags& device, const ExpertFlags& experts, const std::string& command);

// Resolves the device, prints "moeserve COMMAND: device ...: why" on stderr, and loads the model
// there. `options` carries the command's other settings; the expert flags are applied here (on a
// GPU the routed experts run on it). Call CheckModelFlags first: errors from here are runtime
// errors (exit 1).
// `before_load`, when given, runs once the backend is made and before the model loads onto it (a
// worker makes its NCCL communicator on the backend's stream there).
using BeforeLoad = std::function<absl::Status(runtime::Backend& backend, runtime::ModelOptions& options)>;
absl::StatusOr<std::unique_ptr<runtime::Model>> LoadModelForCommand(
    const std::string& model_dir, const DeviceFlags& device, const ExpertFlags& experts, runtime::ModelOptions options,
    int64_t extra_bytes, const std::string& command, const BeforeLoad& before_load = nullptr);

// Speculative decoding with a draft model: kFailedPrecondition unless `draft_dir`'s tokenizer.json
// has the target's vocabulary, the same text for every id (naming the first id that differs, its
// text in each, and both files), or when either folder has no tokenizer.json to compare.
absl::Status CheckDraftVocabulary(const std::string& target_dir, const std::string& draft_dir);

// The draft model of --spec-type draft, loaded on the CPU backend beside the target, with the
// target's step limits; wraps `target` in the executor that drafts with it. `draft` receives the
// model, which must outlive the executor.
absl::StatusOr<std::unique_ptr<runtime::Executor>> WithDraftModel(std::unique_ptr<runtime::Executor> target,
                                                                  const runtime::SpeculativeConfig& speculative,
                                                                  const runtime::ModelOptions& target_options,
                                                                  int max_seqs, std::unique_ptr<runtime::Model>* draft);

// --spec-type mtp (`what`: the flag or key, for messages): kFailedPrecondition naming what `model_dir` lacks for an MTP head (config.json's
// num_nextn_predict_layers, or the nextn layer's tensors); OK when it has one.
absl::Status CheckMtpHead(const std::string& model_dir, const std::string& what);

// The MTP head of --spec-type mtp: the first nextn layer of the target's checkpoint `model_dir`,
// loaded on the CPU backend with the target's step limits; wraps `target` in the executor that
// drafts with it. `head` receives the model, which must outlive the executor. kFailedPrecondition
// for a target that is not on the CPU backend (the head reads its hidden states on the host).
absl::StatusOr<std::unique_ptr<runtime::Executor>> WithMtpHead(std::unique_ptr<runtime::ModelExecutor> target,
                                                               const std::string& model_dir,
                                                               const runtime::ModelOptions& target_options,
                                                               int max_seqs, std::unique_ptr<runtime::Model>* head);

}  // namespace moe::deploy
