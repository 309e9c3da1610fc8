// GGUF block types: the table, the integer form of each block (gguf_blocks.h) and DequantizeRow.
// Written from the block definitions in ggml's ggml-common.h and the dequantizers in
// ggml-quants.c; each comment names the field layout it reads.
#include "moe/experts/gguf_types.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gguf_blocks.h"
#include "moe/core/dtype.h"

namespace moe::experts {
namespace internal {

#include "gguf_grids.inc"

namespace {

uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
uint32_t Load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
float Half(const uint8_t* p) { return core::F16ToFloat(Load16(p)); }

// Byte j of a grid entry (little-endian, as ggml reads a grid entry through a uint8_t pointer).
uint8_t GridByte(uint64_t entry, int j) { return static_cast<uint8_t>(entry >> (8 * j)); }
int8_t Signed(uint8_t magnitude, bool negative) {
  return static_cast<int8_t>(negative ? -static_cast<int>(magnitude) : magnitude);
}

// Q4_K and Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes.
void ScaleMinK4(int j, const uint8_t* s, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// block_q4_0 {half d; u8 qs[16]}: value j in the low nibble of qs[j], j + 16 in the high one.
void DecodeQ4_0(const uint8_t* b, int8_t* q, float* s) {
  s[0] = Half(b);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((b[2 + j] & 0xF) - 8);
    q[j + 16] = static_cast<int8_t>((b[2 + j] >> 4) - 8);
  }
}

// block_q4_1 {half d, m; u8 qs[16]}: d * q + m.
void DecodeQ4_1(const uint8_t* b, int8_t* q, float* s, float* o) {
  s[0] = Half(b);
  o[0] = Half(b + 2);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(b[4 + j] & 0xF);
    q[j + 16] = static_cast<int8_t>(b[4 + j] >> 4);
  }
}

// The fifth bits of Q5_0 and Q5_1: bit j of qh for value j, bit j + 16 for value j + 16.
void Fives(const uint8_t* qh4, const uint8_t* qs, int sub, int8_t* q) {
  const uint32_t qh = Load32(qh4);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) - sub);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - sub);
  }
}

// block_q5_0 {half d; u8 qh[4]; u8 qs[16]}.
void DecodeQ5_0(const uint8_t* b, int8_t* q, float* s) {
  s[0] = Half(b);
  Fives(b + 2, b + 6, 16, q);
}

// block_q5_1 {half d, m; u8 qh[4]; u8 qs[16]}.
void DecodeQ5_1(const uint8_t* b, int8_t* q, float* s, float* o) {
  s[0] = Half(b);
  o[0] = Half(b + 2);
  Fives(b + 4, b + 8, 0, q);
}

// block_q8_0 {half d; i8 qs[32]}.
void DecodeQ8_0(const uint8_t* b, int8_t* q, float* s) {
  s[0] = Half(b);
  std::memcpy(q, b + 2, 32);
}

// block_q2_K {u8 scales[16]; u8 qs[64]; half d, dmin}: 16 groups of 16; group 8h + 2j + u takes
// bits 2j of qs[32h + 16u + l]; scale nibble (low) and min nibble (high) per group.
void DecodeQ2_K(const uint8_t* b, int8_t* q, float* s, float* o) {
  const uint8_t* scales = b;
  const float d = Half(b + 80), dmin = Half(b + 82);
  for (int g = 0; g < 16; ++g) {
    const int h = g / 8, j = (g % 8) / 2, u = g % 2;
    s[g] = d * (scales[g] & 0xF);
    o[g] = -(dmin * (scales[g] >> 4));
    const uint8_t* qs = b + 16 + 32 * h + 16 * u;
    for (int l = 0; l < 16; ++l) q[16 * g + l] = static_cast<int8_t>((qs[l] >> (2 * j)) & 3);
  }
}

