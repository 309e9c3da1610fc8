// AVX-512 expert kernels. Every function here carries its own target attribute and is only
// called after the CPU was checked (kernel_registry.cc, activations.cc, kernels_portable.cc), so
// this file builds for the baseline ISA.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

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
// From this many tokens on, the int8 and int4 kernels take several blocks at once (Int8FourBlocks,
// Int4TwoBlocks): below it, a call streams weights from memory and the one-block tiles' further
// prefetch matters more.
constexpr int64_t kManyTokens = 6;

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

// acc + the dot products of a's unsigned and b's signed byte quads. GCC 12 compiles the intrinsic
// (_mm512_dpbusd_epi32) with a copy of the accumulator before and after each instruction, and
// keeps arrays of accumulators in memory: a kernel of 24 accumulators ran at 35% of the
// instruction's rate that way, and at 95-98% with this and named accumulators (one core of the
// development machine).
MOE_AVX512_VNNI inline __m512i Dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// int8 for many tokens: 4 consecutive blocks (64 columns) against MM <= 6 tokens, one accumulator
// per (token, block), so each k quad's broadcast feeds 4 products and each weight line MM. The
// one-block tile below reloads a broadcast for every 16 columns and holds its accumulators in an
// array. Lines [j0, j1) of the blocks' `lines`: the first range starts the sums at minus each token's
// offset (128 times the sum of its activations: the same integers as subtracting it at the end),
// later ranges take them from `partial` (MM rows of 64), and all but the last leave them there;
// the last writes the results, with the same float operations as Int8Tile, so bitwise the same.
// Accumulator c<t><n>: token t, block n. Meanwhile the lines [pf, pf + 64 pf_lines) go to L2,
// spread over the steps.
template <int MM>
MOE_AVX512_VNNI void Int8FourBlocks(const uint8_t* blk, int64_t block_bytes, int64_t j0, int64_t j1, int64_t lines,
                                    const float* w_scale, const Activations& a, int64_t m0, int32_t* partial,
                                    float* y, int64_t ldy, const uint8_t* pf, int64_t pf_lines) {
  static_assert(MM >= 1 && MM <= 6);
  __m512i c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23;
  __m512i c30, c31, c32, c33, c40, c41, c42, c43, c50, c51, c52, c53;
  const bool first = j0 == 0, last = j1 == lines;
#define MOE_INT8_START(t)                                                                    \
  if constexpr (MM > t) {                                                                    \
    if (first) {                                                                             \
      c##t##0 = c##t##1 = c##t##2 = c##t##3 = _mm512_set1_epi32(-128 * a.i8_sum(m0 + t, 0)); \
    } else {                                                                                 \
      c##t##0 = _mm512_loadu_si512(partial + t * 64);                                        \
      c##t##1 = _mm512_loadu_si512(partial + t * 64 + 16);                                   \
      c##t##2 = _mm512_loadu_si512(partial + t * 64 + 32);                                   \
      c##t##3 = _mm512_loadu_si512(partial + t * 64 + 48);                                   \
    }                                                                                        \
  }
  MOE_INT8_START(0) MOE_INT8_START(1) MOE_INT8_START(2) MOE_INT8_START(3) MOE_INT8_START(4) MOE_INT8_START(5)
#undef MOE_INT8_START
  const int8_t* x = a.i8(m0);
  const int64_t stride = a.stride();
  const int64_t pf_per_step = (pf_lines + (j1 - j0) - 1) / (j1 - j0);
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t i = (j - j0) * pf_per_step; i < std::min(pf_lines, (j - j0 + 1) * pf_per_step); ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + i * 64), _MM_HINT_T1);
    }
    const uint8_t* line = blk + j * 64;
    const __m512i v0 = _mm512_load_si512(line), v1 = _mm512_load_si512(line + block_bytes);
    const __m512i v2 = _mm512_load_si512(line + 2 * block_bytes), v3 = _mm512_load_si512(line + 3 * block_bytes);
    const int8_t* xj = x + 4 * j;
#define MOE_INT8_TOKEN(t)                                          \
  if constexpr (MM > t) {                                          \
    const __m512i xt = _mm512_set1_epi32(Load32(xj + t * stride)); \
    c##t##0 = Dpbusd(c##t##0, v0, xt);                             \
    c##t##1 = Dpbusd(c##t##1, v1, xt);                             \
    c##t##2 = Dpbusd(c##t##2, v2, xt);                             \
    c##t##3 = Dpbusd(c##t##3, v3, xt);                             \
  }
    MOE_INT8_TOKEN(0) MOE_INT8_TOKEN(1) MOE_INT8_TOKEN(2) MOE_INT8_TOKEN(3) MOE_INT8_TOKEN(4) MOE_INT8_TOKEN(5)
