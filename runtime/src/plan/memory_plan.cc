#include "moe/runtime/memory_plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moe/core/dtype.h"
#include "moe/experts/expert_pool.h"
#include "moe/runtime/cache.h"
#include "moe/runtime/model.h"
#include "moe/runtime/weight_policy.h"

namespace moe::runtime {
namespace {

// What a tensor takes on the GPU, by the GPU's weight policy (weight_policy.h).
int64_t GpuBytes(const TensorPlace& t) {
  const core::Shape shape =
      t.rank == 1 || t.rows <= 0 ? core::Shape{t.elements} : core::Shape{t.rows, t.elements / t.rows};
  return DeviceWeightBytes(WeightHome::kGpu, WeightPolicy{}, shape, WeightFormat::Plain(core::DType::kBF16),
                           UseOf(t.kind.role, t.rank), t.kind.role);
}

std::string Thousands(int64_t v) {
  std::string digits = absl::StrCat(v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

void Add(DevicePlan* d, std::string what, int64_t bytes) {
  if (bytes <= 0) return;
  d->lines.push_back({std::move(what), bytes});
  d->total += bytes;
}

}  // namespace

std::string FormatGiB(int64_t bytes) { return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (1 << 30)); }

absl::StatusOr<MemoryPlan> PlanMemory(const ModelSpec& spec, const Placement& placement, const MemoryPlanOptions& o) {
  const int64_t context = o.context > 0 ? o.context : spec.max_position_embeddings;
  if (context > spec.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("--ctx ", context, " is above the model's max_position_embeddings (",
                                                   spec.max_position_embeddings, ")"));
  }
  if (o.max_seqs <= 0 || o.max_batch_tokens <= 0 || o.max_logit_rows <= 0 || o.kv_block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max-seqs (", o.max_seqs, "), --max-batch-tokens (",
                                                   o.max_batch_tokens, ") and the block size must be positive"));
  }
  MemoryPlan plan;
  plan.gpu.device = "GPU";
  plan.gpu.free = o.gpu_free_bytes;
  plan.host.device = "host";
  plan.host.free = o.host_free_bytes;

