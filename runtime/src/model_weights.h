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

struct FfnWeights {  // SwiGLU: down(silu(gate(x)) * up(x))
  std::unique_ptr<DeviceWeight> gate, up, down;
  int64_t width() const { return gate->rows(); }
};

struct LayerWeights {
  std::unique_ptr<DeviceWeight> input_norm, post_attention_norm;
  std::unique_ptr<DeviceWeight> q, k, v, o;
  std::unique_ptr<DeviceWeight> q_bias, k_bias, v_bias;  // when spec.qkv_bias
  std::unique_ptr<DeviceWeight> q_norm, k_norm;          // when spec.qk_norm
  FfnWeights dense;                                      // dense layers
  std::unique_ptr<DeviceWeight> router;                  // [experts x hidden]
  std::vector<float> correction_bias;                    // host copy, sigmoid routers
  std::vector<FfnWeights> experts;
  FfnWeights shared;                                     // when spec has a shared expert
  std::unique_ptr<DeviceWeight> shared_gate;             // [1 x hidden]
};

// Loads every tensor the spec needs. Errors name the tensor, its file, the expected and the
// found shape or dtype, and the config key the expectation comes from. Routed experts are always
// checked, but handed to the backend only when `prepare_routed_experts` (the expert pool holds
// them otherwise).
absl::StatusOr<std::unique_ptr<Model::Weights>> LoadWeights(const ModelSpec& spec, const WeightSource& source,
                                                            Backend& backend, bool prepare_routed_experts);

}  // namespace internal

struct Model::Weights {
  std::unique_ptr<DeviceWeight> embed, final_norm, lm_head;
  std::vector<internal::LayerWeights> layers;
};

}  // namespace moe::runtime
