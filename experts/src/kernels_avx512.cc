// AVX-512 expert kernels. Every function here carries its own target attribute and is only
// called after the CPU was checked (kernels.cc), so this file builds for the baseline ISA.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "moe/experts/kernels.h"
#include "silu_avx512.h"

#define MOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define MOE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define MOE_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace moe::experts::internal {
namespace {

// Software prefetch distance, in 64-byte lines: keeps more misses in flight per thread than the
// hardware prefetcher alone when one token's GEMV streams weights at memory speed.
constexpr int64_t kPrefetchLines = 16;
// And a second, further stream into L2, which has more miss slots than L1.
constexpr int64_t kFarLines = 64;

int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Lanes (2r, 2r+1) of `lo` hold row r's two partial sums, of `hi` row 8 + r: sum the pairs and
// store the 16 rows.
MOE_AVX512 inline void StorePairSums(__m512 lo, __m512 hi, float* out) {
  const __m512 sl = _mm512_add_ps(lo, _mm512_permute_ps(lo, 0xB1));
  const __m512 sh = _mm512_add_ps(hi, _mm512_permute_ps(hi, 0xB1));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(sl, even, sh));
}

// bf16 weights, fp32 activations: each 64-byte line (16 rows x 2 k) is widened to two fp32
// vectors and multiplied by the broadcast pair (x[2j], x[2j+1]) of each of MM tokens.
template <int MM>
MOE_AVX512 void Bf16F32Tile(const uint16_t* blk, int64_t lines, const Activations& a, int64_t m0, float* y,
                            int64_t ldy) {
  // Two independent accumulator sets (even and odd lines) halve the FMA dependency chains.
  __m512 lo[2][MM], hi[2][MM];
  const float* x[MM];
  for (int t = 0; t < MM; ++t) {
    lo[0][t] = lo[1][t] = hi[0][t] = hi[1][t] = _mm512_setzero_ps();
    x[t] = a.f32(m0 + t);
  }
  for (int64_t j = 0; j < lines; j += 2) {  // k_pad is a multiple of 64: lines is even
    _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kPrefetchLines) * 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kPrefetchLines + 1) * 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kFarLines) * 32), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kFarLines + 1) * 32), _MM_HINT_T1);
    for (int u = 0; u < 2; ++u) {
      const __m512i v = _mm512_load_si512(blk + (j + u) * 32);
      const __m512 wlo =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
      const __m512 whi =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      for (int t = 0; t < MM; ++t) {
        double pair;
        std::memcpy(&pair, x[t] + 2 * (j + u), 8);
        const __m512 xb = _mm512_castpd_ps(_mm512_set1_pd(pair));
        lo[u][t] = _mm512_fmadd_ps(wlo, xb, lo[u][t]);
        hi[u][t] = _mm512_fmadd_ps(whi, xb, hi[u][t]);
      }
    }
  }
  for (int t = 0; t < MM; ++t) {
    StorePairSums(_mm512_add_ps(lo[0][t], lo[1][t]), _mm512_add_ps(hi[0][t], hi[1][t]), y + t * ldy);
  }
}

template <int MM>
MOE_AVX512_BF16 void Bf16DpTile(const uint16_t* blk, int64_t lines, const Activations& a, int64_t m0, float* y,
                                int64_t ldy) {
  __m512 acc[MM];
  const uint16_t* x[MM];
  for (int t = 0; t < MM; ++t) {
    acc[t] = _mm512_setzero_ps();
    x[t] = a.bf16(m0 + t);
  }
  for (int64_t j = 0; j < lines; ++j) {
    const __m512bh v = (__m512bh)_mm512_load_si512(blk + j * 32);
    for (int t = 0; t < MM; ++t) {
      acc[t] = _mm512_dpbf16_ps(acc[t], v, (__m512bh)_mm512_set1_epi32(Load32(x[t] + 2 * j)));
    }
  }
  for (int t = 0; t < MM; ++t) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

template <int MM>
MOE_AVX512_VNNI void Int8Tile(const uint8_t* blk, int64_t lines, const float* w_scale, const Activations& a,
                              int64_t m0, float* y, int64_t ldy) {
  __m512i acc[2][MM];
  const int8_t* x[MM];
  for (int t = 0; t < MM; ++t) {
    acc[0][t] = acc[1][t] = _mm512_setzero_si512();
    x[t] = a.i8(m0 + t);
  }
  for (int64_t j = 0; j < lines; j += 2) {  // lines = k_pad / 4 is even
    _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kPrefetchLines) * 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kPrefetchLines + 1) * 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kFarLines) * 64), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kFarLines + 1) * 64), _MM_HINT_T1);
    for (int u = 0; u < 2; ++u) {
      const __m512i v = _mm512_load_si512(blk + (j + u) * 64);
      for (int t = 0; t < MM; ++t) {
        acc[u][t] = _mm512_dpbusd_epi32(acc[u][t], v, _mm512_set1_epi32(Load32(x[t] + 4 * (j + u))));
      }
    }
  }
  const __m512 ws = _mm512_loadu_ps(w_scale);
  for (int t = 0; t < MM; ++t) {
    const __m512i sum = _mm512_add_epi32(acc[0][t], acc[1][t]);
    const __m512i corrected = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * a.i8_sum(m0 + t, 0)));
    const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(a.i8_scale(m0 + t)));
    _mm512_storeu_ps(y + t * ldy, _mm512_mul_ps(_mm512_cvtepi32_ps(corrected), s));
  }
}

