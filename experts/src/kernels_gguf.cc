// Kernels for the GGUF formats (packed.h): the weights stay in their GGUF blocks and are decoded,
// a span of up to 256 columns of 16 rows at a time, to unsigned int8 (q + bias) with per-group
// scales (and mins), then multiplied by int8 activations:
//   y[m][n] = a_scale[m] * sum_g (scale[n][g] * (dot_g(q + bias, x) - bias * xsum_g) + min[n][g] * xsum_g)
// with xsum_g the activations' group sums (the activations are prepared with groups of 16).
//
// portable: one block at a time through the scalar decoder (gguf_blocks.h); the reference.
// vnni:     the 16 rows' blocks of a span decoded in registers (a vector decoder per type),
//           transposed into 64-byte lines of 16 rows x 4 columns (the int8 format's layout, kept
//           in L1), then vpdpbusd with broadcast activations, one accumulator per group, so that
//           no horizontal sums are needed. The span is decoded once for all the call's tokens.
// Speed bound: at one token, the memory stream of the blocks, if the decode keeps up.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "transpose_avx512.h"
#include "moe/core/dtype.h"
#include "moe/experts/gguf_types.h"
#include "moe/experts/kernels.h"

#define MOE_GGUF_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,bmi2")))

// GCC 12 warns about the undefined pass-through operand inside its own AVX-512 intrinsics.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace moe::experts::internal {
namespace {

// The activations' sum over group g of `group` columns (they are prepared in groups of 16).
inline int32_t GroupSum(const Activations& a, int64_t m, int64_t g, int group) {
  return group == 16 ? a.i8_sum(m, g) : a.i8_sum(m, 2 * g) + a.i8_sum(m, 2 * g + 1);
}

}  // namespace

void MatmulGgufPortable(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y,
                        int64_t ldy) {
  const MatrixLayout& l = w.layout;
  const GgufBlockCode& code = *FindGgufBlockCode(l.gguf_type);
  const int64_t chunks = l.k / code.elements, groups = code.elements / code.group;
  std::vector<float> acc(a.m());
  int8_t q[256];
  float scale[16], offset[16];
  for (int64_t b = b0; b < b1; ++b) {
    for (int r = 0; r < 16; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        DecodeGgufBlock(l.gguf_type, w.block(b) + (c * 16 + r) * code.bytes, q, scale, offset);
        for (int64_t m = 0; m < a.m(); ++m) {
          const int8_t* x = a.i8(m) + c * code.elements;
          for (int64_t g = 0; g < groups; ++g) {
            // The activations' scale of these columns (one per 32 of them).
            const float as = a.i8_group_scales(m)[(c * code.elements + g * code.group) / Activations::kScaleGroup];
            int32_t dot = 0;
            for (int i = 0; i < code.group; ++i) dot += q[g * code.group + i] * x[g * code.group + i];
            acc[m] += scale[g] * as * static_cast<float>(dot);
            if (code.has_offset) {
              acc[m] += offset[g] * as *
                        static_cast<float>(GroupSum(a, m, (c * code.elements) / code.group + g, code.group));
            }
          }
        }
      }
      for (int64_t m = 0; m < a.m(); ++m) y[m * ldy + (b - b0) * 16 + r] = acc[m] * a.i8_scale(m);
    }
  }
}

namespace {

constexpr int kSpan = 256;  // columns decoded at a time

// One span of 16 rows, decoded: rows[r][i] = q + bias of column i; scale and min per group, the
// 16 rows of a group side by side.
struct DecodedSpan {
  alignas(64) uint8_t rows[16][kSpan];
  alignas(64) uint8_t lines[kSpan / 4][64];
  alignas(64) float scale[kSpan / 16][16];
  alignas(64) float min[kSpan / 16][16];
};

MOE_GGUF_VNNI inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

uint32_t Load32u(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Any type, through the scalar decoder: row r's block at `blk` to columns [col, col + elements).
void DecodeScalar(const GgufBlockCode& code, const uint8_t* blk, int r, int col, DecodedSpan& s) {
  int8_t q[256];
  float scale[16], offset[16];
  DecodeGgufBlock(code.id, blk, q, scale, offset);
  for (int i = 0; i < code.elements; ++i) s.rows[r][col + i] = static_cast<uint8_t>(q[i] + code.bias);
  for (int g = 0; g < code.elements / code.group; ++g) {
    s.scale[col / code.group + g][r] = scale[g];
    s.min[col / code.group + g][r] = code.has_offset ? offset[g] : 0.0f;
  }
}

MOE_GGUF_VNNI void DecodeQ8_0(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  s.scale[col / 32][r] = Half(blk);
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][col]), _mm256_xor_si256(q, _mm256_set1_epi8(-128)));
}