#undef MOE_INT8_TOKEN
  }
  if (!last) {
#define MOE_INT8_KEEP(t)                                     \
  if constexpr (MM > t) {                                    \
    _mm512_storeu_si512(partial + t * 64, c##t##0);          \
    _mm512_storeu_si512(partial + t * 64 + 16, c##t##1);     \
    _mm512_storeu_si512(partial + t * 64 + 32, c##t##2);     \
    _mm512_storeu_si512(partial + t * 64 + 48, c##t##3);     \
  }
    MOE_INT8_KEEP(0) MOE_INT8_KEEP(1) MOE_INT8_KEEP(2) MOE_INT8_KEEP(3) MOE_INT8_KEEP(4) MOE_INT8_KEEP(5)
#undef MOE_INT8_KEEP
    return;
  }
  const __m512 ws0 = _mm512_loadu_ps(w_scale), ws1 = _mm512_loadu_ps(w_scale + 16);
  const __m512 ws2 = _mm512_loadu_ps(w_scale + 32), ws3 = _mm512_loadu_ps(w_scale + 48);
#define MOE_INT8_STORE(t)                                                                                 \
  if constexpr (MM > t) {                                                                                 \
    const __m512 xs = _mm512_set1_ps(a.i8_scale(m0 + t));                                                 \
    _mm512_storeu_ps(y + t * ldy, _mm512_mul_ps(_mm512_cvtepi32_ps(c##t##0), _mm512_mul_ps(ws0, xs)));      \
    _mm512_storeu_ps(y + t * ldy + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(c##t##1), _mm512_mul_ps(ws1, xs))); \
    _mm512_storeu_ps(y + t * ldy + 32, _mm512_mul_ps(_mm512_cvtepi32_ps(c##t##2), _mm512_mul_ps(ws2, xs))); \
    _mm512_storeu_ps(y + t * ldy + 48, _mm512_mul_ps(_mm512_cvtepi32_ps(c##t##3), _mm512_mul_ps(ws3, xs))); \
  }
  MOE_INT8_STORE(0) MOE_INT8_STORE(1) MOE_INT8_STORE(2) MOE_INT8_STORE(3) MOE_INT8_STORE(4) MOE_INT8_STORE(5)
#undef MOE_INT8_STORE
}

// Lines per pass of Int8FourBlocks: 16 KB of the four blocks, which stay in L1 while every group
// of six tokens goes over them (all 512 lines of a 2048-wide row at once, 128 KB, came from L2 for
// each group: on the 32-core machine the kernel alone then ran gate+up at a third of down's speed).
constexpr int64_t kInt8PassLines = 64;

// Int8FourBlocks over blocks [b, b + 4) and tokens [0, m), six at a time, in passes of
// kInt8PassLines lines, fetching the next `next_blocks` (at most 4) blocks meanwhile.
void Int8FourBlocksAllTokens(const PackedMatrix& w, int64_t b, int64_t next_blocks, const Activations& a, float* y,
                             int64_t ldy) {
  const uint8_t* blk = w.block(b);
  const int64_t bytes = w.layout.block_bytes(), lines = w.layout.k_pad / 4;
  const float* ws = w.scales() + b * 16;
  const int64_t groups = (a.m() + 5) / 6, passes = (lines + kInt8PassLines - 1) / kInt8PassLines;
  const int64_t next_lines = next_blocks * bytes / 64, calls = groups * passes;
  const uint8_t* next = w.block(b + 4);
  thread_local std::vector<int32_t> partial;
  if (passes > 1 && partial.size() < static_cast<size_t>(groups * 6 * 64)) partial.resize(groups * 6 * 64);
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t j0 = p * kInt8PassLines, j1 = std::min(lines, j0 + kInt8PassLines);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t m0 = 6 * g, call = p * groups + g;
      float* out = y + m0 * ldy;
      int32_t* part = passes > 1 ? partial.data() + g * 6 * 64 : nullptr;
      const int64_t pf0 = next_lines * call / calls, pf1 = next_lines * (call + 1) / calls;
      const uint8_t* pf = next + pf0 * 64;
      switch (std::min<int64_t>(6, a.m() - m0)) {
        case 1: Int8FourBlocks<1>(blk, bytes, j0, j1, lines, ws, a, m0, part, out, ldy, pf, pf1 - pf0); break;
        case 2: Int8FourBlocks<2>(blk, bytes, j0, j1, lines, ws, a, m0, part, out, ldy, pf, pf1 - pf0); break;
        case 3: Int8FourBlocks<3>(blk, bytes, j0, j1, lines, ws, a, m0, part, out, ldy, pf, pf1 - pf0); break;
        case 4: Int8FourBlocks<4>(blk, bytes, j0, j1, lines, ws, a, m0, part, out, ldy, pf, pf1 - pf0); break;
        case 5: Int8FourBlocks<5>(blk, bytes, j0, j1, lines, ws, a, m0, part, out, ldy, pf, pf1 - pf0); break;
        default: Int8FourBlocks<6>(blk, bytes, j0, j1, lines, ws, a, m0, part, out, ldy, pf, pf1 - pf0); break;
      }
    }
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

// int4 for many tokens: 2 consecutive blocks (32 columns) against MM <= 6 tokens, with named
// accumulators (see Dpbusd). Each 64-byte load holds two lines of a block; its nibbles unpack to
// both lines' int8 with 2.5 instructions a line instead of 4, which share the ports with vpdpbusd.
// Bitwise the same as Int4Tile: exact integer sums per group, then the same float operations in
// the same order. The next `pf_lines` lines from `pf` go to L2 meanwhile, spread over the steps.
template <int MM>
MOE_AVX512_VNNI void Int4TwoBlocks(const PackedMatrix& w, int64_t b, const Activations& a, int64_t m0, float* y,
                                   int64_t ldy, const uint8_t* pf, int64_t pf_lines) {
  static_assert(MM >= 1 && MM <= 6);
  const uint8_t* blk0 = w.block(b);
  const uint8_t* blk1 = w.block(b + 1);
  const int64_t group_lines = w.layout.group / 4, groups = w.layout.groups();
  const int64_t pf_per_pair = (pf_lines + groups * group_lines / 2 - 1) / (groups * group_lines / 2);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512 fz = _mm512_setzero_ps();
  __m512 o00 = fz, o01 = fz, o10 = fz, o11 = fz, o20 = fz, o21 = fz, o30 = fz, o31 = fz, o40 = fz, o41 = fz, o50 = fz,
         o51 = fz;
  const int8_t* x = a.i8(m0);
  const int64_t stride = a.stride();
  // Each group's 16 scales follow the last group's.
  const float* scales0 = w.block_scales(b, 0);
  const float* scales1 = w.block_scales(b + 1, 0);
  const int32_t* sums[6];
  for (int t = 0; t < MM; ++t) sums[t] = a.i8_sums(m0 + t);
  int64_t pf_next = 0;
  for (int64_t g = 0; g < groups; ++g) {
    // Each token's sums start at minus its offset (8 times the sum of its activations in the group):
    // the same integers as subtracting it at the end, one instruction fewer per accumulator.
    __m512i c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define MOE_INT4_START(t)                                   \
  if constexpr (MM > t) {                                   \
    c##t##0 = c##t##1 = _mm512_set1_epi32(-8 * sums[t][g]); \
  }
    MOE_INT4_START(0) MOE_INT4_START(1) MOE_INT4_START(2) MOE_INT4_START(3) MOE_INT4_START(4) MOE_INT4_START(5)
#undef MOE_INT4_START
    for (int64_t j = g * group_lines; j < (g + 1) * group_lines; j += 2) {  // group_lines >= 8
      for (int64_t i = pf_next; i < std::min(pf_lines, pf_next + pf_per_pair); ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(pf + i * 64), _MM_HINT_T1);
      }
      pf_next += pf_per_pair;
      const __m512i p0 = _mm512_load_si512(blk0 + j * 32), p1 = _mm512_load_si512(blk1 + j * 32);
      const __m512i lo0 = _mm512_and_si512(p0, mask), hi0 = _mm512_and_si512(_mm512_srli_epi16(p0, 4), mask);
      const __m512i lo1 = _mm512_and_si512(p1, mask), hi1 = _mm512_and_si512(_mm512_srli_epi16(p1, 4), mask);
      // Line j: the low 256 bits of lo (rows 0-7) and hi (rows 8-15); line j + 1: the high ones.
      const __m512i v0 = _mm512_shuffle_i64x2(lo0, hi0, 0x44), v1 = _mm512_shuffle_i64x2(lo1, hi1, 0x44);
      const __m512i u0 = _mm512_shuffle_i64x2(lo0, hi0, 0xEE), u1 = _mm512_shuffle_i64x2(lo1, hi1, 0xEE);
      const int8_t* xj = x + 4 * j;
#define MOE_INT4_TOKEN(t)                                           \
  if constexpr (MM > t) {                                           \
    const __m512i xa = _mm512_set1_epi32(Load32(xj + t * stride));  \
    c##t##0 = Dpbusd(c##t##0, v0, xa);                              \
    c##t##1 = Dpbusd(c##t##1, v1, xa);                              \
    const __m512i xb = _mm512_set1_epi32(Load32(xj + t * stride + 4)); \
    c##t##0 = Dpbusd(c##t##0, u0, xb);                              \
    c##t##1 = Dpbusd(c##t##1, u1, xb);                              \
  }
      MOE_INT4_TOKEN(0) MOE_INT4_TOKEN(1) MOE_INT4_TOKEN(2) MOE_INT4_TOKEN(3) MOE_INT4_TOKEN(4) MOE_INT4_TOKEN(5)
#undef MOE_INT4_TOKEN
    }
    const __m512 s0 = _mm512_loadu_ps(scales0 + 16 * g), s1 = _mm512_loadu_ps(scales1 + 16 * g);
#define MOE_INT4_GROUP(t)                                               \
  if constexpr (MM > t) {                                               \
    o##t##0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c##t##0), s0, o##t##0); \
    o##t##1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c##t##1), s1, o##t##1); \
  }
    MOE_INT4_GROUP(0) MOE_INT4_GROUP(1) MOE_INT4_GROUP(2) MOE_INT4_GROUP(3) MOE_INT4_GROUP(4) MOE_INT4_GROUP(5)
#undef MOE_INT4_GROUP
  }
#define MOE_INT4_STORE(t)                                                    \
  if constexpr (MM > t) {                                                    \
    const __m512 xs = _mm512_set1_ps(a.i8_scale(m0 + t));                    \
    _mm512_storeu_ps(y + t * ldy, _mm512_mul_ps(o##t##0, xs));               \
    _mm512_storeu_ps(y + t * ldy + 16, _mm512_mul_ps(o##t##1, xs));          \
  }
  MOE_INT4_STORE(0) MOE_INT4_STORE(1) MOE_INT4_STORE(2) MOE_INT4_STORE(3) MOE_INT4_STORE(4) MOE_INT4_STORE(5)
#undef MOE_INT4_STORE
}

// Int4TwoBlocks over blocks [b, b + 2) and tokens [0, m), six at a time, fetching the next
// `next_blocks` (at most 2) blocks meanwhile.
void Int4TwoBlocksAllTokens(const PackedMatrix& w, int64_t b, int64_t next_blocks, const Activations& a, float* y,
                            int64_t ldy) {
  const int64_t groups = (a.m() + 5) / 6, next_lines = next_blocks * w.layout.block_bytes() / 64;
  const uint8_t* next = w.block(b + 2);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m0 = 6 * g;
    float* out = y + m0 * ldy;
    const int64_t pf0 = next_lines * g / groups, pf1 = next_lines * (g + 1) / groups;
    const uint8_t* pf = next + pf0 * 64;
    switch (std::min<int64_t>(6, a.m() - m0)) {
      case 1: Int4TwoBlocks<1>(w, b, a, m0, out, ldy, pf, pf1 - pf0); break;
      case 2: Int4TwoBlocks<2>(w, b, a, m0, out, ldy, pf, pf1 - pf0); break;
      case 3: Int4TwoBlocks<3>(w, b, a, m0, out, ldy, pf, pf1 - pf0); break;
      case 4: Int4TwoBlocks<4>(w, b, a, m0, out, ldy, pf, pf1 - pf0); break;
      case 5: Int4TwoBlocks<5>(w, b, a, m0, out, ldy, pf, pf1 - pf0); break;
      default: Int4TwoBlocks<6>(w, b, a, m0, out, ldy, pf, pf1 - pf0); break;
    }
  }
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
  if (a.m() >= kManyTokens) {
    for (; b0 + 4 <= b1; b0 += 4, y += 64) Int8FourBlocksAllTokens(w, b0, std::min<int64_t>(4, b1 - b0 - 4), a, y, ldy);
  }
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
  if (a.m() >= kManyTokens) {
    for (; b0 + 2 <= b1; b0 += 2, y += 32) Int4TwoBlocksAllTokens(w, b0, std::min<int64_t>(2, b1 - b0 - 2), a, y, ldy);
  }
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