  std::map<TensorRole, int64_t> gpu_by_role;
  std::set<std::pair<int, int>> cpu_experts;  // (layer, expert)
  std::set<int> cpu_layers, gpu_expert_layers;
  int64_t host_other = 0, gpu_experts = 0;
  int64_t cpu_expert_stored = 0;  // the CPU experts' bytes as the checkpoint stores them
  for (const TensorPlace& t : placement.tensors) {
    // MTP / nextn layers are not loaded for the forward (speculative decoding loads them itself).
    if (t.kind.layer >= spec.num_layers) continue;
    const bool expert = t.kind.role == TensorRole::kRoutedExpert;
    if (t.device.kind == Device::Kind::kCpu) {
      if (expert) {
        // A stacked tensor (GGUF's ffn_*_exps) holds every expert of its layer.
        if (t.kind.expert >= 0) {
          cpu_experts.insert({t.kind.layer, t.kind.expert});
        } else {
          for (int e = 0; e < spec.routing.num_experts; ++e) cpu_experts.insert({t.kind.layer, e});
        }
        cpu_layers.insert(t.kind.layer);
        cpu_expert_stored += t.bytes;
      } else {
        host_other += t.bytes;
      }
      continue;
    }
    gpu_by_role[t.kind.role] += GpuBytes(t);
    if (expert) {
      gpu_experts += GpuBytes(t);
      gpu_expert_layers.insert(t.kind.layer);
    } else if (t.kind.role != TensorRole::kEmbedding) {
      plan.gpu_read_per_token += GpuBytes(t);
    }
  }
  for (const auto& [role, bytes] : gpu_by_role)
    Add(&plan.gpu, absl::StrCat("weights: ", std::string(TensorRoleName(role))), bytes);
  // Per token, each layer reads its top-k routed experts: an average GPU-held expert's bf16
  // bytes, or the pool's packed ones.
  const int k = spec.routing.top_k;
  if (!gpu_expert_layers.empty() && spec.routing.num_experts > 0) {
    plan.gpu_read_per_token += gpu_experts / static_cast<int64_t>(gpu_expert_layers.size()) / spec.routing.num_experts *
                               k * static_cast<int64_t>(gpu_expert_layers.size());
  }
  int64_t pool_bytes = 0;
  if (!cpu_experts.empty()) {
    experts::ExpertShape shape;
    shape.num_layers = 1;
    shape.num_experts = spec.routing.num_experts;
    shape.top_k = k;
    shape.hidden = spec.hidden_size;
    shape.intermediate = spec.moe_intermediate_size;
    // Native: the file's blocks as they are (packed.h), so the stored bytes.
    absl::StatusOr<int64_t> per_expert =
        o.host_format == experts::ExpertFormat::kNative
            ? absl::StatusOr<int64_t>(cpu_expert_stored / static_cast<int64_t>(cpu_experts.size()))
            : experts::PackedExpertBytes(shape, o.host_format, o.host_group);
    if (!per_expert.ok()) return per_expert.status();
    pool_bytes = *per_expert * static_cast<int64_t>(cpu_experts.size());
    plan.host_read_per_token = *per_expert * k * static_cast<int64_t>(cpu_layers.size());
  }
  plan.cpu_expert_layers = static_cast<int>(cpu_layers.size());
  int64_t streaming = 0;
  // The GPU unpacks the pool's bf16, int8 and int4 layers; GGUF ones stay on the CPU for prefill.
  const bool streams = o.host_format == experts::ExpertFormat::kBF16 || o.host_format == experts::ExpertFormat::kInt8 ||
                       o.host_format == experts::ExpertFormat::kInt4;
  if (o.prefill_streaming && streams && !cpu_layers.empty() && spec.routing.num_experts > 0) {
    const int64_t packed_layer = pool_bytes / static_cast<int64_t>(cpu_layers.size());
    const int64_t bf16_layer =
        int64_t{spec.routing.num_experts} * 3 * spec.hidden_size * spec.moe_intermediate_size * 2;
    streaming = 2 * packed_layer + bf16_layer;
    Add(&plan.gpu, "prefill streaming: two packed CPU layers and one in bf16", streaming);
  }
  if (o.gpu_experts_per_layer > 0 && !cpu_layers.empty() && spec.routing.num_experts > 0) {
    const int n = std::min(o.gpu_experts_per_layer, spec.routing.num_experts);
    const int64_t expert_bf16 = 3 * int64_t{spec.hidden_size} * spec.moe_intermediate_size * 2;
    Add(&plan.gpu, absl::StrCat("weights: routed experts held on the GPU too (", n, " of each CPU layer)"),
        expert_bf16 * n * static_cast<int64_t>(cpu_layers.size()));
    const double share = o.gpu_experts_share.value_or(static_cast<double>(n) / spec.routing.num_experts);
    const int64_t moved = static_cast<int64_t>(share * static_cast<double>(plan.host_read_per_token));
    plan.host_read_per_token -= moved;
    plan.gpu_read_per_token += static_cast<int64_t>(share * k * static_cast<double>(cpu_layers.size()) * expert_bf16);
  }

  if (o.kv_dtype != core::DType::kBF16 && o.kv_dtype != core::DType::kF8E4M3) {
    return absl::InvalidArgumentError(
        absl::StrCat("a GPU's KV cache is bf16 or fp8, not ", core::DTypeName(o.kv_dtype)));
  }
  auto kv_per_token = [&](core::DType dtype) {
    return PlanCache(spec, Range{0, spec.num_layers}, CacheOptions{o.kv_block_size, dtype}).BytesPerToken();
  };
  plan.kv_bytes_per_token = kv_per_token(o.kv_dtype);
  const int64_t logit_rows = std::min(o.max_logit_rows, o.max_batch_tokens);
  auto kv_bytes_in = [&](core::DType dtype, int64_t ctx, int64_t seqs) {
    return (seqs * BlocksFor(ctx, o.kv_block_size) + 1) * kv_per_token(dtype) * o.kv_block_size;  // + scratch
  };
  auto kv_bytes = [&](int64_t ctx, int64_t seqs) { return kv_bytes_in(o.kv_dtype, ctx, seqs); };
  auto arena_bytes = [&](int64_t ctx) {
    return Model::StepArenaBytes(spec, core::DType::kBF16, o.max_batch_tokens, logit_rows, static_cast<int>(ctx)).total;
  };
  const int64_t weights = plan.gpu.total;
  auto gpu_total_in = [&](core::DType dtype, int64_t ctx, int64_t seqs) {
    return weights + kv_bytes_in(dtype, ctx, seqs) + arena_bytes(ctx) + kGpuHeadroomBytes;
  };
  auto gpu_total = [&](int64_t ctx, int64_t seqs) { return gpu_total_in(o.kv_dtype, ctx, seqs); };
  const int64_t kv = kv_bytes(context, o.max_seqs);
  Add(&plan.gpu,
      absl::StrCat("KV cache (", o.kv_dtype == core::DType::kF8E4M3 ? "fp8" : "bf16", "): ", o.max_seqs, " x ",
                   Thousands(context), " positions"),
      kv);
  Add(&plan.gpu, absl::StrCat("step activations: ", o.max_batch_tokens, " tokens"), arena_bytes(context));
  Add(&plan.gpu, "CUDA context, cuBLASLt workspace, graphs and scratch (allowance)", kGpuHeadroomBytes);

