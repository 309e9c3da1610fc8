// fp8 expert kernels (packed.h, fp8_lines.h): e4m3 codes times fp32 scales per row and group.
//
// portable:    fp32 activations times each code's value, summed per group, times the group's
//              scale: the reference.
// avx512bf16:  each 64-byte line (16 rows x 4 k) widened to two vectors of bf16 pairs in
//              registers (two byte permutes through a 128-entry table, the sign ORed back, two
//              unpacks; e4m3 is exact in bf16) and multiplied (vdpbf16ps) by the activations split
//              in two bf16 terms, hi = bf16(x) and lo = bf16(x - hi), as AMX's bf16 kernel takes
//              them: about 16 mantissa bits, where bf16 activations alone moved the fixtures'
//              logits by 6% of their range. fp32 sums per group times the group's 16 scales. At
//              few tokens it streams the codes once: half the bytes of the bf16 format; from
//              kWidenFrom tokens on each block is widened once into bf16 lines that every token
//              then reads, as the bf16 format's kernel reads its own.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "fp8_lines.h"
#include "moe/core/dtype.h"
#include "moe/experts/kernels.h"

#define MOE_AVX512_BF16_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi")))

namespace moe::experts::internal {
namespace {

constexpr int64_t kPrefetchLines = 16;  // as the other kernels (kernels_avx512.cc)

int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One 16-row block for MM tokens: out[t * ldy + r].
template <int MM>
MOE_AVX512_BF16_VBMI void Fp8Tile(const PackedMatrix& w, int64_t b, const Activations& a, int64_t m0, float* out,
                                  int64_t ldy) {
  const MatrixLayout& l = w.layout;
  const Fp8Bf16Table& table = Fp8ToBf16Table();
  const __m512i hi0 = _mm512_load_si512(table.hi.data()), hi1 = _mm512_load_si512(table.hi.data() + 64);
  const __m512i lo0 = _mm512_load_si512(table.lo.data()), lo1 = _mm512_load_si512(table.lo.data() + 64);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* blk = w.block(b);
  const uint16_t *x[MM], *x_lo[MM];
  __m512 total[MM];
  for (int t = 0; t < MM; ++t) {
    x[t] = a.bf16(m0 + t);
    x_lo[t] = a.bf16_lo(m0 + t);
    total[t] = _mm512_setzero_ps();
  }
  const int64_t lines_per_group = l.group / 4;
  for (int64_t g = 0; g < l.groups(); ++g) {
    // Four independent sums per token (k01 and k23, by hi and lo terms): one vdpbf16ps a line on
    // each, so that at one token the loop is not bound by their latency.
    __m512 acc[4][MM];
    for (int t = 0; t < MM; ++t) acc[0][t] = acc[1][t] = acc[2][t] = acc[3][t] = _mm512_setzero_ps();
    for (int64_t j = g * lines_per_group; j < (g + 1) * lines_per_group; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + (j + kPrefetchLines) * 64), _MM_HINT_T0);
      const __m512i codes = _mm512_load_si512(blk + j * 64);
      // High bytes: the table's, with the code's sign bit (bit 7 of both); low bytes: the table's.
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, codes, hi1), codes, sign, 0xF8);
      const __m512i lo = _mm512_permutex2var_epi8(lo0, codes, lo1);
      const __m512bh k01 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);  // dword r: row r's (k0, k1)
      const __m512bh k23 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);  // dword r: row r's (k2, k3)
      for (int t = 0; t < MM; ++t) {
        acc[0][t] = _mm512_dpbf16_ps(acc[0][t], k01, (__m512bh)_mm512_set1_epi32(Load32(x[t] + 4 * j)));
        acc[1][t] = _mm512_dpbf16_ps(acc[1][t], k23, (__m512bh)_mm512_set1_epi32(Load32(x[t] + 4 * j + 2)));
        acc[2][t] = _mm512_dpbf16_ps(acc[2][t], k01, (__m512bh)_mm512_set1_epi32(Load32(x_lo[t] + 4 * j)));
        acc[3][t] = _mm512_dpbf16_ps(acc[3][t], k23, (__m512bh)_mm512_set1_epi32(Load32(x_lo[t] + 4 * j + 2)));
      }
    }
    const __m512 scales = _mm512_loadu_ps(w.block_scales(b, g));
    for (int t = 0; t < MM; ++t) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0][t], acc[1][t]), _mm512_add_ps(acc[2][t], acc[3][t]));
      total[t] = _mm512_fmadd_ps(sum, scales, total[t]);
    }
  }
  for (int t = 0; t < MM; ++t) _mm512_storeu_ps(out + t * ldy, total[t]);
}

