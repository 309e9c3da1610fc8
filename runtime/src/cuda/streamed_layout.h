// The CPU pool's packed-matrix layout (experts/packed.h) as the GPU's unpacking kernel takes it
// (cuda/streamed_experts.h, which needs no experts header).
#pragma once

#include "cuda/streamed_experts.h"
#include "moe/experts/packed.h"

namespace moe::runtime::cuda {

inline PackedMatrixLayout ToPackedMatrixLayout(const experts::MatrixLayout& m) {
  PackedMatrixLayout p;
  p.format = m.format == experts::ExpertFormat::kBF16 ? 0 : m.format == experts::ExpertFormat::kInt8 ? 1 : 2;
  p.n = m.n;
  p.k = m.k;
  p.n_pad = m.n_pad;
  p.k_pad = m.k_pad;
  p.group = m.group;
  p.block_bytes = m.block_bytes();
  p.weight_bytes = m.weight_bytes();
  return p;
}

}  // namespace moe::runtime::cuda