// block_q3_K {u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d}: as Q2_K's bits, minus 4 where the
// group's hmask bit is clear; 6-bit scales (low nibbles in bytes 0-7, high pairs in 8-11) - 32.
void DecodeQ3_K(const uint8_t* b, int8_t* q, float* s) {
  const uint8_t* hmask = b;
  const uint8_t* sc = b + 96;
  const float d = Half(b + 108);
  for (int g = 0; g < 16; ++g) {
    const int h = g / 8, j = (g % 8) / 2, u = g % 2;
    const int low = g < 8 ? sc[g] & 0xF : sc[g - 8] >> 4;
    const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
    s[g] = d * static_cast<float>((low | (high << 4)) - 32);
    const uint8_t* qs = b + 32 + 32 * h + 16 * u;
    const uint8_t* hm = hmask + 16 * u;
    const uint8_t m = static_cast<uint8_t>(1 << (4 * h + j));
    for (int l = 0; l < 16; ++l) {
      q[16 * g + l] = static_cast<int8_t>(((qs[l] >> (2 * j)) & 3) - ((hm[l] & m) ? 0 : 4));
    }
  }
}

// block_q4_K {half d, dmin; u8 scales[12]; u8 qs[128]}: 8 groups of 32; the 64 values of chunk c
// are the low nibbles (group 2c), then the high nibbles (2c + 1), of qs[32c .. 32c + 31].
void DecodeQ4_K(const uint8_t* b, int8_t* q, float* s, float* o) {
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 8; ++g) {
    int sc, m;
    ScaleMinK4(g, b + 4, &sc, &m);
    s[g] = d * sc;
    o[g] = -(dmin * m);
    const uint8_t* src = qs + 32 * (g / 2);
    for (int l = 0; l < 32; ++l) q[32 * g + l] = static_cast<int8_t>(g % 2 == 0 ? src[l] & 0xF : src[l] >> 4);
  }
}

// block_q5_K {half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: Q4_K plus 16 where bit g of
// qh[l] is set.
void DecodeQ5_K(const uint8_t* b, int8_t* q, float* s, float* o) {
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 8; ++g) {
    int sc, m;
    ScaleMinK4(g, b + 4, &sc, &m);
    s[g] = d * sc;
    o[g] = -(dmin * m);
    const uint8_t* src = qs + 32 * (g / 2);
    for (int l = 0; l < 32; ++l) {
      const int low = g % 2 == 0 ? src[l] & 0xF : src[l] >> 4;
      q[32 * g + l] = static_cast<int8_t>(low + ((qh[l] >> g) & 1) * 16);
    }
  }
}

// block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}: per half h of 128 values, value
// 32i + l takes a nibble of ql[64h + l + 32 (i % 2)] (low for i < 2) and bits 2i of qh[32h + l],
// minus 32; group g = value / 16 has scale d * scales[g].
void DecodeQ6_K(const uint8_t* b, int8_t* q, float* s) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = Half(b + 208);
  for (int g = 0; g < 16; ++g) s[g] = d * sc[g];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t low = ql[64 * h + l + 32 * (i % 2)];
        const int nibble = i < 2 ? low & 0xF : low >> 4;
        const int high = (qh[32 * h + l] >> (2 * i)) & 3;
        q[128 * h + 32 * i + l] = static_cast<int8_t>((nibble | (high << 4)) - 32);
      }
    }
  }
}

// Eight values of an iq2 grid entry with their signs (bit j of `signs` negates value j).
void GridEight(uint64_t entry, uint8_t signs, int8_t* q) {
  for (int j = 0; j < 8; ++j) q[j] = Signed(GridByte(entry, j), signs & kGgufKmaskIq2xs[j]);
}

