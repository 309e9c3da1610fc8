// Plain CPU loops shared by the CPU backend and the reference routed experts: fp32 dot products
// from fp32 or bf16 operands. Compiled for AVX-512, AVX2+FMA and a portable baseline; the
// loader picks the variant the CPU supports. Memory-bandwidth bound for one token.
#pragma once

#include <cstdint>

namespace moe::runtime::internal {

float DotF32(const float* a, const float* b, int64_t n);
float DotBf16(const float* a, const uint16_t* b, int64_t n);
// dst[i] = float(src[i])
void Bf16RowToF32(const uint16_t* src, int64_t n, float* dst);
// y[i] += a * x[i]
void Axpy(float a, const float* x, int64_t n, float* y);
// The sum of x[0..n), in sixteen partial sums: a read at memory speed (the roofline's probe).
float SumF32(const float* x, int64_t n);

}  // namespace moe::runtime::internal