// A block's fp8 lines widened once to bf16 lines (the bf16 format's: line p holds the 16 rows'
// pair (2p, 2p + 1)), for calls of many tokens.
MOE_AVX512_BF16_VBMI void WidenBlock(const PackedMatrix& w, int64_t b, uint16_t* lines) {
  const Fp8Bf16Table& table = Fp8ToBf16Table();
  const __m512i hi0 = _mm512_load_si512(table.hi.data()), hi1 = _mm512_load_si512(table.hi.data() + 64);
  const __m512i lo0 = _mm512_load_si512(table.lo.data()), lo1 = _mm512_load_si512(table.lo.data() + 64);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* blk = w.block(b);
  for (int64_t j = 0; j < w.layout.k_pad / 4; ++j) {
    const __m512i codes = _mm512_load_si512(blk + j * 64);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, codes, hi1), codes, sign, 0xF8);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, codes, lo1);
    _mm512_storeu_si512(lines + 2 * j * 32, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512(lines + (2 * j + 1) * 32, _mm512_unpackhi_epi8(lo, hi));
  }
}

// MM tokens over a widened block: hi and lo activation terms in two chains, per group times its
// scales.
template <int MM>
MOE_AVX512_BF16_VBMI void WidenedTile(const PackedMatrix& w, int64_t b, const uint16_t* lines, const Activations& a,
                                      int64_t m0, float* out, int64_t ldy) {
  const MatrixLayout& l = w.layout;
  const uint16_t *x[MM], *x_lo[MM];
  __m512 total[MM];
  for (int t = 0; t < MM; ++t) {
    x[t] = a.bf16(m0 + t);
    x_lo[t] = a.bf16_lo(m0 + t);
    total[t] = _mm512_setzero_ps();
  }
  const int64_t pairs_per_group = l.group / 2;
  for (int64_t g = 0; g < l.groups(); ++g) {
    __m512 acc[2][MM];
    for (int t = 0; t < MM; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
    for (int64_t p = g * pairs_per_group; p < (g + 1) * pairs_per_group; ++p) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(lines + p * 32);
      for (int t = 0; t < MM; ++t) {
        acc[0][t] = _mm512_dpbf16_ps(acc[0][t], v, (__m512bh)_mm512_set1_epi32(Load32(x[t] + 2 * p)));
        acc[1][t] = _mm512_dpbf16_ps(acc[1][t], v, (__m512bh)_mm512_set1_epi32(Load32(x_lo[t] + 2 * p)));
      }
    }
    const __m512 scales = _mm512_loadu_ps(w.block_scales(b, g));
    for (int t = 0; t < MM; ++t) total[t] = _mm512_fmadd_ps(_mm512_add_ps(acc[0][t], acc[1][t]), scales, total[t]);
  }
  for (int t = 0; t < MM; ++t) _mm512_storeu_ps(out + t * ldy, total[t]);
}

// From this many tokens on, a block is widened once and every token reads the bf16 lines.
constexpr int64_t kWidenFrom = 8;

}  // namespace

void MatmulFp8Portable(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  const MatrixLayout& l = w.layout;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* block = w.block(b);
    for (int64_t m = 0; m < a.m(); ++m) {
      const float* x = a.f32(m);
      float* out = y + m * ldy + (b - b0) * 16;
      for (int r = 0; r < 16; ++r) {
        float acc = 0;
        for (int64_t g = 0; g < l.groups(); ++g) {
          float part = 0;
          for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) {
            part += x[k] * core::F8E4M3ToFloat(block[Fp8Index(r, k)]);
          }
          acc += part * w.block_scales(b, g)[r];
        }
        out[r] = acc;
      }
    }
  }
}

void MatmulFp8Avx512Bf16(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  if (a.m() >= kWidenFrom) {
    thread_local std::vector<uint16_t> lines;  // k_pad / 2 lines of 32 bf16 values
    lines.resize(w.layout.k_pad * 16);
    for (int64_t b = b0; b < b1; ++b) {
      WidenBlock(w, b, lines.data());
      float* out = y + (b - b0) * 16;
      int64_t m = 0;
      for (; m + 8 <= a.m(); m += 8) WidenedTile<8>(w, b, lines.data(), a, m, out + m * ldy, ldy);
      for (; m + 2 <= a.m(); m += 2) WidenedTile<2>(w, b, lines.data(), a, m, out + m * ldy, ldy);
      if (m < a.m()) WidenedTile<1>(w, b, lines.data(), a, m, out + m * ldy, ldy);
    }
    return;
  }
  for (int64_t b = b0; b < b1; ++b) {
    float* out = y + (b - b0) * 16;
    int64_t m = 0;
    for (; m + 4 <= a.m(); m += 4) Fp8Tile<4>(w, b, a, m, out + m * ldy, ldy);
    switch (a.m() - m) {
      case 3: Fp8Tile<3>(w, b, a, m, out + m * ldy, ldy); break;
      case 2: Fp8Tile<2>(w, b, a, m, out + m * ldy, ldy); break;
      case 1: Fp8Tile<1>(w, b, a, m, out + m * ldy, ldy); break;
      default: break;
    }
  }
}

}  // namespace moe::experts::internal