// Q4_0 (bias 8) and IQ4_NL (through the codebook, bias 128): value j low nibble, j + 16 high.
template <bool kCodebook>
MOE_GGUF_VNNI void DecodeNibbles32(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  s.scale[col / 32][r] = Half(blk);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
  __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  if (kCodebook) {
    const __m128i table = _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166,
                                        (char)181, (char)197, (char)217, (char)241);  // kvalues_iq4nl + 128
    lo = _mm_shuffle_epi8(table, lo);
    hi = _mm_shuffle_epi8(table, hi);
  }
  _mm_store_si128(reinterpret_cast<__m128i*>(&s.rows[r][col]), lo);
  _mm_store_si128(reinterpret_cast<__m128i*>(&s.rows[r][col + 16]), hi);
}

// Q4_K and Q5_K: 8 groups of 32, scale and min 6 bits each; the 64 columns of chunk j are the low
// nibbles (group 2j), then the high ones (2j + 1), of qs[32j .. 32j + 31], plus 16 for Q5_K where
// bit 2j (2j + 1) of qh[l] is set.
template <bool kFive>
MOE_GGUF_VNNI void DecodeQ45_K(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk), dmin = Half(blk + 2);
  const uint8_t* sc = blk + 4;
  for (int g = 0; g < 8; ++g) {
    int scale, min;
    if (g < 4) {
      scale = sc[g] & 63;
      min = sc[g + 4] & 63;
    } else {
      scale = (sc[g + 4] & 0xF) | ((sc[g - 4] >> 6) << 4);
      min = (sc[g + 4] >> 4) | ((sc[g] >> 6) << 4);
    }
    s.scale[g][r] = d * scale;
    s.min[g][r] = -(dmin * min);
  }
  const uint8_t* qs = blk + (kFive ? 48 : 16);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256i qh = _mm256_setzero_si256();
  if (kFive) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (kFive) {
      const __mmask32 mlo = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * j))));
      const __mmask32 mhi = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(2 << (2 * j))));
      lo = _mm256_mask_add_epi8(lo, mlo, lo, _mm256_set1_epi8(16));
      hi = _mm256_mask_add_epi8(hi, mhi, hi, _mm256_set1_epi8(16));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][64 * j]), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][64 * j + 32]), hi);
  }
  (void)col;
}

// Q6_K: the 6-bit values as they are (q + 32), 16 groups of 16 with int8 scales.
MOE_GGUF_VNNI void DecodeQ6_K(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  for (int g = 0; g < 16; ++g) s.scale[g][r] = d * sc[g];
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i v[4] = {
        _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
        _mm256_or_si256(_mm256_and_si256(ql1, m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4)),
    };
    for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][128 * h + 32 * i]), v[i]);
  }
  (void)col;
}

// IQ4_XS: 8 groups of 32 with 6-bit scales - 32; nibbles through the codebook (+ 128).
MOE_GGUF_VNNI void DecodeIQ4_XS(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk);
  uint16_t scales_h;
  std::memcpy(&scales_h, blk + 2, 2);
  for (int g = 0; g < 8; ++g) {
    const int ls = ((blk[4 + g / 2] >> (4 * (g % 2))) & 0xF) | (((scales_h >> (2 * g)) & 3) << 4);
    s.scale[g][r] = d * static_cast<float>(ls - 32);
  }
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181, (char)197,
                    (char)217, (char)241));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {  // groups 2j, 2j + 1
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 + 32 * j));
    const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4));
    const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][64 * j]), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][64 * j + 32]), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
  (void)col;
}

