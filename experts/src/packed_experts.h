// Where the expert pool's packed experts lie in its arena, and how their activations are grouped.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/experts/expert_pool.h"
#include "moe/experts/packed.h"

namespace moe::experts::internal {

// Layer after layer, expert after expert: each expert's fused gate+up matrix (16 gate rows, then
// the same 16 up rows, block after block), then its down matrix.
//
// Thread-safety: a value; the matrices it names are written by the load only, then read from any
// thread.
//
// Layers laid out differently (native GGUF types: a Q4_K_M file's down matrices are Q6_K in some
// layers, Q4_K in others) have one LayerLayout each; a call works on ForLayer(layer), whose
// gate_up, down and expert_bytes are its layer's.
struct LayerLayout {
  MatrixLayout gate_up, down;
  int64_t expert_bytes = 0;  // gate_up.bytes() + down.bytes()
  int64_t offset = 0;        // of the layer's first expert in the arena
};

struct PackedExperts {
  MatrixLayout gate_up, down;  // every layer's, or (ForLayer) one layer's
  int num_experts = 0;
  // gate_up.bytes() + down.bytes(), kept: every work item of a call finds its matrix with it.
  int64_t expert_bytes = 0;
  const uint8_t* data = nullptr;  // the arena's; unowned, set once the arena exists
  std::shared_ptr<const std::vector<LayerLayout>> layers;  // null: every layer alike

  PackedMatrix GateUp(int layer, int expert) const {
    if (layers != nullptr) {
      const LayerLayout& l = (*layers)[layer];
      return PackedMatrix{l.gate_up, data + l.offset + expert * l.expert_bytes};
    }
    const int64_t index = static_cast<int64_t>(layer) * num_experts + expert;
    return PackedMatrix{gate_up, data + index * expert_bytes};
  }
  PackedMatrix Down(int layer, int expert) const {
    if (layers != nullptr) {
      const LayerLayout& l = (*layers)[layer];
      return PackedMatrix{l.down, data + l.offset + expert * l.expert_bytes + l.gate_up.bytes()};
    }
    const int64_t index = static_cast<int64_t>(layer) * num_experts + expert;
    return PackedMatrix{down, data + index * expert_bytes + gate_up.bytes()};
  }
  // This value with gate_up, down and expert_bytes those of `layer`.
  PackedExperts ForLayer(int layer) const {
    PackedExperts p = *this;
    if (layers != nullptr) {
      const LayerLayout& l = (*layers)[layer];
      p.gate_up = l.gate_up;
      p.down = l.down;
      p.expert_bytes = l.expert_bytes;
    }
    return p;
  }
  // Bytes of every expert of `num_layers` layers.
  int64_t TotalBytes(int num_layers) const {
    if (layers == nullptr) return static_cast<int64_t>(num_layers) * num_experts * expert_bytes;
    const LayerLayout& last = layers->back();
    return last.offset + num_experts * last.expert_bytes;
  }
};

// The layouts for `shape` in `format` (int4 in groups of `group`), before the arena exists: the
// intermediate rows padded to whole blocks, so that gate and up blocks pair. kInvalidArgument for
// a group the format cannot take.
inline absl::StatusOr<PackedExperts> LayOutExperts(const ExpertShape& shape, ExpertFormat format, int group) {
  const int64_t inter_pad = (shape.intermediate + 15) / 16 * 16;
  auto gate_up = MakeLayout(format, 2 * inter_pad, shape.hidden, group);
  if (!gate_up.ok()) return gate_up.status();
  auto down = MakeLayout(format, shape.hidden, shape.intermediate, group);
  if (!down.ok()) return down.status();
  PackedExperts experts;
  experts.gate_up = *gate_up;
  experts.down = *down;
  experts.num_experts = shape.num_experts;
  experts.expert_bytes = gate_up->bytes() + down->bytes();
  return experts;
}

// The layouts of each layer, with formats[l] = {gate and up's, down's} (GGUF formats: native).
// Uniform (layers null) when every layer has the same formats.
inline absl::StatusOr<PackedExperts> LayOutExpertsPerLayer(const ExpertShape& shape,
                                                           const std::vector<std::pair<ExpertFormat, ExpertFormat>>& formats) {
  const int64_t inter_pad = (shape.intermediate + 15) / 16 * 16;
  auto layers = std::make_shared<std::vector<LayerLayout>>();
  int64_t offset = 0;
  bool uniform = true;
  for (const auto& [gu_format, down_format] : formats) {
    auto gate_up = MakeLayout(gu_format, 2 * inter_pad, shape.hidden);
    if (!gate_up.ok()) return gate_up.status();
    auto down = MakeLayout(down_format, shape.hidden, shape.intermediate);
    if (!down.ok()) return down.status();
    LayerLayout l{*gate_up, *down, gate_up->bytes() + down->bytes(), offset};
    offset += l.expert_bytes * shape.num_experts;
    uniform = uniform && formats.front() == std::pair{gu_format, down_format};
    layers->push_back(l);
  }
  PackedExperts experts;
  experts.gate_up = layers->front().gate_up;
  experts.down = layers->front().down;
  experts.num_experts = shape.num_experts;
  experts.expert_bytes = layers->front().expert_bytes;
  if (!uniform) experts.layers = std::move(layers);
  return experts;
}

// Columns per quantized-sum group of the activations for a matrix.
inline int SumGroup(const MatrixLayout& l) {
  if (l.gguf_type >= 0) return 16;  // every GGUF type's groups are 16 or 32 columns
  return l.format == ExpertFormat::kInt4 ? l.group : static_cast<int>(l.k_pad);
}

}  // namespace moe::experts::internal