// int4: each 32-byte half-line unpacks to one int8 line (low nibbles: rows 0-7, high: 8-15).
template <int MM>
MOE_AVX512_VNNI void Int4Tile(const PackedMatrix& w, int64_t b, const Activations& a, int64_t m0, float* y,
                              int64_t ldy) {
  const uint8_t* blk = w.block(b);
  const int64_t group_lines = w.layout.group / 4;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m512 out[MM];
  const int8_t* x[MM];
  for (int t = 0; t < MM; ++t) {
    out[t] = _mm512_setzero_ps();
    x[t] = a.i8(m0 + t);
  }
  for (int64_t g = 0; g < w.layout.groups(); ++g) {
    __m512i acc[2][MM];
    for (int t = 0; t < MM; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_si512();
    for (int64_t j = g * group_lines; j < (g + 1) * group_lines; j += 2) {  // group_lines >= 8
      _mm_prefetch(reinterpret_cast<const char*>(blk + (j + 2 * kPrefetchLines) * 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + (j + 2 * kFarLines) * 32), _MM_HINT_T1);
      for (int u = 0; u < 2; ++u) {
        const __m256i packed = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + (j + u) * 32));
        const __m256i lo = _mm256_and_si256(packed, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        for (int t = 0; t < MM; ++t) {
          acc[u][t] = _mm512_dpbusd_epi32(acc[u][t], v, _mm512_set1_epi32(Load32(x[t] + 4 * (j + u))));
        }
      }
    }
    const __m512 scales = _mm512_loadu_ps(w.block_scales(b, g));
    for (int t = 0; t < MM; ++t) {
      const __m512i sum = _mm512_add_epi32(acc[0][t], acc[1][t]);
      const __m512i corrected = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * a.i8_sum(m0 + t, g)));
      out[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(corrected), scales, out[t]);
    }
  }
  for (int t = 0; t < MM; ++t) _mm512_storeu_ps(y + t * ldy, _mm512_mul_ps(out[t], _mm512_set1_ps(a.i8_scale(m0 + t))));
}

// Runs `tile<MM>` over every block and every group of up to kMax tokens.
template <int kMax, typename Tile>
void ForTokenGroups(const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy, Tile&& tile) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t m0 = 0; m0 < a.m(); m0 += kMax) {
      tile(b, m0, std::min<int64_t>(kMax, a.m() - m0), y + m0 * ldy + (b - b0) * 16);
    }
  }
}

}  // namespace

// Sums n floats with the same prefetch streams as the kernels: the read-bandwidth roofline.
MOE_AVX512 float SumAvx512(const float* x, int64_t n) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {  // one 256-byte step: four lines
    const char* p = reinterpret_cast<const char*>(x + i);
    for (int u = 0; u < 4; ++u) {
      _mm_prefetch(p + kPrefetchLines * 64 + u * 64, _MM_HINT_T0);
      _mm_prefetch(p + kFarLines * 64 + u * 64, _MM_HINT_T1);
      acc[u] = _mm512_add_ps(acc[u], _mm512_loadu_ps(x + i + 16 * u));
    }
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  for (; i < n; ++i) s += x[i];
  return s;
}

MOE_AVX512 float AbsMaxAvx512(const float* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, x + i)));
  }
  return _mm512_reduce_max_ps(m);
}