// block_iq2_xxs {half d; u16 qs[32]}: per 32 values two u32: four grid indices, then four 7-bit
// sign indices and a 4-bit scale.
void DecodeIQ2_XXS(const uint8_t* b, int8_t* q, float* s) {
  const float d = Half(b);
  for (int g = 0; g < 8; ++g) {
    const uint8_t* p = b + 2 + 8 * g;
    const uint32_t aux = Load32(p + 4);
    s[g] = d * (0.5f + static_cast<float>(aux >> 28)) * 0.25f;
    for (int l = 0; l < 4; ++l) {
      GridEight(kGgufIq2xxsGrid[p[l]], kGgufKsignsIq2xs[(aux >> (7 * l)) & 127], q + 32 * g + 8 * l);
    }
  }
}

// block_iq2_xs {half d; u16 qs[32]; u8 scales[8]}: each u16 a 9-bit grid index and 7-bit sign
// index; a 4-bit scale per 16 values.
void DecodeIQ2_XS(const uint8_t* b, int8_t* q, float* s) {
  const float d = Half(b);
  const uint8_t* scales = b + 66;
  for (int g = 0; g < 16; ++g) {
    const int nib = g % 2 == 0 ? scales[g / 2] & 0xF : scales[g / 2] >> 4;
    s[g] = d * (0.5f + static_cast<float>(nib)) * 0.25f;
  }
  for (int i = 0; i < 32; ++i) {
    const uint16_t v = Load16(b + 2 + 2 * i);
    GridEight(kGgufIq2xsGrid[v & 511], kGgufKsignsIq2xs[v >> 9], q + 8 * i);
  }
}

// block_iq2_s {half d; u8 qs[64]; u8 qh[8]; u8 scales[8]}: qs[0..31] the low 8 bits of the grid
// indices, qs[32..63] the signs; qh two high bits per index.
void DecodeIQ2_S(const uint8_t* b, int8_t* q, float* s) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  const uint8_t* signs = b + 34;
  const uint8_t* qh = b + 66;
  const uint8_t* scales = b + 74;
  for (int g = 0; g < 16; ++g) {
    const int nib = g % 2 == 0 ? scales[g / 2] & 0xF : scales[g / 2] >> 4;
    s[g] = d * (0.5f + static_cast<float>(nib)) * 0.25f;
  }
  for (int ib = 0; ib < 8; ++ib) {
    for (int l = 0; l < 4; ++l) {
      const int index = qs[4 * ib + l] | ((qh[ib] << (8 - 2 * l)) & 0x300);
      GridEight(kGgufIq2sGrid[index], signs[4 * ib + l], q + 32 * ib + 8 * l);
    }
  }
}

// block_iq3_xxs {half d; u8 qs[96]}: qs[0..63] grid indices (4 values each), then per 32 values
// a u32 of four 7-bit sign indices and a 4-bit scale.
void DecodeIQ3_XXS(const uint8_t* b, int8_t* q, float* s) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  for (int g = 0; g < 8; ++g) {
    const uint32_t aux = Load32(b + 66 + 4 * g);
    s[g] = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
    for (int l = 0; l < 4; ++l) {
      const uint8_t signs = kGgufKsignsIq2xs[(aux >> (7 * l)) & 127];
      const uint32_t g1 = kGgufIq3xxsGrid[qs[8 * g + 2 * l]], g2 = kGgufIq3xxsGrid[qs[8 * g + 2 * l + 1]];
      int8_t* out = q + 32 * g + 8 * l;
      for (int j = 0; j < 4; ++j) {
        out[j] = Signed(GridByte(g1, j), signs & kGgufKmaskIq2xs[j]);
        out[j + 4] = Signed(GridByte(g2, j), signs & kGgufKmaskIq2xs[j + 4]);
      }
    }
  }
}