// The signs of 32 values from four 7-bit indices into ksigns_iq2xs, whose entry i is i with its
// parity in bit 7 (so that every entry has an even count of set bits): four 7-bit fields spread
// to bytes, and each byte's parity.
MOE_GGUF_VNNI inline uint32_t SignBits(uint32_t aux) {
  const uint32_t v = _pdep_u32(aux, 0x7F7F7F7Fu);
  uint32_t p = v ^ (v >> 4);
  p ^= p >> 2;
  p ^= p >> 1;
  return v | ((p & 0x01010101u) << 7);
}

// Entries index[i] & 255 of a 256-entry dword table (64-byte aligned): 8 pairs of registers,
// each looked up with vpermi2d by the index's low 5 bits, the eight results chosen by bits 5-7
// (one vpgatherdd or eight loads per 8 entries were slower: IQ3_XXS 3.5 and 4.2 GB/s on one core
// of the development machine, against 7.0 so).
MOE_GGUF_VNNI inline __m512i Lookup256(const int* table, __m512i index) {
  __m512i part[8];
  for (int p = 0; p < 8; ++p) {
    part[p] = _mm512_permutex2var_epi32(_mm512_load_si512(table + 32 * p), index, _mm512_load_si512(table + 32 * p + 16));
  }
  const __mmask16 b5 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(128));
  const __m512i q0 = _mm512_mask_blend_epi32(b5, part[0], part[1]), q1 = _mm512_mask_blend_epi32(b5, part[2], part[3]);
  const __m512i q2 = _mm512_mask_blend_epi32(b5, part[4], part[5]), q3 = _mm512_mask_blend_epi32(b5, part[6], part[7]);
  return _mm512_mask_blend_epi32(b7, _mm512_mask_blend_epi32(b6, q0, q1), _mm512_mask_blend_epi32(b6, q2, q3));
}

// IQ3_XXS: per group of 32, 8 grid entries of 4 magnitudes and 32 sign bits from four 7-bit
// indices; q + 64. Two groups at a time.
MOE_GGUF_VNNI void DecodeIQ3_XXS(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk);
  const uint8_t* qs = blk + 2;
  const __m512i bias = _mm512_set1_epi8(64);
  for (int g = 0; g < 8; g += 2) {
    const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 8 * g)));
    const __m512i mag = Lookup256(reinterpret_cast<const int*>(kGgufIq3xxsGrid), index);
    uint64_t neg = 0;
    for (int u = 0; u < 2; ++u) {
      const uint32_t aux = Load32u(blk + 66 + 4 * (g + u));
      s.scale[g + u][r] = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
      neg |= static_cast<uint64_t>(SignBits(aux)) << (32 * u);
    }
    _mm512_store_si512(&s.rows[r][32 * g], _mm512_mask_sub_epi8(_mm512_add_epi8(bias, mag), neg, bias, mag));
  }
  (void)col;
}

// Q4_1 (min, bias 0), Q5_0 (fifth bit, bias 16), Q5_1 (fifth bit, min, bias 0): value j in the
// low nibble of qs[j], j + 16 in the high one; the fifth bit of value i is bit i of qh.
template <bool kMin, bool kFifth>
MOE_GGUF_VNNI void DecodeLegacy32(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  s.scale[col / 32][r] = Half(blk);
  if (kMin) s.min[col / 32][r] = Half(blk + 2);
  const uint8_t* qs = blk + (kMin ? 4 : 2) + (kFifth ? 4 : 0);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  if (kFifth) q = _mm256_mask_add_epi8(q, static_cast<__mmask32>(Load32u(blk + (kMin ? 4 : 2))), q, _mm256_set1_epi8(16));
  _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][col]), q);
}

