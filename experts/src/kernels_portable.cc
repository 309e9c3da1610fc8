// The portable code paths: the reference kernel that every fast one is tested against, and the
// element-wise steps around the kernels (SiLU times up, the weighted sums of expert rows). Their
// AVX-512 forms are in kernels_avx512.cc.
#include <algorithm>
#include <cstring>

#include "moe/core/cpu_features.h"
#include "moe/core/dtype.h"
#include "moe/core/fast_exp.h"
#include "moe/experts/kernels.h"
#include "target_clones.h"

namespace moe::experts {
namespace {

// e^x for x in about [-87, 88]: 2^(x log2 e) split into 2^n (exponent bits) and 2^f, f in
// [-0.5, 0.5], by a degree-6 polynomial; relative error about 1e-7. Vectorizes, unlike expf.
inline float FastExp(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float t = x * 1.44269504088896341f;
  const float n = __builtin_roundevenf(t);
  const float f = t - n;
  const float p = core::Exp2Fraction(f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace

void SiluMul(const float* gate, const float* up, int64_t n, float* out) {
  static const bool avx512 = core::GetCpuFeatures().avx512f;
  if (avx512) return internal::SiluMulAvx512(gate, up, n, out);
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + FastExp(-gate[i])) * up[i];
}

// One compiled copy (per CPU), so every caller rounds the same way.
MOE_CLONES void SumScaledRows(const float* const* rows, const float* weights, int count, int64_t n, float* dst) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    float acc[16] = {};
    for (int i = 0; i < count; ++i) {
      const float* src = rows[i] + c;
      __builtin_prefetch(src + 256);  // 1 KB ahead in each row: the rows are seldom in L2
      const float w = weights[i];
      for (int j = 0; j < 16; ++j) acc[j] += w * src[j];
    }
    for (int j = 0; j < 16; ++j) dst[c + j] = acc[j];
  }
  for (; c < n; ++c) {
    float acc = 0;
    for (int i = 0; i < count; ++i) acc += weights[i] * rows[i][c];
    dst[c] = acc;
  }
}

namespace internal {

// The reference for every kernel: the same products as the fast kernels, one at a time.
void MatmulPortable(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  const MatrixLayout& l = w.layout;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* block = w.block(b);
    for (int64_t m = 0; m < a.m(); ++m) {
      float* out = y + m * ldy + (b - b0) * 16;
      for (int r = 0; r < 16; ++r) {
        const int64_t n = b * 16 + r;
        switch (l.format) {
          case ExpertFormat::kBF16: {
            const uint16_t* wb = reinterpret_cast<const uint16_t*>(block);
            const float* x = a.f32(m);
            float acc = 0;
            for (int64_t k = 0; k < l.k_pad; ++k) acc += x[k] * core::Bf16ToFloat(wb[(k / 2) * 32 + r * 2 + k % 2]);
            out[r] = acc;
            break;
          }
          case ExpertFormat::kInt8: {
            const int8_t* x = a.i8(m);
            int32_t acc = 0;
            for (int64_t k = 0; k < l.k_pad; ++k) acc += block[(k / 4) * 64 + r * 4 + k % 4] * x[k];
            acc -= 128 * a.i8_sum(m, 0);
            out[r] = static_cast<float>(acc) * w.scales()[n] * a.i8_scale(m);
            break;
          }
          case ExpertFormat::kInt4: {
            const int8_t* x = a.i8(m);
            float acc = 0;
            for (int64_t g = 0; g < l.groups(); ++g) {
              int32_t part = 0;
              for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) {
                const int64_t i = (k % 4) + r * 4;  // position among the 64 values of line k / 4
                const uint8_t byte = block[(k / 4) * 32 + i % 32];
                part += (i < 32 ? (byte & 0x0F) : (byte >> 4)) * x[k];
              }
              part -= 8 * a.i8_sum(m, g);
              acc += static_cast<float>(part) * w.block_scales(b, g)[r];
            }
            out[r] = acc * a.i8_scale(m);
            break;
          }
          default:  // GGUF formats have their own kernels (kernels_gguf.cc)
            break;
        }
      }
    }
  }
}

}  // namespace internal
}  // namespace moe::experts
