// The polynomial of the CPU kernels' exponentials (the experts' SiLU, the CPU backend's attention):
// e^x = 2^t, t = x log2(e), is 2^round(t) (exponent bits) times 2^f for the rest f in [-0.5, 0.5],
// which this degree-6 polynomial gives to a relative error of about 1e-7. One set of coefficients,
// so that every path rounds alike.
#pragma once

namespace moe::core {

// 2^f = sum_i kExp2Coefficients[i] f^i on [-0.5, 0.5].
inline constexpr float kExp2Coefficients[7] = {1.0f,          6.9314720e-1f, 2.4022652e-1f, 5.5503361e-2f,
                                               9.6182458e-3f, 1.3398874e-3f, 1.5353362e-4f};

// 2^f by Horner's rule, lane by lane: T is float or a GCC vector of floats.
template <typename T>
[[gnu::always_inline]] inline T Exp2Fraction(T f) {
  T p = f * kExp2Coefficients[6] + kExp2Coefficients[5];
  for (int i = 4; i >= 0; --i) p = p * f + kExp2Coefficients[i];
  return p;
}

}  // namespace moe::core
