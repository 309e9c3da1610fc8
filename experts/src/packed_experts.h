// Where the expert pool's packed experts lie in its arena, and how their activations are grouped.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "moe/experts/expert_pool.h"
#include "moe/experts/packed.h"

namespace moe::experts::internal {

// Layer after layer, expert after expert: each expert's fused gate+up matrix (16 gate rows, then
// the same 16 up rows, block after block), then its down matrix.
//
// Thread-safety: a value; the matrices it names are written by the load only, then read from any
// thread.
struct PackedExperts {
  MatrixLayout gate_up, down;
  int num_experts = 0;
  // gate_up.bytes() + down.bytes(), kept: every work item of a call finds its matrix with it.
  int64_t expert_bytes = 0;
  const uint8_t* data = nullptr;  // the arena's; unowned, set once the arena exists

  PackedMatrix GateUp(int layer, int expert) const {
    const int64_t index = static_cast<int64_t>(layer) * num_experts + expert;
    return PackedMatrix{gate_up, data + index * expert_bytes};
  }
  PackedMatrix Down(int layer, int expert) const {
    const int64_t index = static_cast<int64_t>(layer) * num_experts + expert;
    return PackedMatrix{down, data + index * expert_bytes + gate_up.bytes()};
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

// Columns per quantized-sum group of the activations for a matrix.
inline int SumGroup(const MatrixLayout& l) {
  if (l.gguf_type >= 0) return 16;  // every GGUF type's groups are 16 or 32 columns
  return l.format == ExpertFormat::kInt4 ? l.group : static_cast<int>(l.k_pad);
}

}  // namespace moe::experts::internal