// Q2_K (bias 0, a min per group) and Q3_K (a high bit per value, bias 4): 16 groups of 16; in half
// h, bits 2j of qs[32h + l] (l < 32) are values 128h + 32j + l.
template <bool kThree>
MOE_GGUF_VNNI void DecodeQ23_K(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  if (kThree) {
    const uint8_t* sc = blk + 96;
    const float d = Half(blk + 108);
    for (int g = 0; g < 16; ++g) {
      const int low = g < 8 ? sc[g] & 0xF : sc[g - 8] >> 4;
      const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
      s.scale[g][r] = d * static_cast<float>((low | (high << 4)) - 32);
    }
  } else {
    const float d = Half(blk + 80), dmin = Half(blk + 82);
    for (int g = 0; g < 16; ++g) {
      s.scale[g][r] = d * (blk[g] & 0xF);
      s.min[g][r] = -(dmin * (blk[g] >> 4));
    }
  }
  const uint8_t* qs = blk + (kThree ? 32 : 16);
  const __m256i m3 = _mm256_set1_epi8(3);
  const __m256i hm = kThree ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)) : _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * h));
    for (int j = 0; j < 4; ++j) {
      __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
      if (kThree) {
        const __mmask32 keep = _mm256_test_epi8_mask(hm, _mm256_set1_epi8(static_cast<char>(1 << (4 * h + j))));
        v = _mm256_mask_add_epi8(v, keep, v, _mm256_set1_epi8(4));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][128 * h + 32 * j]), v);
    }
  }
  (void)col;
}

// 32 values from magnitudes and sign bits: bias + magnitude, or bias - magnitude where negative.
MOE_GGUF_VNNI inline void StoreSigned(__m256i mag, __mmask32 neg, int bias, uint8_t* dst) {
  const __m256i b = _mm256_set1_epi8(static_cast<char>(bias));
  _mm256_store_si256(reinterpret_cast<__m256i*>(dst), _mm256_mask_sub_epi8(_mm256_add_epi8(b, mag), neg, b, mag));
}

// Four 8-value grid entries (IQ2 types).
MOE_GGUF_VNNI inline __m256i Grid4(const uint64_t* grid, int i0, int i1, int i2, int i3) {
  return _mm256_setr_epi64x(static_cast<long long>(grid[i0]), static_cast<long long>(grid[i1]),
                            static_cast<long long>(grid[i2]), static_cast<long long>(grid[i3]));
}

// IQ2_XXS: per 32 values, four grid indices, four 7-bit sign indices and a scale.
MOE_GGUF_VNNI void DecodeIQ2_XXS(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk);
  for (int g = 0; g < 8; ++g) {
    const uint8_t* p = blk + 2 + 8 * g;
    const uint32_t aux = Load32u(p + 4);
    s.scale[g][r] = d * (0.5f + static_cast<float>(aux >> 28)) * 0.25f;
    StoreSigned(Grid4(kGgufIq2xxsGrid, p[0], p[1], p[2], p[3]), SignBits(aux), 64, &s.rows[r][32 * g]);
  }
  (void)col;
}

// IQ2_XS: u16 codes, a 9-bit grid index and a 7-bit sign index each; scales per 16.
MOE_GGUF_VNNI void DecodeIQ2_XS(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk);
  for (int g = 0; g < 16; ++g) {
    const int nib = g % 2 == 0 ? blk[66 + g / 2] & 0xF : blk[66 + g / 2] >> 4;
    s.scale[g][r] = d * (0.5f + static_cast<float>(nib)) * 0.25f;
  }
  for (int g = 0; g < 8; ++g) {
    uint16_t v[4];
    std::memcpy(v, blk + 2 + 8 * g, 8);
    const __mmask32 neg = static_cast<__mmask32>(kGgufKsignsIq2xs[v[0] >> 9]) |
                          static_cast<__mmask32>(kGgufKsignsIq2xs[v[1] >> 9]) << 8 |
                          static_cast<__mmask32>(kGgufKsignsIq2xs[v[2] >> 9]) << 16 |
                          static_cast<__mmask32>(kGgufKsignsIq2xs[v[3] >> 9]) << 24;
    StoreSigned(Grid4(kGgufIq2xsGrid, v[0] & 511, v[1] & 511, v[2] & 511, v[3] & 511), neg, 64, &s.rows[r][32 * g]);
  }
  (void)col;
}

// IQ2_S: 10-bit grid indices (two high bits per index in qh), explicit sign bytes; scales per 16.
MOE_GGUF_VNNI void DecodeIQ2_S(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk);
  const uint8_t* qs = blk + 2;
  const uint8_t* qh = blk + 66;
  for (int g = 0; g < 16; ++g) {
    const int nib = g % 2 == 0 ? blk[74 + g / 2] & 0xF : blk[74 + g / 2] >> 4;
    s.scale[g][r] = d * (0.5f + static_cast<float>(nib)) * 0.25f;
  }
  for (int g = 0; g < 8; ++g) {
    const uint8_t* q = qs + 4 * g;
    const int h = qh[g];
    const __m256i mag = Grid4(kGgufIq2sGrid, q[0] | ((h << 8) & 0x300), q[1] | ((h << 6) & 0x300),
                              q[2] | ((h << 4) & 0x300), q[3] | ((h << 2) & 0x300));
    StoreSigned(mag, static_cast<__mmask32>(Load32u(qs + 32 + 4 * g)), 64, &s.rows[r][32 * g]);
  }
  (void)col;
}

