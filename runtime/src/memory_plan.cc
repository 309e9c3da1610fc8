#include "moe/runtime/memory_plan.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moe/core/dtype.h"
#include "moe/runtime/kv_cache.h"
#include "moe/runtime/model.h"

namespace moe::runtime {
namespace {

// On a GPU matrices are bf16 and vectors (norms, biases) fp32, whatever the checkpoint holds.
int64_t GpuBytes(const TensorPlace& t) { return t.elements * (t.rank == 1 ? 4 : 2); }

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
  int64_t host_experts = 0;
  for (const TensorPlace& t : placement.tensors) {
    if (t.device.kind == Device::Kind::kCpu) {
      host_experts += t.elements * 2;  // the pool's bf16 packing
    } else {
      gpu_by_role[t.kind.role] += GpuBytes(t);
    }
  }
  for (const auto& [role, bytes] : gpu_by_role)
    Add(&plan.gpu, absl::StrCat("weights: ", std::string(TensorRoleName(role))), bytes);

  plan.kv_bytes_per_token =
      int64_t{spec.num_layers} * 2 * spec.num_kv_heads * spec.head_dim * core::DTypeSize(core::DType::kBF16);
  const int64_t block_bytes = plan.kv_bytes_per_token * o.kv_block_size;
  const int64_t logit_rows = std::min(o.max_logit_rows, o.max_batch_tokens);
  auto kv_bytes = [&](int64_t ctx, int64_t seqs) {
    return (seqs * BlocksFor(ctx, o.kv_block_size) + 1) * block_bytes;  // + the scratch block
  };
  auto arena_bytes = [&](int64_t ctx) {
    return Model::StepArenaBytes(spec, core::DType::kBF16, o.max_batch_tokens, logit_rows, static_cast<int>(ctx)).total;
  };
  const int64_t weights = plan.gpu.total;
  auto gpu_total = [&](int64_t ctx, int64_t seqs) {
    return weights + kv_bytes(ctx, seqs) + arena_bytes(ctx) + kGpuHeadroomBytes;
  };
  const int64_t kv = kv_bytes(context, o.max_seqs);
  Add(&plan.gpu, absl::StrCat("KV cache (bf16): ", o.max_seqs, " x ", Thousands(context), " positions"), kv);
  Add(&plan.gpu, absl::StrCat("step activations: ", o.max_batch_tokens, " tokens"), arena_bytes(context));
  Add(&plan.gpu, "CUDA context, cuBLASLt workspace, graphs and scratch (allowance)", kGpuHeadroomBytes);

  Add(&plan.host, "routed experts on the CPU (bf16 arena)", host_experts);
  Add(&plan.host, "pinned logits", int64_t{logit_rows} * spec.vocab_size * 4);

  if (!plan.gpu.fits()) {
    const int64_t block = o.kv_block_size;
    if (gpu_total(block, 1) > plan.gpu.free) {
      plan.refusal = absl::StrCat("the GPU needs ", FormatGiB(plan.gpu.total), " and has ", FormatGiB(plan.gpu.free),
                                  " free; the weights and buffers alone take ", FormatGiB(gpu_total(block, 1)),
                                  ": put routed experts on the CPU (--cpu-moe or --n-cpu-moe N)");
    } else {
      // The longest context (a whole number of blocks) at max_seqs, and the most sequences at
      // the asked context, each the largest that fits.
      int64_t lo = 0, hi = BlocksFor(context, block);  // blocks per sequence: lo fits, hi does not
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        (gpu_total(mid * block, o.max_seqs) <= plan.gpu.free ? lo : hi) = mid;
      }
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
    }
  }
  return plan;
}

}  // namespace moe::runtime