// block_iq3_s {half d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]}: 9-bit grid indices (the
// ninth bit in qh), explicit sign bytes, a 4-bit odd scale per 32 values.
void DecodeIQ3_S(const uint8_t* b, int8_t* q, float* s) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  const uint8_t* qh = b + 66;
  const uint8_t* signs = b + 74;
  const uint8_t* scales = b + 106;
  for (int g = 0; g < 8; ++g) {
    const int nib = g % 2 == 0 ? scales[g / 2] & 0xF : scales[g / 2] >> 4;
    s[g] = d * static_cast<float>(1 + 2 * nib);
    for (int l = 0; l < 4; ++l) {
      const int i1 = qs[8 * g + 2 * l] | ((qh[g] << (8 - 2 * l)) & 256);
      const int i2 = qs[8 * g + 2 * l + 1] | ((qh[g] << (7 - 2 * l)) & 256);
      const uint8_t sg = signs[4 * g + l];
      int8_t* out = q + 32 * g + 8 * l;
      for (int j = 0; j < 4; ++j) {
        out[j] = Signed(GridByte(kGgufIq3sGrid[i1], j), sg & kGgufKmaskIq2xs[j]);
        out[j + 4] = Signed(GridByte(kGgufIq3sGrid[i2], j), sg & kGgufKmaskIq2xs[j + 4]);
      }
    }
  }
}

// IQ1: grid values in {-1, 0, 1} plus a shift of +-1/8 as integers 8 * value +- 1, with the scale
// divided by 8 (exact: a power of two).
constexpr float kIq1Delta = 0.125f;

// block_iq1_s {half d; u8 qs[32]; u16 qh[8]}: 11-bit grid indices (3 high bits per index in qh),
// per 32 values a 3-bit scale and the sign of the shift.
void DecodeIQ1_S(const uint8_t* b, int8_t* q, float* s) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  for (int g = 0; g < 8; ++g) {
    const uint16_t qh = Load16(b + 34 + 2 * g);
    const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
    s[g] = dl * kIq1Delta;
    const int shift = (qh & 0x8000) ? -1 : 1;
    for (int l = 0; l < 4; ++l) {
      const uint64_t entry = kGgufIq1sGrid[qs[4 * g + l] | (((qh >> (3 * l)) & 7) << 8)];
      for (int j = 0; j < 8; ++j) {
        q[32 * g + 8 * l + j] = static_cast<int8_t>(8 * static_cast<int8_t>(GridByte(entry, j)) + shift);
      }
    }
  }
}

// block_iq1_m {u8 qs[32]; u8 qh[16]; u8 scales[8]}: the fp16 scale d spread over the top nibbles
// of the four u16 scale words; 3-bit scales per 16 values; a shift sign per 8 values.
void DecodeIQ1_M(const uint8_t* b, int8_t* q, float* s) {
  const uint8_t* qs = b;
  const uint8_t* qh = b + 32;
  uint16_t sc[4];
  for (int i = 0; i < 4; ++i) sc[i] = Load16(b + 48 + 2 * i);
  const uint16_t bits = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                              (sc[3] & 0xf000));
  const float d = core::F16ToFloat(bits);
  for (int ib = 0; ib < 8; ++ib) {
    const float dl1 = d * static_cast<float>(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 0)) & 0x7) + 1);
    const float dl2 = d * static_cast<float>(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 0x7) + 1);
    s[2 * ib] = dl1 * kIq1Delta;
    s[2 * ib + 1] = dl2 * kIq1Delta;
    const uint8_t h0 = qh[2 * ib], h1 = qh[2 * ib + 1];
    const int index[4] = {qs[4 * ib] | ((h0 << 8) & 0x700), qs[4 * ib + 1] | ((h0 << 4) & 0x700),
                          qs[4 * ib + 2] | ((h1 << 8) & 0x700), qs[4 * ib + 3] | ((h1 << 4) & 0x700)};
    const int shift[4] = {(h0 & 0x08) ? -1 : 1, (h0 & 0x80) ? -1 : 1, (h1 & 0x08) ? -1 : 1, (h1 & 0x80) ? -1 : 1};
    for (int l = 0; l < 4; ++l) {
      const uint64_t entry = kGgufIq1sGrid[index[l]];
      for (int j = 0; j < 8; ++j) {
        q[32 * ib + 8 * l + j] = static_cast<int8_t>(8 * static_cast<int8_t>(GridByte(entry, j)) + shift[l]);
      }
    }
  }
}

