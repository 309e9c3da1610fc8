// A 16 x 16 transpose of 32-bit values in AVX-512 registers, shared by the packers (packed.cc)
// and the GGUF kernels (kernels_gguf.cc), which both turn 16 rows into the kernels' 64-byte lines.
#pragma once

#include <immintrin.h>

namespace moe::experts::internal {

// Transposes 16 x 16 dwords: v[i] holds row i; afterwards v[j] holds column j.
__attribute__((target("avx512f"))) inline void Transpose16x16(__m512i v[16]) {
  __m512i t[16], u[16];
  // Within each 128-bit lane L (columns 4L .. 4L+3): pairs of rows, then quads of rows.
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);      // rows i, i+1 of columns 4L, 4L+1
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);  // of columns 4L+2, 4L+3
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);  // lane L: column 4L of rows i .. i+3
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Column 4L + c is lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    v[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    v[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    v[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    v[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

}  // namespace moe::experts::internal
