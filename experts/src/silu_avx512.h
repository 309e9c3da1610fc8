// silu(g) * u on 16 lanes, shared by the AVX-512 and AMX translation units so that every path
// that applies SwiGLU rounds the same way. Include only from code compiled for AVX-512.
#pragma once

#include <immintrin.h>

#include "moe/core/fast_exp.h"

namespace moe::experts::internal {

// e^-g = 2^t with t = -g log2 e split into round(t) (vscalefps) and a degree-6 polynomial of the
// remainder, as FastExp in kernels_portable.cc.
__attribute__((target("avx512f"), always_inline)) inline __m512 SiluMul16(__m512 g, __m512 u) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), one = _mm512_set1_ps(1.0f);
  const __m512 lo = _mm512_set1_ps(-126.0f), hi = _mm512_set1_ps(126.0f);
  const __m512 t = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(g, _mm512_sub_ps(_mm512_setzero_ps(), log2e))));
  const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, r);
  __m512 p = _mm512_set1_ps(core::kExp2Coefficients[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(core::kExp2Coefficients[i]));
  const __m512 e = _mm512_scalef_ps(p, r);  // e^-g
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
}

}  // namespace moe::experts::internal