// block_iq4_nl {half d; u8 qs[16]}: nibbles as Q4_0's, through the codebook.
void DecodeIQ4_NL(const uint8_t* b, int8_t* q, float* s) {
  s[0] = Half(b);
  for (int j = 0; j < 16; ++j) {
    q[j] = kGgufKvaluesIq4nl[b[2 + j] & 0xF];
    q[j + 16] = kGgufKvaluesIq4nl[b[2 + j] >> 4];
  }
}

// block_iq4_xs {half d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}: 6-bit scales - 32 per 32
// values (low nibbles in scales_l, high pairs in scales_h), nibbles as IQ4_NL's per 32 values.
void DecodeIQ4_XS(const uint8_t* b, int8_t* q, float* s) {
  const float d = Half(b);
  const uint16_t scales_h = Load16(b + 2);
  const uint8_t* scales_l = b + 4;
  const uint8_t* qs = b + 8;
  for (int g = 0; g < 8; ++g) {
    const int ls = ((scales_l[g / 2] >> (4 * (g % 2))) & 0xF) | (((scales_h >> (2 * g)) & 3) << 4);
    s[g] = d * static_cast<float>(ls - 32);
    for (int j = 0; j < 16; ++j) {
      q[32 * g + j] = kGgufKvaluesIq4nl[qs[16 * g + j] & 0xF];
      q[32 * g + j + 16] = kGgufKvaluesIq4nl[qs[16 * g + j] >> 4];
    }
  }
}

// {id, elements, bytes, group, bias, has_offset}
constexpr GgufBlockCode kCodes[] = {
    {kGgufQ4_0, 32, 18, 32, 8, false},       {kGgufQ4_1, 32, 20, 32, 0, true},
    {kGgufQ5_0, 32, 22, 32, 16, false},      {kGgufQ5_1, 32, 24, 32, 0, true},
    {kGgufQ8_0, 32, 34, 32, 128, false},     {kGgufQ2_K, 256, 84, 16, 0, true},
    {kGgufQ3_K, 256, 110, 16, 4, false},     {kGgufQ4_K, 256, 144, 32, 0, true},
    {kGgufQ5_K, 256, 176, 32, 0, true},      {kGgufQ6_K, 256, 210, 16, 32, false},
    {kGgufIQ2_XXS, 256, 66, 32, 64, false},  {kGgufIQ2_XS, 256, 74, 16, 64, false},
    {kGgufIQ3_XXS, 256, 98, 32, 64, false},  {kGgufIQ1_S, 256, 50, 32, 16, false},
    {kGgufIQ4_NL, 32, 18, 32, 128, false},   {kGgufIQ3_S, 256, 110, 32, 16, false},
    {kGgufIQ2_S, 256, 82, 16, 64, false},    {kGgufIQ4_XS, 256, 136, 32, 128, false},
    {kGgufIQ1_M, 256, 56, 16, 16, false},
};

}  // namespace

const GgufBlockCode* FindGgufBlockCode(int type_id) {
  for (const GgufBlockCode& c : kCodes) {
    if (c.id == type_id) return &c;
  }
  return nullptr;
}

