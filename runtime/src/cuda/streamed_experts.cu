#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/streamed_experts.h"

namespace moe::runtime::cuda {
namespace {

// W[n][k] of a packed matrix at `m` (as experts::UnpackValue reads it).
__device__ float PackedValue(const uint8_t* m, const PackedMatrixLayout& l, int64_t n, int64_t k) {
  const uint8_t* block = m + (n / 16) * l.block_bytes;
  const int64_t r = n % 16;
  const float* scales = reinterpret_cast<const float*>(m + l.weight_bytes);
  if (l.format == 0) {
    const uint16_t bits = reinterpret_cast<const uint16_t*>(block)[(k / 2) * 32 + r * 2 + k % 2];
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
  const int64_t quad = (k / 4) * 64 + r * 4 + k % 4;
  if (l.format == 1) return (static_cast<int>(block[quad]) - 128) * scales[n];
  const uint8_t byte = block[(quad / 64) * 32 + (quad % 64) % 32];
  const int q = ((quad % 64) < 32 ? (byte & 0x0F) : (byte >> 4)) - 8;
  const int64_t groups = l.k_pad / l.group;
  return q * scales[((n / 16) * groups + k / l.group) * 16 + r];
}

__global__ void UnpackExpertsKernel(const uint8_t* __restrict__ src, int num_experts, int64_t expert_bytes,
                                    PackedMatrixLayout gate_up, int64_t gate_up_bytes, PackedMatrixLayout down,
                                    int inter, __nv_bfloat16* __restrict__ gate_up_out,
                                    __nv_bfloat16* __restrict__ down_out) {
  const int64_t h = down.n;
  const int64_t per_gate_up = 2 * int64_t{inter} * h, per_down = h * inter;
  const int64_t total = int64_t{num_experts} * (per_gate_up + per_down);
  for (int64_t o = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; o < total; o += int64_t{gridDim.x} * blockDim.x) {
    if (o < int64_t{num_experts} * per_gate_up) {
      const int64_t e = o / per_gate_up, rem = o % per_gate_up, row = rem / h, k = rem % h;
      // Row `row` of the GPU's [gate; up]: unit u's gate row is packed row (u / 16) * 32 + u % 16,
      // its up row 16 further.
      const int64_t u = row < inter ? row : row - inter;
      const int64_t n = (u / 16) * 32 + u % 16 + (row < inter ? 0 : 16);
      gate_up_out[o] = __float2bfloat16_rn(PackedValue(src + e * expert_bytes, gate_up, n, k));
    } else {
      const int64_t d = o - int64_t{num_experts} * per_gate_up;
      const int64_t e = d / per_down, rem = d % per_down, n = rem / inter, k = rem % inter;
      down_out[d] = __float2bfloat16_rn(PackedValue(src + e * expert_bytes + gate_up_bytes, down, n, k));
    }
  }
}

}  // namespace

void UnpackExperts(const uint8_t* src, int num_experts, int64_t expert_bytes, const PackedMatrixLayout& gate_up,
                   int64_t gate_up_bytes, const PackedMatrixLayout& down, int intermediate, uint16_t* gate_up_out,
                   uint16_t* down_out, cudaStream_t stream) {
  const int64_t total = int64_t{num_experts} * 3 * intermediate * down.n;
  if (total == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 132 * 32));
  UnpackExpertsKernel<<<blocks, 256, 0, stream>>>(src, num_experts, expert_bytes, gate_up, gate_up_bytes, down,
                                                  intermediate, reinterpret_cast<__nv_bfloat16*>(gate_up_out),
                                                  reinterpret_cast<__nv_bfloat16*>(down_out));
}

}  // namespace moe::runtime::cuda