// IQ3_S: 9-bit grid indices (the ninth bit j of qh[g] for index j), explicit sign bytes; q + 16.
// Two groups at a time, the 512-entry grid as two halves of Lookup256.
MOE_GGUF_VNNI void DecodeIQ3_S(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk);
  const uint8_t* qs = blk + 2;
  const int* grid = reinterpret_cast<const int*>(kGgufIq3sGrid);
  const __m512i bias = _mm512_set1_epi8(16);
  for (int g = 0; g < 8; ++g) {
    const int nib = g % 2 == 0 ? blk[106 + g / 2] & 0xF : blk[106 + g / 2] >> 4;
    s.scale[g][r] = d * static_cast<float>(1 + 2 * nib);
  }
  for (int g = 0; g < 8; g += 2) {
    const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 8 * g)));
    uint16_t high;  // bit i: the ninth bit of index i (qh[g] for the first 8, qh[g + 1] for the next)
    std::memcpy(&high, blk + 66 + g, 2);
    const __m512i mag =
        _mm512_mask_blend_epi32(high, Lookup256(grid, index), Lookup256(grid + 256, index));
    uint64_t neg;
    std::memcpy(&neg, blk + 74 + 4 * g, 8);
    _mm512_store_si512(&s.rows[r][32 * g], _mm512_mask_sub_epi8(_mm512_add_epi8(bias, mag), neg, bias, mag));
  }
  (void)col;
}

// IQ1: grid values in {-1, 0, 1} (int8 bytes of iq1s_grid) as 8 * value + shift, shift +-1 (the
// +-1/8 of ggml's delta), + 16; the scale divided by 8, as the scalar decoder does.
MOE_GGUF_VNNI inline __m256i Iq1Values(__m256i grid, __m256i plus) {
  const __m256i eight = _mm256_and_si256(_mm256_slli_epi16(grid, 3), _mm256_set1_epi8(static_cast<char>(0xF8)));
  return _mm256_add_epi8(eight, plus);
}

// IQ1_S: 11-bit grid indices (the high 3 bits of index l in bits 3l of qh[g]), per 32 values a
// 3-bit scale and the shift's sign (bit 15 of qh[g]).
MOE_GGUF_VNNI void DecodeIQ1_S(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const float d = Half(blk);
  const uint8_t* qs = blk + 2;
  for (int g = 0; g < 8; ++g) {
    uint16_t qh;
    std::memcpy(&qh, blk + 34 + 2 * g, 2);
    s.scale[g][r] = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1) * 0.125f;
    const uint8_t* q = qs + 4 * g;
    const __m256i grid = Grid4(kGgufIq1sGrid, q[0] | ((qh << 8) & 0x700), q[1] | ((qh << 5) & 0x700),
                               q[2] | ((qh << 2) & 0x700), q[3] | ((qh >> 1) & 0x700));
    const __m256i v = Iq1Values(grid, _mm256_set1_epi8((qh & 0x8000) ? 15 : 17));
    _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][32 * g]), v);
  }
  (void)col;
}

