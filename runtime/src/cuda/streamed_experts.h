// Hybrid prefill: a layer of routed experts packed for the CPU (the expert pool's arena,
// experts/packed.h), copied to the GPU as it lies, turned into the bf16 layout the GPU's MoE
// kernels read. Launchers only enqueue on `stream`, as in ops.h.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace moe::runtime::cuda {

// One packed matrix's layout (experts::MatrixLayout, without its header): format 0 bf16, 1 int8,
// 2 int4.
struct PackedMatrixLayout {
  int format = 0;
  int64_t n = 0, k = 0, n_pad = 0, k_pad = 0;
  int group = 32;
  int64_t block_bytes = 0, weight_bytes = 0;
};

// `num_experts` experts packed `expert_bytes` apart from `src` (device memory), each a fused
// gate+up matrix (`gate_up`: 16-row blocks alternating gate and up rows of 16 units) then a down
// matrix at gate_up_bytes, into gate_up_out [E][2 I][H] (gate rows, then up rows) and down_out
// [E][H][I], bf16. I = intermediate (a multiple of 16), H = down.n.
void UnpackExperts(const uint8_t* src, int num_experts, int64_t expert_bytes, const PackedMatrixLayout& gate_up,
                   int64_t gate_up_bytes, const PackedMatrixLayout& down, int intermediate, uint16_t* gate_up_out,
                   uint16_t* down_out, cudaStream_t stream);

}  // namespace moe::runtime::cuda
