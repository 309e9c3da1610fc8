#include "cpu/kernels.h"

#include <cstring>

#define MOE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

namespace moe::runtime::internal {

// Sixteen independent partial sums keep the order of additions fixed (the result does not
// depend on the variant chosen) while letting the compiler use full vectors.
MOE_CLONES float DotF32(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  float s = 0;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

MOE_CLONES float DotBf16(const float* a, const uint16_t* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      uint32_t bits = static_cast<uint32_t>(b[i + j]) << 16;
      float w;
      std::memcpy(&w, &bits, 4);
      acc[j] += a[i + j] * w;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    uint32_t bits = static_cast<uint32_t>(b[i]) << 16;
    float w;
    std::memcpy(&w, &bits, 4);
    acc[j] += a[i] * w;
  }
  float s = 0;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

MOE_CLONES void Bf16RowToF32(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&dst[i], &bits, 4);
  }
}

MOE_CLONES float SumF32(const float* x, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += x[i];
  float s = 0;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

MOE_CLONES void Axpy(float a, const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace moe::runtime::internal