// IQ1_M: the fp16 scale in the top nibbles of the four u16 scale words, 3-bit scales per 16
// values, a shift sign per 8.
MOE_GGUF_VNNI void DecodeIQ1_M(const uint8_t* blk, int r, int col, DecodedSpan& s) {
  const uint8_t* qs = blk;
  const uint8_t* qh = blk + 32;
  uint16_t sc[4];
  std::memcpy(sc, blk + 48, 8);
  const uint16_t bits = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                              (sc[3] & 0xf000));
  const float d = _cvtsh_ss(bits);
  for (int ib = 0; ib < 8; ++ib) {
    s.scale[2 * ib][r] = d * static_cast<float>(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 0)) & 0x7) + 1) * 0.125f;
    s.scale[2 * ib + 1][r] = d * static_cast<float>(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 0x7) + 1) * 0.125f;
    const int h0 = qh[2 * ib], h1 = qh[2 * ib + 1];
    const uint8_t* q = qs + 4 * ib;
    const __m256i grid = Grid4(kGgufIq1sGrid, q[0] | ((h0 << 8) & 0x700), q[1] | ((h0 << 4) & 0x700),
                               q[2] | ((h1 << 8) & 0x700), q[3] | ((h1 << 4) & 0x700));
    auto plus = [](int h) { return static_cast<long long>((h ? 15 : 17) * 0x0101010101010101ull); };
    const __m256i shift = _mm256_setr_epi64x(plus(h0 & 0x08), plus(h0 & 0x80), plus(h1 & 0x08), plus(h1 & 0x80));
    _mm256_store_si256(reinterpret_cast<__m256i*>(&s.rows[r][32 * ib]), Iq1Values(grid, shift));
  }
  (void)col;
}


MOE_GGUF_VNNI inline __m512i Dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));  // as kernels_avx512.cc: named accumulators
  return acc;
}

using DecodeFn = void (*)(const uint8_t* blk, int r, int col, DecodedSpan& s);

// Decodes the span of `cols` columns from `col0` of 16-row block `blk0` into s.lines, s.scale and
// s.min (group index relative to the span).
template <DecodeFn kDecode>
MOE_GGUF_VNNI void DecodeSpan(const GgufBlockCode& code, const uint8_t* rowblock, int64_t col0, int cols,
                              DecodedSpan& s) {
  const int chunks = cols / code.elements;
  const int64_t c0 = col0 / code.elements;
  for (int c = 0; c < chunks; ++c) {
    const uint8_t* chunk = rowblock + (c0 + c) * 16 * code.bytes;
    // The next span's blocks, into L1 while this one decodes (the L2 prefetcher runs ahead).
    for (int p = 0; p < 16 * code.bytes; p += 64) _mm_prefetch(reinterpret_cast<const char*>(chunk + chunks * 16 * code.bytes + p), _MM_HINT_T0);
    for (int r = 0; r < 16; ++r) {
      const uint8_t* blk = chunk + r * code.bytes;
      if constexpr (kDecode != nullptr) {
        kDecode(blk, r, c * code.elements, s);
      } else {
        DecodeScalar(code, blk, r, c * code.elements, s);
      }
    }
  }
  const int padded = (cols + 63) / 64 * 64;
  if (padded != cols) {
    for (int r = 0; r < 16; ++r) std::memset(&s.rows[r][cols], 0, padded - cols);
  }
  for (int c64 = 0; c64 < padded; c64 += 64) {
    __m512i v[16];
    for (int r = 0; r < 16; ++r) v[r] = _mm512_load_si512(&s.rows[r][c64]);
    Transpose16x16(v);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(s.lines[c64 / 4 + j], v[j]);
  }
}

// One token's products with a decoded span: the sum over its groups of scale * (integer dot -
// bias * group sum) + min * group sum, for the 16 rows.
template <int kGroup, bool kMin>
MOE_GGUF_VNNI __m512 DotSpan(const DecodedSpan& s, int cols, int bias, const int8_t* x, const int32_t* sums16,
                             const float* ascale) {
  constexpr int kLines = kGroup / 4;
  __m512 acc = _mm512_setzero_ps();
  for (int g = 0; g < cols / kGroup; ++g) {
    const float as = ascale[g * kGroup / Activations::kScaleGroup];  // the activations' scale here
    const int32_t sum = kGroup == 16 ? sums16[g] : sums16[2 * g] + sums16[2 * g + 1];
    __m512i i0 = _mm512_set1_epi32(-bias * sum), i1 = _mm512_setzero_si512();
    for (int j = 0; j < kLines; j += 2) {
      const int line = g * kLines + j;
      int32_t x0, x1;
      std::memcpy(&x0, x + 4 * line, 4);
      std::memcpy(&x1, x + 4 * line + 4, 4);
      i0 = Dpbusd(i0, _mm512_load_si512(s.lines[line]), _mm512_set1_epi32(x0));
      i1 = Dpbusd(i1, _mm512_load_si512(s.lines[line + 1]), _mm512_set1_epi32(x1));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)),
                          _mm512_mul_ps(_mm512_load_ps(s.scale[g]), _mm512_set1_ps(as)), acc);
    if (kMin) acc = _mm512_fmadd_ps(_mm512_load_ps(s.min[g]), _mm512_set1_ps(static_cast<float>(sum) * as), acc);
  }
  return acc;
}

