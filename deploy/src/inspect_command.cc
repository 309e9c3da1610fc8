// moeserve inspect: what a model needs where, before anything loads. It places every tensor by the
// same flags serve takes (--cpu-moe, --n-cpu-moe, --override-tensor), plans each device's memory
// (runtime/memory_plan.h), and bounds decode by the host memory the CPU-placed experts read per
// token. It reads config.json and, where the weights are present, their headers only: a folder
// with config.json alone plans a model before it is downloaded.
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "commands.h"
#include "flags.h"
#include "model_loading.h"
#include "moe/core/status.h"
#include "moe/experts/expert_pool.h"
#include "moe/runtime/cache.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/device.h"
#include "moe/runtime/memory_plan.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/placement.h"
#include "moe/runtime/routing_profile.h"
#include "moe/runtime/weight_source.h"
#include "nlohmann/json.hpp"

namespace moe::deploy {
namespace {

// What an MLA model's plan means in this build: its cache is the latent, and it runs on the CPU.
std::string MlaNote(const runtime::ModelSpec& spec) {
  return absl::StrCat("MLA caches ", spec.mla.latent_width(), " values a position per layer (kv_lora_rank ",
                      spec.mla.kv_lora_rank, " + qk_rope_head_dim ", spec.mla.qk_rope_head_dim,
                      "); it runs on the CPU backend in this build (--device cpu), so the GPU plan above is for "
                      "when GPU MLA kernels land");
}

struct InspectFlags {
  std::string model;
  ExpertFlags experts;
  std::optional<int64_t> ctx;
  int max_seqs = 1;
  int max_batch_tokens = 2048;
  std::optional<double> gpu_memory_gb;
  std::optional<double> read_gbps;
  std::string device = "cuda";
  std::string kv_cache_dtype = "bf16";
  std::string draft_model;  // serve's --spec-type draft --draft-model
  bool json = false;
};

// The draft model of --spec-type draft, beside the plan: it runs on the CPU backend, its weights and
// its KV cache (fp32, following every target position: context x sequences) in host memory.
struct DraftPlan {
  std::string summary;
  int64_t weight_bytes = 0;
  int64_t kv_bytes_per_token = 0;
  int64_t kv_bytes = 0;
};

absl::StatusOr<DraftPlan> PlanDraft(const InspectFlags& f, int64_t context) {
  MOE_RETURN_IF_ERROR(CheckDraftVocabulary(f.model, f.draft_model));
  auto spec = runtime::ReadCheckpointSpec(f.draft_model);
  if (!spec.ok()) return core::Annotate(spec.status(), absl::StrCat("--draft-model ", f.draft_model));
  DraftPlan d;
  d.summary = spec->Summary();
  auto weights = GpuWeightBytes(f.draft_model);
  if (weights.ok()) d.weight_bytes = *weights;
  d.kv_bytes_per_token = runtime::PlanCache(*spec, runtime::Range{0, spec->num_layers},
                                            runtime::CacheOptions{16, core::DType::kF32})
                             .BytesPerToken();
  d.kv_bytes = d.kv_bytes_per_token * context * f.max_seqs;
  return d;
}

// "GPU" or "CPU" for a placement, with the rule that put a routed expert on the CPU.
std::string Where(const runtime::TensorPlace& t) {
  return t.device.kind == runtime::Device::Kind::kCpu ? "CPU" : "GPU";
}

// One row of the layer-by-layer placement: consecutive layers placed alike.
struct LayerGroup {
  int first = 0, last = 0;
  std::string placed;  // "attention GPU, norm GPU, router GPU, routed expert CPU (--cpu-moe)"
};

std::vector<LayerGroup> GroupLayers(const runtime::Placement& placement, int num_layers, std::string* outside) {
  std::vector<std::map<std::string, std::set<std::string>>> per_layer(num_layers);  // role -> where (rule)
  std::map<std::string, std::set<std::string>> rest;
  for (const runtime::TensorPlace& t : placement.tensors) {
    const std::string role(runtime::TensorRoleName(t.kind.role));
    std::string where = Where(t);
    if (t.rule != "default") where += " (" + t.rule + ")";
    if (t.kind.layer >= 0 && t.kind.layer < num_layers) {
      per_layer[t.kind.layer][role].insert(where);
    } else {
      rest[role].insert(where);
    }
  }
  auto describe = [](const std::map<std::string, std::set<std::string>>& roles) {
    std::vector<std::string> parts;
    for (const auto& [role, where] : roles) parts.push_back(role + " " + absl::StrJoin(where, " + "));
    return absl::StrJoin(parts, ", ");
  };
  *outside = describe(rest);
  std::vector<LayerGroup> groups;
  for (int l = 0; l < num_layers; ++l) {
    const std::string placed = describe(per_layer[l]);
    if (!groups.empty() && groups.back().placed == placed) {
      groups.back().last = l;
    } else {
      groups.push_back({l, l, placed});
    }
  }
  return groups;
}

std::string MiB(double bytes) { return absl::StrFormat("%.1f MiB", bytes / (1 << 20)); }

// A quantized checkpoint's storage by role: "routed expert Q4_K 812.0 MiB + Q6_K 96.0 MiB;
// attention ...".
std::string StorageSummary(const runtime::WeightSource& source) {
  std::map<std::string, std::map<std::string, int64_t>> by_role;
  for (const std::string& name : source.Names()) {
    auto view = source.GetStored(name);
    if (!view.ok()) continue;
    const runtime::TensorKind kind = runtime::ClassifyTensor(name);
    by_role[std::string(runtime::TensorRoleName(kind.role))][view->format.Name()] += view->bytes();
  }
  std::vector<std::string> roles;
  for (const auto& [role, types] : by_role) {
    std::vector<std::string> parts;
    for (const auto& [type, bytes] : types) parts.push_back(absl::StrCat(type, " ", MiB(static_cast<double>(bytes))));
    roles.push_back(absl::StrCat(role, " ", absl::StrJoin(parts, " + ")));
  }
  return absl::StrJoin(roles, "; ");
}

nlohmann::ordered_json DeviceJson(const runtime::DevicePlan& d) {
  nlohmann::ordered_json j;
  j["device"] = d.device;
  j["free_bytes"] = d.free;
  for (const runtime::MemoryLine& line : d.lines) j["lines"].push_back({{"what", line.what}, {"bytes", line.bytes}});
  j["total_bytes"] = d.total;
  j["fits"] = d.fits();
  return j;
}

void PrintDevice(const runtime::DevicePlan& d, const std::string& title) {
  std::cout << "  " << title << ":\n";
  for (const runtime::MemoryLine& line : d.lines) {
    std::cout << absl::StrFormat("    %-66s %10s\n", line.what, runtime::FormatGiB(line.bytes));
  }
  std::cout << absl::StrFormat("    %-66s %10s", "total", runtime::FormatGiB(d.total));
  if (d.free > 0) std::cout << " of " << runtime::FormatGiB(d.free) << (d.fits() ? ": fits" : ": does NOT fit");
  std::cout << "\n";
}

int RunInspect(const InspectFlags& f) {
  const std::string command = "inspect";
  auto device = runtime::ParseDevice(f.device);
  if (!device.ok()) return FailCommand(command, device.status(), 2);
  if (device->kind == runtime::Device::Kind::kCpu) {
    return FailCommand(command,
                       absl::InvalidArgumentError("--device cpu: inspect plans a GPU and the host beside it; on the "
                                                  "CPU alone every tensor is in host memory"),
                       2);
  }
  for (const std::string& rule : f.experts.override_tensor) {
    if (auto parsed = runtime::ParseOverrideRule(rule); !parsed.ok()) return FailCommand(command, parsed.status(), 2);
  }
  runtime::ModelOptions unused;
  if (absl::Status s = f.experts.Apply(&unused, command); !s.ok()) return FailCommand(command, s, 2);
  if (f.experts.mode == "gpu" || f.experts.mode == "reference") {
    return FailCommand(command, absl::InvalidArgumentError("inspect takes --experts auto or pool"), 2);
  }

  auto spec = runtime::ReadCheckpointSpec(f.model);
  if (!spec.ok()) return FailCommand(command, spec.status(), 1);
  // The checkpoint's headers where the weights are there; else the tensors config.json implies.
  std::vector<runtime::TensorInfo> tensors;
  std::string source_note;
  const bool gguf = runtime::IsGgufCheckpoint(f.model);
  // Opened as serve opens it: a GGUF file's types, an FP8 checkpoint's weights with their scales.
  absl::StatusOr<std::unique_ptr<runtime::Checkpoint>> checkpoint = runtime::OpenCheckpoint(f.model);
  if (checkpoint.ok()) {
    auto listed = runtime::CheckpointTensors((*checkpoint)->source());
    if (!listed.ok()) return FailCommand(command, listed.status(), 1);
    tensors = std::move(*listed);
    source_note = absl::StrCat(tensors.size(), " tensors, from the checkpoint's headers");
    if (gguf) {
      absl::StrAppend(&source_note, " (GGUF: ", StorageSummary((*checkpoint)->source()),
                      "); on a GPU its weights other than the routed experts on the CPU are dequantized to bf16, as "
                      "the GPU lines count them; on the CPU backend its Linears stay in their types");
    } else if (!(*checkpoint)->quantization().empty()) {
      absl::StrAppend(&source_note, " (", (*checkpoint)->quantization(), ": ", StorageSummary((*checkpoint)->source()),
                      "); on a GPU its weights other than the routed experts on the CPU are dequantized to bf16, as "
                      "the GPU lines count them");
    }
  } else if (!gguf && checkpoint.status().code() == absl::StatusCode::kNotFound) {
    tensors = runtime::ExpectedTensors(*spec);
    source_note =
        absl::StrCat(tensors.size(), " tensors expected from config.json (no weights in ", f.model, "), at bf16");
  } else {
    return FailCommand(command, checkpoint.status(), 1);
  }

  runtime::PlacementOptions placement_options;
  placement_options.gpu =
      device->kind == runtime::Device::Kind::kCuda ? *device : runtime::Device{runtime::Device::Kind::kCuda, 0};
  placement_options.cpu_moe = f.experts.cpu_moe || f.experts.mode == "pool";
  placement_options.n_cpu_moe = f.experts.n_cpu_moe;
  for (const std::string& text : f.experts.override_tensor) {
    placement_options.overrides.push_back(*runtime::ParseOverrideRule(text));
  }
  auto placement = runtime::PlaceTensors(*spec, tensors, placement_options);
  if (!placement.ok()) return FailCommand(command, placement.status(), 1);
  // What serve would refuse to run of this placement, said the same way.
  const absl::StatusOr<std::vector<int>> runnable = runtime::CpuExpertLayers(*placement);

  runtime::MemoryPlanOptions plan_options;
  plan_options.context = f.ctx.value_or(0);
  plan_options.max_seqs = f.max_seqs;
  plan_options.max_batch_tokens = f.max_batch_tokens;
  plan_options.max_logit_rows = std::min(256, f.max_batch_tokens);
  plan_options.kv_dtype = ParseKvCacheDtype(f.kv_cache_dtype).value_or(core::DType::kBF16);
  if (f.experts.format == "auto") {
    // A GGUF file's experts are kept as stored; the plan reads their types from the header.
    plan_options.host_format = checkpoint.ok() ? runtime::AutoPoolFormat(**checkpoint) : experts::ExpertFormat::kBF16;
  } else {
    auto format = experts::ParseFormat(f.experts.format);
    if (!format.ok()) return FailCommand(command, core::Annotate(format.status(), "--expert-format"), 2);
    plan_options.host_format = *format;
  }
  plan_options.host_group = f.experts.group;
  if (plan_options.host_format == experts::ExpertFormat::kFp8 && checkpoint.ok() &&
      runtime::Fp8ExpertGroup(**checkpoint) > 0) {
    plan_options.host_group = runtime::Fp8ExpertGroup(**checkpoint);
  }
  plan_options.gpu_experts_per_layer = f.experts.gpu_experts_per_layer;
  plan_options.prefill_streaming = f.experts.prefill_offload_tokens.value_or(-1) != 0;
  std::string share_note;
  if (f.experts.gpu_experts_per_layer > 0 && !f.experts.expert_profile.empty()) {
    auto profile = runtime::LoadRoutingProfile(f.experts.expert_profile, *spec);
    if (!profile.ok()) return FailCommand(command, profile.status(), 2);
    plan_options.gpu_experts_share = runtime::MeanShareOfMostUsed(*profile, {}, f.experts.gpu_experts_per_layer);
    share_note = absl::StrFormat(" (%.1f%% of the picks run on the GPU, by %s)", 100 * *plan_options.gpu_experts_share,
                                 f.experts.expert_profile);
  } else if (f.experts.gpu_experts_per_layer > 0) {
    share_note = " (the GPU's share of the picks taken as if routing were uniform: give --expert-profile)";
  }
  std::string gpu_what;
  if (f.gpu_memory_gb) {
    plan_options.gpu_free_bytes = static_cast<int64_t>(*f.gpu_memory_gb * (1 << 30));
    gpu_what = absl::StrFormat("a GPU of %.1f GiB (--gpu-memory-gb)", *f.gpu_memory_gb);
  } else if (runtime::CudaDeviceCount() > device->index) {
    auto memory = runtime::CudaMemoryInfo(device->index);
    if (!memory.ok()) return FailCommand(command, memory.status(), 1);
    plan_options.gpu_free_bytes = memory->first;
    gpu_what = absl::StrCat(runtime::CudaDeviceName(device->index), ", ", runtime::FormatGiB(memory->first), " free");
  } else {
    gpu_what = "no GPU visible and no --gpu-memory-gb: what the GPU needs, not checked against one";
  }
  auto plan = runtime::PlanMemory(*spec, *placement, plan_options);
  if (!plan.ok()) return FailCommand(command, plan.status(), 2);
  std::optional<DraftPlan> draft;
  if (!f.draft_model.empty()) {
    auto planned = PlanDraft(f, plan_options.context > 0 ? plan_options.context : spec->max_position_embeddings);
    if (!planned.ok()) return FailCommand(command, planned.status(), 2);
    draft = *std::move(planned);
  }

  // The decode bound at batch 1: the routed experts on the CPU stream from host memory.
  double read_gbps = 0;
  std::string read_what;
  if (plan->host_read_per_token > 0) {
    if (f.read_gbps) {
      read_gbps = *f.read_gbps;
      read_what = "--read-gbps";
    } else {
      read_gbps = experts::MeasureHostReadBandwidth(f.experts.threads, size_t{1} << 30, 3);
      read_what = absl::StrCat("measured now, ", f.experts.threads > 0 ? f.experts.threads : AvailableCores(),
                               " threads over 1 GiB");
    }
  }
  const double bound = read_gbps > 0 ? read_gbps * 1e9 / plan->host_read_per_token : 0;

  std::string outside;
  const std::vector<LayerGroup> groups = GroupLayers(*placement, spec->num_layers, &outside);
  if (f.json) {
    nlohmann::ordered_json j;
    j["model"] = spec->Summary();
    j["tensors"] = source_note;
    for (const LayerGroup& g : groups)
      j["layers"].push_back({{"first", g.first}, {"last", g.last}, {"placed", g.placed}});
    j["outside_layers"] = outside;
    j["warnings"] = placement->warnings;
    if (!runnable.ok()) j["not_runnable"] = std::string(runnable.status().message());
    j["gpu"] = DeviceJson(plan->gpu);
    j["gpu"]["what"] = gpu_what;
    j["host"] = DeviceJson(plan->host);
    j["decode"] = {{"host_bytes_per_token", plan->host_read_per_token},
                   {"gpu_bytes_per_token", plan->gpu_read_per_token},
                   {"cpu_expert_layers", plan->cpu_expert_layers},
                   {"host_read_gbps", read_gbps},
                   {"host_read_measured_as", read_what},
                   {"bound_tokens_per_s", bound}};
    j["kv_bytes_per_token"] = plan->kv_bytes_per_token;
    if (spec->uses_mla()) j["mla_note"] = MlaNote(*spec);
    if (draft.has_value()) {
      j["draft_model"] = {{"model", draft->summary},
                          {"host_weight_bytes", draft->weight_bytes},
                          {"kv_bytes_per_token", draft->kv_bytes_per_token},
                          {"kv_bytes", draft->kv_bytes}};
    }
    j["refusal"] = plan->refusal;
    std::cout << j.dump() << std::endl;
  } else {
    std::cout << "model: " << spec->Summary() << "\n"
              << "tensors: " << source_note << "\n"
              << "placement:\n";
    for (const LayerGroup& g : groups) {
      const std::string layers =
          g.first == g.last ? absl::StrCat("layer ", g.first) : absl::StrCat("layers ", g.first, "-", g.last);
      std::cout << "  " << layers << ": " << g.placed << "\n";
    }
    std::cout << "  outside the layers: " << outside << "\n";
    for (const std::string& w : placement->warnings) std::cout << "warning: " << w << "\n";
    std::cout << absl::StrFormat("memory plan (context %d x %d sequence%s, %d tokens a step, %s experts on the CPU):\n",
                                 plan_options.context > 0 ? plan_options.context : spec->max_position_embeddings,
                                 f.max_seqs, f.max_seqs == 1 ? "" : "s", f.max_batch_tokens,
                                 experts::FormatName(plan_options.host_format));
    PrintDevice(plan->gpu, "GPU: " + gpu_what);
    PrintDevice(plan->host, "host");
    std::cout << "  KV cache: " << plan->kv_bytes_per_token << " bytes a position\n";
    if (spec->uses_mla()) std::cout << "note: " << MlaNote(*spec) << "\n";
    if (draft.has_value()) {
      std::cout << "draft model (--spec-type draft, on the CPU backend): " << draft->summary << "\n"
                << "  host: weights " << MiB(draft->weight_bytes) << " as stored, KV cache "
                << draft->kv_bytes_per_token << " bytes a position (fp32, following the target's): "
                << MiB(draft->kv_bytes) << "\n";
    }
    std::cout << "decode at batch 1, per token: " << MiB(plan->gpu_read_per_token) << " of weights read on the GPU";
    if (plan->host_read_per_token > 0) {
      std::cout << ", " << MiB(plan->host_read_per_token) << " of routed experts from host memory ("
                << spec->routing.top_k << " experts x " << plan->cpu_expert_layers << " layers, "
                << experts::FormatName(plan_options.host_format) << ")" << share_note << "\n";
      std::cout << absl::StrFormat(
          "decode bound from host memory: %.0f tokens/s at %.1f GB/s of host read bandwidth (%s); the GPU's share "
          "and the copies come on top\n",
          bound, read_gbps, read_what);
    } else {
      std::cout << "; no routed expert is read from host memory\n";
    }
  }
  if (!runnable.ok()) return FailCommand(command, runnable.status(), 1);
  if (!plan->refusal.empty()) return FailCommand(command, absl::ResourceExhaustedError(plan->refusal), 1);
  return 0;
}

}  // namespace

void AddInspectCommand(CLI::App& root, CommandRun* selected) {
  auto f = std::make_shared<InspectFlags>();
  CLI::App* app = AddCommand(
      root, "inspect", "where a model's tensors go and what memory each device needs, before anything loads",
      "Reads --model's config.json and, where the weights are there, their headers (nothing else):\n"
      "a folder with config.json alone plans a model before it is downloaded. Prints where every\n"
      "tensor group goes, layer by layer, under serve's placement flags (--cpu-moe, --n-cpu-moe,\n"
      "--override-tensor); the memory plan of the GPU (weights by group, the bf16 KV cache for\n"
      "--ctx x --max-seqs, the step's activations at --max-batch-tokens, the CUDA allowance) and of\n"
      "the host (the expert pool's arena in --expert-format, pinned buffers); the weights one decode\n"
      "token reads on each; and the decode bound from the host read bandwidth, measured in about a\n"
      "second (or --read-gbps). --gpu-memory-gb plans for a GPU that is not there. A plan that does\n"
      "not fit exits 1 with the numbers and the context or sequence count that would fit.",
      [f] { return RunInspect(*f); }, selected);
  app->add_option("--model", f->model, "the model: a Hugging Face folder (config.json; the weights are optional) or a GGUF file (its header is read, not its data)")
      ->required();
  f->experts.Add(app);
  app->add_option("--ctx", f->ctx, "tokens a sequence may hold (default: the model's max_position_embeddings)")
      ->check(IntIn(1, 1 << 24));
  app->add_option("--max-seqs", f->max_seqs, "sequences the KV cache holds at --ctx each")
      ->check(IntIn(1, 4096))
      ->capture_default_str();
  app->add_option("--max-batch-tokens", f->max_batch_tokens, "tokens per step (sizes the step's activations)")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--gpu-memory-gb", f->gpu_memory_gb,
                  "plan for a GPU with this much free memory, in GiB (default: the visible GPU's free memory)")
      ->check(NumberIn(0.001, 1 << 20));
  app->add_option("--read-gbps", f->read_gbps,
                  "host read bandwidth for the decode bound, in GB/s (default: measured now with the pool's threads)")
      ->check(NumberIn(0.001, 1e6));
  app->add_option("--device", f->device, "the GPU planned for: cuda or cuda:N")->capture_default_str();
  app->add_option("--kv-cache-dtype", f->kv_cache_dtype,
                  "the GPU's KV cache: bf16, or fp8 (e4m3 with a scale per position and KV head: about half the "
                  "bytes)")
      ->check(CLI::IsMember({"bf16", "fp8"}))
      ->capture_default_str();
  app->add_option("--draft-model", f->draft_model,
                  "with serve's --spec-type draft: also plan this draft model (its vocabulary checked against "
                  "--model's, its weights and KV cache in host memory)");
  app->add_flag("--json", f->json, "print one JSON object");
}

}  // namespace moe::deploy
