// The memory plan of a model before anything loads: the bytes each device needs, group by group,
// against what it has free. A plan that does not fit is refused with the numbers and the change
// that would fit (the longest context, or the most sequences, for the memory left after the
// weights); nothing spills silently.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/dtype.h"
#include "moe/experts/packed.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/placement.h"

namespace moe::runtime {

// What a GPU keeps beyond the weights, the KV cache and the step arena: the CUDA context,
// cuBLASLt's workspace, the kernels' scratch, recorded graphs and the fragmentation of many
// allocations.
constexpr int64_t kGpuHeadroomBytes = int64_t{2} << 30;

struct MemoryPlanOptions {
  int64_t context = 0;  // tokens a sequence may hold (--ctx); 0: the model's max_position_embeddings
  int max_seqs = 1;
  int max_batch_tokens = 2048;
  int max_logit_rows = 256;
  int kv_block_size = 16;
  // The GPU's KV cache: bf16, or fp8 e4m3 with a scale per position and KV head (--kv-cache-dtype).
  core::DType kv_dtype = core::DType::kBF16;
  int64_t gpu_free_bytes = 0;   // free memory of the GPU the plan is for (--gpu-memory-gb)
  int64_t host_free_bytes = 0;  // 0: the host is not checked
  // The CPU pool's packed format for the routed experts the placement puts there.
  experts::ExpertFormat host_format = experts::ExpertFormat::kBF16;
  int host_group = 32;
  // --gpu-experts-per-layer: experts of each CPU layer held on the GPU too (bf16), and the share
  // of the picks they take (by a routing profile; unset: as if routing were uniform).
  int gpu_experts_per_layer = 0;
  std::optional<double> gpu_experts_share;
  // Long prefills stream the CPU layers' experts to the GPU (--prefill-offload-tokens not 0): two
  // staging slots of a layer's packed experts and the layer unpacked to bf16.
  bool prefill_streaming = true;
};

struct MemoryLine {
  std::string what;
  int64_t bytes = 0;
};

struct DevicePlan {
  std::string device;
  std::vector<MemoryLine> lines;
  int64_t total = 0;
  int64_t free = 0;
  bool fits() const { return free <= 0 || total <= free; }
};

struct MemoryPlan {
  DevicePlan gpu;
  DevicePlan host;
  int64_t kv_bytes_per_token = 0;  // one position of one sequence, every layer, K and V
  // Weights one decode token reads (batch 1: its top-k routed experts of each layer): from host
  // memory (the pool's, in its format) and from the GPU's (bf16; the embedding row aside).
  int64_t host_read_per_token = 0;
  int64_t gpu_read_per_token = 0;
  int cpu_expert_layers = 0;  // layers whose routed experts the pool holds
  // When the GPU does not fit: why, with the largest context (at max_seqs) and the most sequences
  // (at context) that would, and with a bf16 KV cache the largest context in fp8. Empty when it
  // fits.
  std::string refusal;
};

// GPU: weights by role (from `placement`), the KV cache (options.kv_dtype) for context x max_seqs, the step
// arena at max_batch_tokens, and the backend's fixed workspaces; host: the pool's arena for the
// routed experts placed on the CPU (in options.host_format) and the pinned buffers. Only routed
// experts run on the CPU beside a GPU: other tensors placed there are counted in host memory
// (as runtime::CpuExpertLayers refuses them). kInvalidArgument for a context above the model's
// or non-positive sizes.
absl::StatusOr<MemoryPlan> PlanMemory(const ModelSpec& spec, const Placement& placement,
                                      const MemoryPlanOptions& options);

// "21.4 GiB", for the plan's lines and messages.
std::string FormatGiB(int64_t bytes);

}  // namespace moe::runtime