using DotFn = __m512 (*)(const DecodedSpan& s, int cols, int bias, const int8_t* x, const int32_t* sums16,
                         const float* ascale);

using DecodeSpanFn = void (*)(const GgufBlockCode& code, const uint8_t* rowblock, int64_t col0, int cols,
                               DecodedSpan& s);

// The span decoder of a type: with its vector decoder inlined, or the scalar one.
DecodeSpanFn SpanDecoder(int type_id) {
  switch (type_id) {
    case kGgufQ8_0: return DecodeSpan<DecodeQ8_0>;
    case kGgufQ4_0: return DecodeSpan<DecodeNibbles32<false>>;
    case kGgufIQ4_NL: return DecodeSpan<DecodeNibbles32<true>>;
    case kGgufQ4_K: return DecodeSpan<DecodeQ45_K<false>>;
    case kGgufQ5_K: return DecodeSpan<DecodeQ45_K<true>>;
    case kGgufQ6_K: return DecodeSpan<DecodeQ6_K>;
    case kGgufIQ4_XS: return DecodeSpan<DecodeIQ4_XS>;
    case kGgufIQ3_XXS: return DecodeSpan<DecodeIQ3_XXS>;
    case kGgufQ4_1: return DecodeSpan<DecodeLegacy32<true, false>>;
    case kGgufQ5_0: return DecodeSpan<DecodeLegacy32<false, true>>;
    case kGgufQ5_1: return DecodeSpan<DecodeLegacy32<true, true>>;
    case kGgufQ2_K: return DecodeSpan<DecodeQ23_K<false>>;
    case kGgufQ3_K: return DecodeSpan<DecodeQ23_K<true>>;
    case kGgufIQ2_XXS: return DecodeSpan<DecodeIQ2_XXS>;
    case kGgufIQ2_XS: return DecodeSpan<DecodeIQ2_XS>;
    case kGgufIQ2_S: return DecodeSpan<DecodeIQ2_S>;
    case kGgufIQ3_S: return DecodeSpan<DecodeIQ3_S>;
    case kGgufIQ1_S: return DecodeSpan<DecodeIQ1_S>;
    case kGgufIQ1_M: return DecodeSpan<DecodeIQ1_M>;
  }
  return DecodeSpan<nullptr>;
}

}  // namespace

MOE_GGUF_VNNI void MatmulGgufVnni(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y,
                                  int64_t ldy) {
  const MatrixLayout& l = w.layout;
  const GgufBlockCode& code = *FindGgufBlockCode(l.gguf_type);
  const DecodeSpanFn decode = SpanDecoder(code.id);
  const DotFn dot = code.group == 16 ? (code.has_offset ? DotSpan<16, true> : DotSpan<16, false>)
                                     : (code.has_offset ? DotSpan<32, true> : DotSpan<32, false>);
  thread_local DecodedSpan span;
  const int64_t m = a.m();
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t t = 0; t < m; ++t) _mm512_storeu_ps(y + t * ldy + (b - b0) * 16, _mm512_setzero_ps());
    for (int64_t col = 0; col < l.k; col += kSpan) {
      const int cols = static_cast<int>(std::min<int64_t>(kSpan, l.k - col));
      decode(code, w.block(b), col, cols, span);
      for (int64_t t = 0; t < m; ++t) {
        float* out = y + t * ldy + (b - b0) * 16;
        const __m512 part = dot(span, cols, code.bias, a.i8(t) + col, a.i8_sums(t) + col / 16,
                                a.i8_group_scales(t) + col / Activations::kScaleGroup);
        _mm512_storeu_ps(out, _mm512_fmadd_ps(part, _mm512_set1_ps(a.i8_scale(t)), _mm512_loadu_ps(out)));
      }
    }
  }
}

}  // namespace moe::experts::internal

#pragma GCC diagnostic pop
