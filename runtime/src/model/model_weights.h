// The model's weights as the backend holds them, and their loading from a WeightSource with
// every tensor checked against what the ModelSpec expects.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/parallel.h"

namespace moe::runtime {

namespace internal {

struct FfnWeights {  // SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused by rows
  std::unique_ptr<DeviceWeight> gate_up, down;
  int64_t width() const { return down->cols(); }
};

struct LayerWeights {
  std::unique_ptr<DeviceWeight> input_norm, post_attention_norm;
  std::unique_ptr<DeviceWeight> qkv, o;           // q, k and v projections fused by rows
  std::unique_ptr<DeviceWeight> qkv_bias;         // when spec.qkv_bias
  std::unique_ptr<DeviceWeight> q_norm, k_norm;   // when spec.qk_norm
  // MLA layers (in place of qkv): q_a_proj and its norm then q_b_proj, or q_proj alone (q_lora_rank
  // 0: mla_q_a null); kv_a_proj_with_mqa, its norm, and kv_b_proj as fp32 (the CPU backend folds it
  // into queries and outputs). A tensor split's rank holds its heads' rows of q and kv_b.
  std::unique_ptr<DeviceWeight> mla_q_a, mla_q_a_norm, mla_q, mla_kv_a, mla_kv_a_norm, mla_kv_b;
  FfnWeights dense;                               // dense layers
  std::unique_ptr<DeviceWeight> router;           // [experts x hidden]
  std::unique_ptr<DeviceWeight> correction_bias;  // [experts], sigmoid routers
  std::unique_ptr<BackendExpertWeights> experts;  // when the backend runs the routed experts (or some)
  // [1 x experts] int32: each expert's index in `experts`, or -1; only when the backend holds
  // some of a pool layer's experts.
  std::unique_ptr<DeviceBuffer> backend_index;
  std::vector<int32_t> backend_index_host;
  // [1 x experts] int32, a tensor split's layer whose routed experts run on the backend: each
  // expert's index in `experts` when this rank owns it, or -1.
  std::unique_ptr<DeviceBuffer> owner_index;
  FfnWeights shared;                          // when spec has a shared expert
  std::unique_ptr<DeviceWeight> shared_gate;  // [1 x hidden]
};

// The share of the weights a rank loads (parallel.h): its layers, and in a tensor split its shard
// of each (unset: whole layers).
struct WeightShare {
  Range layers;
  std::optional<TensorShard> tensor;
};

// Loads every tensor the checkpoint's spec needs (of `share`: the whole model by default). Errors name the tensor, its
// file, the expected and the found shape or dtype, and the config key the expectation comes from. Routed experts are
// always checked, but handed to the backend only as `backend_experts[layer]` lists them: every expert, none (the expert
// pool holds the layer), or some (the pool holds the layer, the backend these too, with a backend_index to find them).
// Progress (bytes and GB/s) goes to stderr when `progress`.
absl::StatusOr<std::unique_ptr<Model::Weights>> LoadWeights(const Checkpoint& checkpoint, Backend& backend,
                                                            const std::vector<std::vector<int>>& backend_experts,
                                                            bool progress, const WeightShare& share);

}  // namespace internal

struct Model::Weights {
  std::unique_ptr<DeviceWeight> embed, final_norm;  // null where a layer split's stage needs none
  std::unique_ptr<DeviceWeight> lm_head_owned;      // null when tied to the embedding
  const DeviceWeight* lm_head = nullptr;
  int64_t bytes = 0;                           // on the backend
  std::vector<internal::LayerWeights> layers;  // every layer's; empty outside a layer split's stage
  // An MTP head (ModelOptions::nextn_head): its norms, and eh_proj's halves (the columns that take
  // the embedding, and those that take the hidden state). final_norm is then shared_head.norm.
  std::unique_ptr<DeviceWeight> nextn_enorm, nextn_hnorm, nextn_proj_embed, nextn_proj_hidden;
  // Host copies of column slices (a tensor split's o_proj and down projections), which the CPU
  // backend's weights may point into.
  std::vector<std::vector<uint8_t>> slices;
  // Block-quantized tensors (GGUF) dequantized to f32 for a backend that keeps host pointers (the
  // CPU backend); a GPU backend's copies are dropped once uploaded.
  std::vector<std::vector<float>> expanded;
};

}  // namespace moe::runtime
