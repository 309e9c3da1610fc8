// The MoE block of a layer: router, routed experts (on the backend or in the CPU expert pool)
// and shared experts, which run while the routed ones are computed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model_weights.h"
#include "moe/experts/expert_pool.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/model.h"
#include "moe/runtime/weight_source.h"

namespace moe::runtime::internal {

// The step's buffers a MoE block or dense FFN works in, carved from the arena once per step.
struct FfnBuffers {
  Tensor gate_up;        // [T x 2 W] activation dtype, W the widest FFN (dense or shared)
  Tensor act;            // [T x W] activation dtype
  Tensor router_logits;  // [T x E] fp32
  Tensor ids;            // [T x top_k] int32
  Tensor weights;        // [T x top_k] fp32
  Tensor shared;         // [T x hidden] fp32
  Tensor shared_gate;    // [T x 1] fp32
  // A pool layer with some experts on the backend too: each side's picks, and the backend's sum.
  Tensor split_host_ids, split_backend_ids;          // [T x top_k] int32
  Tensor split_host_weights, split_backend_weights;  // [T x top_k] fp32
  Tensor split_out;                                  // [T x hidden] fp32
};

// Where a MoE block counts its router's picks (the experts a backend holds chosen while serving):
// the step, the cache's scratch block (padding rows) and the layer's row of counts [1 x E] int32.
// No step: nothing is counted.
struct PickCounter {
  const StepTensors* step = nullptr;
  int scratch_block = 0;
  Tensor counts;
};

// out [T x hidden] fp32 = down(silu(gate(x)) * up(x)); x activation dtype.
void RunFfn(Backend& b, const FfnWeights& w, const Tensor& x, const FfnBuffers& buf, const Tensor& out);

// out = routed experts + shared experts of x for MoE layer `layer`.
absl::Status RunMoe(Backend& b, const ModelSpec& spec, const LayerWeights& lw, RoutedExperts& routed, int layer,
                    const Tensor& x, const FfnBuffers& buf, const Tensor& out, const PickCounter& counter = {});

// Routed experts of every MoE layer: the layers of `pool_layers` (model layer indexes, in the
// pool's order) in `pool`, the others on the backend (MoeExperts). On a backend whose memory the
// CPU cannot address, the pool's layers go through its host calls (StartHostExperts).
// `defer_experts` > 0: expert deferral (ModelOptions::defer_experts). `shard` (a tensor split's,
// or null): the pool computes only the experts this rank owns.
std::unique_ptr<RoutedExperts> MakeRoutedExperts(Backend& backend, const Model::Weights& weights, const ModelSpec& spec,
                                                 experts::ExpertPool* pool, const std::vector<int>& pool_layers,
                                                 int defer_experts, const TensorShard* shard);

// Packs the routed experts of the model layers `moe_layers` into a new CPU expert pool.
absl::StatusOr<std::unique_ptr<experts::ExpertPool>> CreatePool(const Checkpoint& checkpoint,
                                                                experts::ExpertPoolOptions options,
                                                                const std::vector<int>& moe_layers);

}  // namespace moe::runtime::internal