// q = saturate(round_even(x * inv)), clamped to [-127, 127]; sums per group of `group` values.
MOE_AVX512 void QuantizeRowAvx512(const float* x, int64_t n, float inv, int group, int8_t* q, int32_t* sums) {
  const __m512 scale = _mm512_set1_ps(inv);
  const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    const int64_t g1 = std::min<int64_t>(n, g0 + group);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = g0; i < g1; i += 16) {
      const __mmask16 mask = g1 - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (g1 - i)) - 1);
      __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), scale);
      v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
      const __m512i r = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      sum = _mm512_add_epi32(sum, r);
      _mm512_mask_cvtsepi32_storeu_epi8(q + i, mask, r);
    }
    sums[g0 / group] = _mm512_reduce_add_epi32(sum);
  }
}

MOE_AVX512 void SiluMulAvx512(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = SiluMul16(_mm512_maskz_loadu_ps(mask, gate + i), _mm512_maskz_loadu_ps(mask, up + i));
    _mm512_mask_storeu_ps(out + i, mask, v);
  }
}

void MatmulAvx512Bf16F32(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  const int64_t lines = w.layout.k_pad / 2;
  ForTokenGroups<4>(a, b0, b1, y, ldy, [&](int64_t b, int64_t m0, int64_t mm, float* out) {
    const auto* blk = reinterpret_cast<const uint16_t*>(w.block(b));
    switch (mm) {
      case 1: Bf16F32Tile<1>(blk, lines, a, m0, out, ldy); break;
      case 2: Bf16F32Tile<2>(blk, lines, a, m0, out, ldy); break;
      case 3: Bf16F32Tile<3>(blk, lines, a, m0, out, ldy); break;
      default: Bf16F32Tile<4>(blk, lines, a, m0, out, ldy); break;
    }
  });
}

void MatmulAvx512Bf16Dp(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  const int64_t lines = w.layout.k_pad / 2;
  ForTokenGroups<8>(a, b0, b1, y, ldy, [&](int64_t b, int64_t m0, int64_t mm, float* out) {
    const auto* blk = reinterpret_cast<const uint16_t*>(w.block(b));
    switch (mm) {
      case 1: Bf16DpTile<1>(blk, lines, a, m0, out, ldy); break;
      case 2: Bf16DpTile<2>(blk, lines, a, m0, out, ldy); break;
      case 3: Bf16DpTile<3>(blk, lines, a, m0, out, ldy); break;
      case 4: Bf16DpTile<4>(blk, lines, a, m0, out, ldy); break;
      default:
        for (int64_t t = 0; t < mm; t += 4) {
          if (mm - t >= 4) {
            Bf16DpTile<4>(blk, lines, a, m0 + t, out + t * ldy, ldy);
          } else {
            for (int64_t u = t; u < mm; ++u) Bf16DpTile<1>(blk, lines, a, m0 + u, out + u * ldy, ldy);
          }
        }
        break;
    }
  });
}

void MatmulVnniInt8(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  const int64_t lines = w.layout.k_pad / 4;
  ForTokenGroups<8>(a, b0, b1, y, ldy, [&](int64_t b, int64_t m0, int64_t mm, float* out) {
    const uint8_t* blk = w.block(b);
    const float* ws = w.scales() + b * 16;
    switch (mm) {
      case 1: Int8Tile<1>(blk, lines, ws, a, m0, out, ldy); break;
      case 2: Int8Tile<2>(blk, lines, ws, a, m0, out, ldy); break;
      case 3: Int8Tile<3>(blk, lines, ws, a, m0, out, ldy); break;
      case 4: Int8Tile<4>(blk, lines, ws, a, m0, out, ldy); break;
      case 8: Int8Tile<8>(blk, lines, ws, a, m0, out, ldy); break;
      default:
        for (int64_t t = 0; t < mm; ++t) Int8Tile<1>(blk, lines, ws, a, m0 + t, out + t * ldy, ldy);
        break;
    }
  });
}

void MatmulVnniInt4(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  ForTokenGroups<4>(a, b0, b1, y, ldy, [&](int64_t b, int64_t m0, int64_t mm, float* out) {
    switch (mm) {
      case 1: Int4Tile<1>(w, b, a, m0, out, ldy); break;
      case 2: Int4Tile<2>(w, b, a, m0, out, ldy); break;
      case 3: Int4Tile<3>(w, b, a, m0, out, ldy); break;
      default: Int4Tile<4>(w, b, a, m0, out, ldy); break;
    }
  });
}

}  // namespace moe::experts::internal
