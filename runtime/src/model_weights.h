// The model's weights as the backend holds them, and their loading from a WeightSource with
// every tensor checked against what the ModelSpec expects.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/weight_source.h"

namespace moe::runtime {

namespace internal {

struct FfnWeights {  // SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused by rows
  std::unique_ptr<DeviceWeight> gate_up, down;
  int64_t width() const { return down->cols(); }
};

struct LayerWeights {
  std::unique_ptr<DeviceWeight> input_norm, post_attention_norm;
  std::unique_ptr<DeviceWeight> qkv, o;        // q, k and v projections fused by rows
  std::unique_ptr<DeviceWeight> qkv_bias;      // when spec.qkv_bias
  std::unique_ptr<DeviceWeight> q_norm, k_norm;  // when spec.qk_norm
  FfnWeights dense;                            // dense layers
  std::unique_ptr<DeviceWeight> router;        // [experts x hidden]
  std::unique_ptr<DeviceWeight> correction_bias;  // [experts], sigmoid routers
  std::unique_ptr<DeviceExperts> experts;         // when the backend runs the routed experts (or some)
  // [1 x experts] int32: each expert's index in `experts`, or -1; only when the backend holds
  // some of a pool layer's experts.
  std::unique_ptr<DeviceBuffer> backend_index;
  std::vector<int32_t> backend_index_host;
  FfnWeights shared;                           // when spec has a shared expert
  std::unique_ptr<DeviceWeight> shared_gate;   // [1 x hidden]
};

// Loads every tensor the spec needs. Errors name the tensor, its file, the expected and the
// found shape or dtype, and the config key the expectation comes from. Routed experts are always
// checked, but handed to the backend only as `backend_experts[layer]` lists them: every expert,
// none (the expert pool holds the layer), or some (the pool holds the layer, the backend these
// too, with a backend_index to find them). Progress (bytes and GB/s) goes to stderr when `progress`.
absl::StatusOr<std::unique_ptr<Model::Weights>> LoadWeights(const ModelSpec& spec, const WeightSource& source,
                                                            Backend& backend,
                                                            const std::vector<std::vector<int>>& backend_experts,
                                                            bool progress);

}  // namespace internal

struct Model::Weights {
  std::unique_ptr<DeviceWeight> embed, final_norm;
  std::unique_ptr<DeviceWeight> lm_head_owned;  // null when tied to the embedding
  const DeviceWeight* lm_head = nullptr;
  int64_t bytes = 0;  // on the backend
  std::vector<internal::LayerWeights> layers;
};

}  // namespace moe::runtime