  Add(&plan.host,
      absl::StrCat("routed experts on the CPU: ", cpu_experts.size(), " in the pool's ",
                   experts::FormatName(o.host_format), " arena"),
      pool_bytes);
  Add(&plan.host, "other tensors placed on the CPU (as stored)", host_other);
  Add(&plan.host, "pinned logits", int64_t{logit_rows} * spec.vocab_size * 4);
  if (!cpu_experts.empty()) {
    // A step's hidden states and sums (fp32) and its top-k ids and weights, mapped for the GPU.
    Add(&plan.host, "pinned buffers of the routed experts on the CPU",
        int64_t{o.max_batch_tokens} * (2 * spec.hidden_size * 4 + 2 * k * 4));
  }

  if (!plan.gpu.fits()) {
    const int64_t block = o.kv_block_size;
    if (gpu_total(block, 1) > plan.gpu.free) {
      // What would fit: experts still on the GPU can move; the streaming buffers can go.
      const bool experts_on_gpu = gpu_by_role.count(TensorRole::kRoutedExpert) > 0;
      plan.refusal = absl::StrCat("the GPU needs ", FormatGiB(plan.gpu.total), " and has ", FormatGiB(plan.gpu.free),
                                  " free; the weights and buffers alone take ", FormatGiB(gpu_total(block, 1)));
      if (experts_on_gpu)
        absl::StrAppend(&plan.refusal, ": put routed experts on the CPU (--cpu-moe or --n-cpu-moe N)");
      if (streaming > 0) {
        absl::StrAppend(&plan.refusal, experts_on_gpu ? ", or" : ":", " --prefill-offload-tokens 0 frees the ",
                        FormatGiB(streaming), " of prefill streaming buffers");
      }
      if (!experts_on_gpu && streaming == 0) absl::StrAppend(&plan.refusal, ": this GPU is too small for the model");
    } else {
      // The longest context (a whole number of blocks) at max_seqs, and the most sequences at
      // the asked context, each the largest that fits.
      // Blocks per sequence: lo fits, hi does not.
      auto longest = [&](core::DType dtype) {
        int64_t lo = 0, hi = BlocksFor(context, block) + 1;
        while (hi - lo > 1) {
          const int64_t mid = (lo + hi) / 2;
          (gpu_total_in(dtype, mid * block, o.max_seqs) <= plan.gpu.free ? lo : hi) = mid;
        }
        return std::min(lo * block, context);
      };
      const int64_t lo = longest(o.kv_dtype) / block;
      int64_t seqs_lo = 0, seqs_hi = o.max_seqs;
      while (seqs_hi - seqs_lo > 1) {
        const int64_t mid = (seqs_lo + seqs_hi) / 2;
        (gpu_total(context, mid) <= plan.gpu.free ? seqs_lo : seqs_hi) = mid;
      }
      plan.refusal = absl::StrCat(
          "ctx ", Thousands(context), " x ", o.max_seqs, " sequence", o.max_seqs == 1 ? "" : "s", " needs ",
          FormatGiB(kv), " of KV cache and the GPU has ", FormatGiB(plan.gpu.free - (plan.gpu.total - kv)),
          " left after the weights and buffers: the largest context that fits is ", Thousands(lo * block), " (--ctx)");
      if (seqs_lo >= 1) {
        absl::StrAppend(&plan.refusal, ", or ", seqs_lo, " sequence", seqs_lo == 1 ? "" : "s", " at ",
                        Thousands(context), " (--max-seqs)");
      }
      if (o.kv_dtype == core::DType::kBF16) {
        const int64_t fp8 = longest(core::DType::kF8E4M3);
        if (fp8 >= context) {
          absl::StrAppend(&plan.refusal, ", or --kv-cache-dtype fp8, with which ctx ", Thousands(context), " fits");
        } else {
          absl::StrAppend(&plan.refusal, ", or --kv-cache-dtype fp8, with which the largest context is ",
                          Thousands(fp8));
        }
      }
    }
  }
  return plan;
}

}  // namespace moe::runtime