void DecodeGgufBlock(int type_id, const uint8_t* b, int8_t* q, float* s, float* o) {
  switch (type_id) {
    case kGgufQ4_0: return DecodeQ4_0(b, q, s);
    case kGgufQ4_1: return DecodeQ4_1(b, q, s, o);
    case kGgufQ5_0: return DecodeQ5_0(b, q, s);
    case kGgufQ5_1: return DecodeQ5_1(b, q, s, o);
    case kGgufQ8_0: return DecodeQ8_0(b, q, s);
    case kGgufQ2_K: return DecodeQ2_K(b, q, s, o);
    case kGgufQ3_K: return DecodeQ3_K(b, q, s);
    case kGgufQ4_K: return DecodeQ4_K(b, q, s, o);
    case kGgufQ5_K: return DecodeQ5_K(b, q, s, o);
    case kGgufQ6_K: return DecodeQ6_K(b, q, s);
    case kGgufIQ2_XXS: return DecodeIQ2_XXS(b, q, s);
    case kGgufIQ2_XS: return DecodeIQ2_XS(b, q, s);
    case kGgufIQ2_S: return DecodeIQ2_S(b, q, s);
    case kGgufIQ3_XXS: return DecodeIQ3_XXS(b, q, s);
    case kGgufIQ3_S: return DecodeIQ3_S(b, q, s);
    case kGgufIQ1_S: return DecodeIQ1_S(b, q, s);
    case kGgufIQ1_M: return DecodeIQ1_M(b, q, s);
    case kGgufIQ4_NL: return DecodeIQ4_NL(b, q, s);
    case kGgufIQ4_XS: return DecodeIQ4_XS(b, q, s);
  }
}

}  // namespace internal

namespace {

const std::vector<GgufType>& Types() {
  static const std::vector<GgufType> types = [] {
    std::vector<GgufType> t = {{kGgufF32, "F32", 1, 4}, {kGgufF16, "F16", 1, 2}};
    const char* names[] = {"Q4_0",   "Q4_1",  "Q5_0",    "Q5_1",  "Q8_0",   "Q2_K",  "Q3_K",
                           "Q4_K",   "Q5_K",  "Q6_K",    "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
                           "IQ4_NL", "IQ3_S", "IQ2_S",   "IQ4_XS", "IQ1_M"};
    int i = 0;
    for (const internal::GgufBlockCode& c : internal::kCodes) {
      t.push_back({c.id, names[i++], c.elements, c.bytes});
    }
    t.push_back({kGgufBF16, "BF16", 1, 2});
    std::sort(t.begin(), t.end(), [](const GgufType& a, const GgufType& b) { return a.id < b.id; });
    return t;
  }();
  return types;
}

}  // namespace

const GgufType* FindGgufType(int id) {
  for (const GgufType& t : Types()) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

const std::vector<GgufType>& SupportedGgufTypes() { return Types(); }

std::string SupportedGgufTypeNames() {
  std::string names;
  for (const GgufType& t : Types()) absl::StrAppend(&names, names.empty() ? "" : ", ", t.name);
  return names;
}

void DequantizeRow(int type_id, const void* src, int64_t n, float* dst) {
  const GgufType* type = FindGgufType(type_id);
  if (type == nullptr || n % type->block_elements != 0) {
    std::fill(dst, dst + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const auto* bytes = static_cast<const uint8_t*>(src);
  switch (type_id) {
    case kGgufF32: std::memcpy(dst, src, n * sizeof(float)); return;
    case kGgufF16: return core::ConvertToFloat(src, core::DType::kF16, dst, n);
    case kGgufBF16: return core::ConvertToFloat(src, core::DType::kBF16, dst, n);
  }
  const internal::GgufBlockCode& code = *internal::FindGgufBlockCode(type_id);
  int8_t q[256];
  float scale[16], offset[16];
  for (int64_t b = 0; b < n / code.elements; ++b) {
    internal::DecodeGgufBlock(type_id, bytes + b * code.bytes, q, scale, offset);
    float* y = dst + b * code.elements;
    // Symmetric types: the product alone (adding a zero offset would turn -0 into +0).
    if (code.has_offset) {
      for (int i = 0; i < code.elements; ++i) y[i] = scale[i / code.group] * q[i] + offset[i / code.group];
    } else {
      for (int i = 0; i < code.elements; ++i) y[i] = scale[i / code.group] * q[i];
    }
  }
}

}  // namespace moe::experts
