#include "model_loading.h"

#include <algorithm>
#include <iostream>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "moe/core/status.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/draft_model_executor.h"
#include "moe/runtime/memory_plan.h"
#include "moe/runtime/model_executor.h"
#include "moe/runtime/mtp_executor.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/routing_profile.h"
#include "moe/runtime/weight_policy.h"
#include "moe/text/tokenizer.h"

namespace moe::deploy {
void DeviceFlags::Add(CLI::App* app) {
  app->add_option("--device", device,
                  "where the model runs: auto (the GPU when one is visible and the model fits in its memory, else "
                  "the CPU), cpu, cuda (GPU 0) or cuda:N")
      ->capture_default_str();
  app->add_flag("--eager", eager, "on a GPU, run every step op by op instead of replaying CUDA graphs (debugging)");
  app->add_option("--kv-cache-dtype", kv_cache_dtype,
                  "the KV cache's element type: auto (bf16 on a GPU, fp32 on the CPU), bf16, or fp8 (GPU only: e4m3 "
                  "with one scale per position and KV head, about half the bytes of bf16)")
      ->check(CLI::IsMember({"auto", "bf16", "fp8"}))
      ->capture_default_str();
}

std::optional<core::DType> ParseKvCacheDtype(const std::string& text) {
  if (text == "bf16") return core::DType::kBF16;
  if (text == "fp8") return core::DType::kF8E4M3;
  return std::nullopt;
}

absl::StatusOr<int64_t> GpuWeightBytes(const std::string& model_dir) {
  MOE_ASSIGN_OR_RETURN(auto checkpoint, runtime::OpenCheckpoint(model_dir));
  const runtime::ModelSpec& spec = checkpoint->spec();
  int64_t bytes = 0;
  for (const std::string& name : checkpoint->source().Names()) {
    const std::optional<runtime::TensorKey> key = checkpoint->names().Parse(name);
    if (key && key->layer >= spec.num_layers) continue;  // nextn layers: not loaded for the forward
    MOE_ASSIGN_OR_RETURN(const runtime::WeightView view, checkpoint->source().GetStored(name));
    const runtime::TensorRole role = key ? runtime::RoleOf(key->id) : runtime::TensorRole::kOther;
    bytes += runtime::DeviceWeightBytes(runtime::WeightHome::kGpu, runtime::WeightPolicy{}, view.shape, view.format,
                                        runtime::UseOf(role, view.rank()), role);
  }
  return bytes;
}

absl::Status CheckModelFlags(const DeviceFlags& device_flags, const ExpertFlags& experts, const std::string& command) {
  auto device = runtime::ParseDevice(device_flags.device);
  if (!device.ok()) return device.status();
  runtime::ModelOptions options;
  MOE_RETURN_IF_ERROR(experts.Apply(&options, command));
  for (const std::string& rule : experts.override_tensor) {
    if (auto parsed = runtime::ParseOverrideRule(rule); !parsed.ok()) return parsed.status();
  }
  const bool placement = experts.cpu_moe || experts.n_cpu_moe > 0 || !experts.override_tensor.empty();
  if (placement && device->kind == runtime::Device::Kind::kCpu) {
    return absl::InvalidArgumentError(
        "--cpu-moe, --n-cpu-moe and --override-tensor place routed experts beside a GPU; with --device cpu every "
        "tensor is on the CPU already");
  }
  if (placement && (experts.mode == "gpu" || experts.mode == "reference")) {
    return absl::InvalidArgumentError(absl::StrCat("--experts ", experts.mode,
                                                   " keeps every routed expert off the CPU pool, which --cpu-moe, "
                                                   "--n-cpu-moe and --override-tensor put there; drop one of them"));
  }
  if (device->kind == runtime::Device::Kind::kCpu && experts.mode == "gpu") {
    return absl::InvalidArgumentError("--experts gpu needs a GPU: --device cuda or auto");
  }
  if (experts.weight_format != "bf16" && device->kind == runtime::Device::Kind::kCuda) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weight-format ", experts.weight_format,
                     " packs the CPU backend's weights; on a GPU they are bf16 (use "
                     "--device cpu, or --expert-format for the experts in the CPU pool)"));
  }
  if (device->kind == runtime::Device::Kind::kCpu && device_flags.kv_cache_dtype != "auto") {
    return absl::InvalidArgumentError(absl::StrCat("--kv-cache-dtype ", device_flags.kv_cache_dtype,
                                                   ": the CPU backend keeps its KV cache in fp32 (auto); bf16 and "
                                                   "fp8 caches are for a GPU"));
  }
  if (experts.defer_experts > 0) {
    const bool pool = experts.mode != "gpu" && experts.mode != "reference" &&
                      (device->kind != runtime::Device::Kind::kCuda || experts.Hybrid());
    if (!pool) {
      return absl::InvalidArgumentError(
          "--defer-experts finishes routed experts in the CPU pool beside the next layer's attention: it needs "
          "routed experts in the pool (on a GPU: --cpu-moe, --n-cpu-moe or --override-tensor; --experts gpu and "
          "reference keep them out)");
    }
  }
  if (experts.gpu_experts_per_layer > 0) {
    if (device->kind == runtime::Device::Kind::kCpu || !experts.Hybrid()) {
      return absl::InvalidArgumentError(
          "--gpu-experts-per-layer holds some of the CPU layers' experts on a GPU: it needs a GPU device and routed "
          "experts on the CPU (--cpu-moe, --n-cpu-moe or --override-tensor)");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<HybridPlan> PlanHybrid(const std::string& model_dir, const ExpertFlags& experts) {
  HybridPlan plan;
  MOE_ASSIGN_OR_RETURN(auto checkpoint, runtime::OpenCheckpoint(model_dir));
  plan.spec = checkpoint->spec();
  const runtime::ModelSpec& spec = plan.spec;
  MOE_ASSIGN_OR_RETURN(const std::vector<runtime::TensorInfo> tensors,
                       runtime::CheckpointTensors(checkpoint->source()));
  runtime::PlacementOptions options;
  options.cpu_moe = experts.cpu_moe || experts.mode == "pool";
  options.n_cpu_moe = experts.n_cpu_moe;
  for (const std::string& text : experts.override_tensor) {
    MOE_ASSIGN_OR_RETURN(runtime::OverrideRule rule, runtime::ParseOverrideRule(text));
    options.overrides.push_back(std::move(rule));
  }
  MOE_ASSIGN_OR_RETURN(plan.placement, runtime::PlaceTensors(spec, tensors, options));
  MOE_ASSIGN_OR_RETURN(plan.pool_layers, runtime::CpuExpertLayers(plan.placement));
  // A nextn layer's experts are not the forward's (speculative decoding places them itself).
  std::erase_if(plan.pool_layers, [&](int layer) { return layer >= spec.num_layers; });
  plan.moe_layers = spec.num_moe_layers();
  return plan;
}

absl::StatusOr<runtime::Device> ResolveDevice(const DeviceFlags& flags, const std::string& model_dir,
                                              int64_t extra_bytes, int64_t host_bytes, std::string* why) {
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
  MOE_ASSIGN_OR_RETURN(const runtime::ModelSpec spec, runtime::ReadCheckpointSpec(model_dir));
  if (spec.uses_mla()) {
    *why =
        absl::StrCat(spec.model_type,
                     "'s multi-head latent attention runs on the CPU backend in this build (no GPU MLA kernels yet)");
    return runtime::Device{runtime::Device::Kind::kCpu, 0};
  }
  MOE_ASSIGN_OR_RETURN(const int64_t all_weights, GpuWeightBytes(model_dir));
  // The routed experts in the CPU pool are bf16 in the checkpoint's count too.
  const int64_t weights = std::max<int64_t>(all_weights - host_bytes, 0);
  MOE_ASSIGN_OR_RETURN(const auto memory, runtime::CudaMemoryInfo(0));
  const int64_t need = weights + extra_bytes + runtime::kGpuHeadroomBytes;
  if (need > memory.first) {
    *why = absl::StrCat("the model needs ", runtime::FormatGiB(need), " on a GPU (", runtime::FormatGiB(weights),
                        " of weights) and cuda:0 has ", runtime::FormatGiB(memory.first), " free",
                        host_bytes == 0 ? "; --cpu-moe or --n-cpu-moe N keep routed experts in host memory" : "");
    return runtime::Device{runtime::Device::Kind::kCpu, 0};
  }
  *why = absl::StrCat("the model's ", runtime::FormatGiB(weights), " of weights fit in ",
                      runtime::FormatGiB(memory.first), " free on ", runtime::CudaDeviceName(0));
  return runtime::Device{runtime::Device::Kind::kCuda, 0};
}

absl::StatusOr<std::unique_ptr<runtime::Model>> LoadModelForCommand(
    const std::string& model_dir, const DeviceFlags& device_flags, const ExpertFlags& experts,
    runtime::ModelOptions options, int64_t extra_bytes, const std::string& command, const BeforeLoad& before_load) {
  MOE_RETURN_IF_ERROR(experts.Apply(&options, command));
  const auto parsed = runtime::ParseDevice(device_flags.device);
  if (!parsed.ok()) return parsed.status();
  // Hybrid execution: which routed experts stay in the CPU pool, decided before the device (auto
  // counts only the GPU's share).
  std::optional<HybridPlan> hybrid;
  if (experts.Hybrid() && parsed->kind != runtime::Device::Kind::kCpu) {
    MOE_ASSIGN_OR_RETURN(hybrid, PlanHybrid(model_dir, experts));
  }
  const int64_t host_bytes = hybrid ? hybrid->placement.BytesOn(runtime::Device::Kind::kCpu) : 0;
  std::string why;
  auto device = ResolveDevice(device_flags, model_dir, extra_bytes, host_bytes, &why);
  if (!device.ok()) return device.status();
  const bool gpu = device->kind == runtime::Device::Kind::kCuda;
  std::vector<std::string> notes;  // printed after the device line
  if (gpu && hybrid) {
    for (const std::string& warning : hybrid->placement.warnings) notes.push_back("warning: " + warning);
    if (hybrid->pool_layers.empty()) {
      notes.push_back("the placement flags leave every routed expert on the GPU");
    } else {
      notes.push_back(absl::StrCat("routed experts of ", hybrid->pool_layers.size(), " of ", hybrid->moe_layers,
                                   " MoE layers in the CPU pool (", runtime::FormatGiB(host_bytes),
                                   " in the checkpoint), the rest of the model on the GPU"));
    }
  }
  if (gpu && hybrid && !hybrid->pool_layers.empty()) {
    options.experts = runtime::RoutedExpertsMode::kPool;
    options.pool_layers = hybrid->pool_layers;
    if (experts.gpu_experts_per_layer > 0) {
      const runtime::ModelSpec& spec = hybrid->spec;
      if (experts.gpu_experts_per_layer > spec.routing.num_experts) {
        return absl::InvalidArgumentError(absl::StrCat("--gpu-experts-per-layer ", experts.gpu_experts_per_layer,
                                                       ": the model's layers have ", spec.routing.num_experts,
                                                       " experts"));
      }
      if (experts.expert_profile.empty()) {
        options.held_experts_per_layer = experts.gpu_experts_per_layer;
        options.held_experts_refresh_steps = experts.gpu_experts_refresh_steps;
        notes.push_back(absl::StrFormat(
            "the %d most picked experts of each CPU layer held on the GPU too, chosen from the picks counted while "
            "serving (refreshed every %d steps; experts 0-%d until the first refresh)",
            experts.gpu_experts_per_layer, experts.gpu_experts_refresh_steps, experts.gpu_experts_per_layer - 1));
      } else {
        MOE_ASSIGN_OR_RETURN(const runtime::RoutingProfile profile,
                             runtime::LoadRoutingProfile(experts.expert_profile, spec));
        for (int layer : hybrid->pool_layers) {
          options.backend_experts[layer] = runtime::MostUsedExperts(profile, layer, experts.gpu_experts_per_layer);
        }
        notes.push_back(absl::StrFormat(
            "the %d most used experts of each CPU layer held on the GPU too (%s): %.1f%% of the profile's picks",
            experts.gpu_experts_per_layer, experts.expert_profile,
            100 * runtime::MeanShareOfMostUsed(profile, hybrid->pool_layers, experts.gpu_experts_per_layer)));
      }
    }
  } else if (gpu) {
    options.experts = runtime::RoutedExpertsMode::kBackend;
  } else if (experts.Hybrid() && experts.mode != "pool") {
    notes.push_back("the placement flags have no GPU to place routed experts beside: everything runs on the CPU");
  }
  options.graphs = !device_flags.eager;
  options.kv_cache_dtype = ParseKvCacheDtype(device_flags.kv_cache_dtype);
  options.progress = gpu;
  auto backend = runtime::CreateBackend(*device, options.threads, options.weights);
  if (!backend.ok()) return backend.status();
  std::cerr << "moeserve " << command << ": device " << (*backend)->name() << ": " << why << "\n";
  for (const std::string& note : notes) std::cerr << "moeserve " << command << ": " << note << "\n";
  if (before_load) MOE_RETURN_IF_ERROR(before_load(**backend, options));
  auto model = runtime::Model::Load(model_dir, options, std::shared_ptr<runtime::Backend>(std::move(*backend)));
  if (model.ok() && !(*model)->prefill_offload_note().empty()) {
    std::cerr << "moeserve " << command << ": " << (*model)->prefill_offload_note() << "\n";
  }
  return model;
}

absl::Status CheckDraftVocabulary(const std::string& target_dir, const std::string& draft_dir) {
  auto target = text::Tokenizer::FromModelDir(target_dir);
  auto draft = text::Tokenizer::FromModelDir(draft_dir);
  for (const auto& [tokenizer, dir] : {std::pair{&target, &target_dir}, std::pair{&draft, &draft_dir}}) {
    if (!tokenizer->ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--draft-model: the vocabularies cannot be compared: ", tokenizer->status().message(),
                       " (a draft model needs the target's tokenizer.json, and so does the target)"));
    }
  }
  const int target_size = (*target)->vocab_size(), draft_size = (*draft)->vocab_size();
  for (int32_t id = 0; id < std::max(target_size, draft_size); ++id) {
    const std::string a = id < target_size ? (*target)->IdToToken(id) : "(none)";
    const std::string b = id < draft_size ? (*draft)->IdToToken(id) : "(none)";
    if (a == b) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "--draft-model ", draft_dir, ": token ", id, " is '", absl::CEscape(b), "' in its tokenizer.json and '",
        absl::CEscape(a), "' in the target's (", target_dir,
        "); a draft model must have the target's vocabulary, token for token"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<runtime::Executor>> WithDraftModel(std::unique_ptr<runtime::Executor> target,
                                                                  const runtime::SpeculativeConfig& speculative,
                                                                  const runtime::ModelOptions& target_options,
                                                                  int max_seqs, std::unique_ptr<runtime::Model>* draft) {
  runtime::ModelOptions options;
  options.threads = target_options.threads;
  options.max_step_tokens = target_options.max_step_tokens;
  options.max_logit_rows = std::max(max_seqs, 1);
  options.max_context = target_options.max_context;
  options.pool.progress = false;
  auto model = runtime::Model::Load(speculative.draft_model, options);
  if (!model.ok()) return core::Annotate(model.status(), absl::StrCat("--draft-model ", speculative.draft_model));
  auto executor = runtime::DraftModelExecutor::Create(std::move(target), **model, max_seqs);
  if (!executor.ok()) {
    return core::Annotate(executor.status(), absl::StrCat("--draft-model ", speculative.draft_model));
  }
  *draft = *std::move(model);
  return std::unique_ptr<runtime::Executor>(*std::move(executor));
}

absl::Status CheckMtpHead(const std::string& model_dir, const std::string& what) {
  auto checkpoint = runtime::OpenCheckpoint(model_dir);
  if (!checkpoint.ok()) return core::Annotate(checkpoint.status(), what);
  const runtime::ModelSpec& spec = (*checkpoint)->spec();
  if (spec.num_nextn_layers == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": ", model_dir, " has no MTP (nextn) layer: its config.json's num_nextn_predict_layers is 0 (",
        spec.model_type, "); use ngram drafts, or a draft model"));
  }
  std::vector<std::string> missing;
  for (const runtime::TensorId id : {runtime::TensorId::kNextnEmbedNorm, runtime::TensorId::kNextnHiddenNorm,
                                     runtime::TensorId::kNextnProj, runtime::TensorId::kAttnQ,
                                     runtime::TensorId::kRouter}) {
    const runtime::TensorKey key{id, spec.num_layers};
    if (!(*checkpoint)->Has(key)) missing.push_back((*checkpoint)->Describe(key));
  }
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": ", model_dir, " declares ", spec.num_nextn_layers,
        " MTP (nextn) layer(s) (num_nextn_predict_layers) but its weights lack layer ", spec.num_layers, "'s ",
        absl::StrJoin(missing, ", "), " (a checkpoint saved without its MTP layer); use ngram drafts"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<runtime::Executor>> WithMtpHead(std::unique_ptr<runtime::ModelExecutor> target,
                                                               const std::string& model_dir,
                                                               const runtime::ModelOptions& target_options,
                                                               int max_seqs, std::unique_ptr<runtime::Model>* head) {
  if (!target->model().backend().HostAddressable()) {
    return absl::FailedPreconditionError(absl::StrCat("--spec-type mtp: the MTP head drafts beside a target on the CPU ",
                                                      "backend for now (--device cpu), not on ",
                                                      target->model().backend().name()));
  }
  runtime::ModelOptions options;
  options.threads = target_options.threads;
  options.max_step_tokens = target_options.max_step_tokens + std::max(max_seqs, 1);  // and each chunk's waiting row
  options.max_logit_rows = std::max(max_seqs, 1);
  options.max_context = target_options.max_context;
  options.pool.progress = false;
  options.nextn_head = true;
  auto model = runtime::Model::Load(model_dir, options);
  if (!model.ok()) return core::Annotate(model.status(), "--spec-type mtp");
  auto executor = runtime::MtpExecutor::Create(std::move(target), **model, max_seqs);
  if (!executor.ok()) return core::Annotate(executor.status(), "--spec-type mtp");
  *head = *std::move(model);
  return std::unique_ptr<runtime::Executor>(*std::move(executor));
}

}  // namespace moe::deploy
