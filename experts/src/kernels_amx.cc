// AMX expert kernels: 32 tokens x 32 rows per pass in four accumulator tiles (tmm0-3), two
// activation tiles (tmm4-5) and two weight tiles (tmm6-7), read straight from the packed blocks
// (bf16, int8) or from blocks unpacked to int8 in L1 (int4). Bound by tile throughput at many
// tokens, or by streaming the weights.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moe/experts/kernels.h"
#include "silu_avx512.h"

#define MOE_AMX __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8,amx-bf16")))

namespace moe::experts::internal {
namespace {

// Brings the 1 KB weight tile at `tile` toward L1 ahead of its tile load, which would otherwise
// stall the tile pipeline on a memory miss.
// Into L2, whose miss slots outnumber L1's: a tile's worth of compute is shorter than a memory
// round trip, so the prefetch must run several tiles ahead.
inline void PrefetchTile(const void* tile) {
  const char* p = static_cast<const char*>(tile);
  for (int line = 0; line < 16; ++line) _mm_prefetch(p + line * 64, _MM_HINT_T1);
}

constexpr int64_t kPrefetchTiles = 8;  // k-tiles ahead

constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

bool EnableAmxForProcess() {
  static const bool enabled = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return enabled;
}

MOE_AMX void ConfigureAmxTiles(int k_bytes) {
  // The tile shapes this thread has loaded (0: none yet); loading a configuration clears the tiles,
  // so it happens only when a kernel needs other shapes than the last one.
  thread_local int configured = 0;
  if (configured == k_bytes) return;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // Activation tiles (tmm4-5) of k_bytes columns, weight tiles (tmm6-7) of k_bytes / 4 lines.
  for (int t = 4; t < 6; ++t) cfg.colsb[t] = static_cast<uint16_t>(k_bytes);
  for (int t = 6; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(k_bytes / 4);
  // GCC 12's ldtilecfg builtin does not mark the 64-byte struct as read, so the stores above
  // would be dropped as dead: let the struct escape first.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  configured = k_bytes;
}

// 16 tokens x up to 64 rows per pass: the hi and lo activation tiles both multiply each weight
// tile into the same accumulator, so x * w = (hi + lo) * w to about 16 mantissa bits of x.
MOE_AMX void MatmulAmxBf16(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y,
                           int64_t ldy) {
  ConfigureAmxTiles();
  alignas(64) float scratch[16 * 64];
  const int64_t k_tiles = w.layout.k_pad / 32;
  const int64_t a_stride = a.stride() * 2;
  // Blocks outer, tokens inner: each weight tile comes from memory once and is reused from L1/L2
  // for every 16 tokens.
  for (int64_t b = b0; b < b1; b += 4) {
    for (int64_t m0 = 0; m0 < a.m(); m0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(4, b1 - b));
      const uint16_t* blk[4];
      for (int c = 0; c < 4; ++c) blk[c] = reinterpret_cast<const uint16_t*>(w.block(b + std::min(c, nb - 1)));
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const bool next = m0 + 16 >= a.m() && b + 4 < b1;  // last token pass: warm the next blocks
      for (int64_t t = 0; t < k_tiles; ++t) {
        if (m0 == 0 && t + kPrefetchTiles < k_tiles) {
          for (int c = 0; c < nb; ++c) PrefetchTile(blk[c] + (t + kPrefetchTiles) * 16 * 32);
        }
        if (next && t < kPrefetchTiles) {
          for (int64_t c = b + 4; c < std::min(b1, b + 8); ++c) PrefetchTile(w.block(c) + t * 16 * 64);
        }
        _tile_loadd(4, a.bf16(m0) + t * 32, a_stride);
        _tile_loadd(5, a.bf16_lo(m0) + t * 32, a_stride);
        _tile_loadd(6, blk[0] + t * 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 6);
        if (nb > 1) {
          _tile_loadd(7, blk[1] + t * 16 * 32, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(1, 5, 7);
        }
        if (nb > 2) {
          _tile_loadd(6, blk[2] + t * 16 * 32, 64);
          _tile_dpbf16ps(2, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
        }
        if (nb > 3) {
          _tile_loadd(7, blk[3] + t * 16 * 32, 64);
          _tile_dpbf16ps(3, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, scratch, 256);
      _tile_stored(1, scratch + 16, 256);
      _tile_stored(2, scratch + 32, 256);
      _tile_stored(3, scratch + 48, 256);
      for (int64_t i = 0; i < 16 && m0 + i < a.m(); ++i) {
        std::memcpy(y + (m0 + i) * ldy + (b - b0) * 16, scratch + i * 64, nb * 16 * 4);
      }
    }
  }
}

namespace {

// Stores one 16-float line of a pass's results. The rows an int8 pass writes (intermediate
// rows, expert rows) are read again only after other threads have streamed many more weights
// through the caches, so a whole aligned line goes straight to memory with a streaming store,
// rather than being read in first only to be overwritten (at 4096 tokens on the 32-core machine,
// 14-18% of the call). The kernel fences these stores before it returns.
MOE_AMX inline void StoreLine(float* dst, __m512 v) {
  if ((reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
    _mm512_stream_ps(dst, v);
  } else {
    _mm512_storeu_ps(dst, v);
  }
}

// Writes one token's finished values of a pass: nb blocks of 16 columns (f0, f1), or, for a
// gate+up pass, silu(f0) * f1 on the lanes of `mask`.
template <bool kSwiGlu>
MOE_AMX inline void EmitRow(float* dst, __m512 f0, __m512 f1, int nb, __mmask16 mask) {
  if (kSwiGlu) {
    const __m512 v = SiluMul16(f0, f1);
    if (mask != 0xFFFF) {
      _mm512_mask_storeu_ps(dst, mask, v);
    } else {
      StoreLine(dst, v);
    }
    return;
  }
  StoreLine(dst, f0);
  if (nb > 1) StoreLine(dst + 16, f1);
}

// The lanes of y a pass writes: all 16, or the first n of a gate+up pair's last unit.
inline __mmask16 ColumnMask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// The int32 sums of one pass (32 tokens x nb blocks, row stride 32), rows [r0, r1), as floats:
// minus the weights' offset times the activation sums, times the row and token scales. Then
// either stored to y (nb blocks of 16 columns), or, for a gate+up pass (block 0 gate, block 1 up
// of the same 16 units), silu(gate) * up stored to y's first n columns.
template <bool kSwiGlu>
MOE_AMX void FinishInt8Pass(const int32_t* acc, const float* row_scales, const Activations& a, int64_t m0, int nb,
                            int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  const __m512 ws0 = _mm512_loadu_ps(row_scales), ws1 = _mm512_loadu_ps(row_scales + (nb > 1 ? 16 : 0));
  r1 = std::min(r1, a.m() - m0);
  for (int64_t i = r0; i < r1; ++i) {
    const __m512i offset = _mm512_set1_epi32(128 * a.i8_sum(m0 + i, 0));
    const __m512 xs = _mm512_set1_ps(a.i8_scale(m0 + i));
    const __m512i v0 = _mm512_sub_epi32(_mm512_load_si512(acc + i * 32), offset);
    const __m512i v1 = _mm512_sub_epi32(_mm512_load_si512(acc + i * 32 + 16), offset);
    EmitRow<kSwiGlu>(y + (m0 + i) * ldy, _mm512_mul_ps(_mm512_cvtepi32_ps(v0), _mm512_mul_ps(ws0, xs)),
                     _mm512_mul_ps(_mm512_cvtepi32_ps(v1), _mm512_mul_ps(ws1, xs)), nb, ColumnMask(n));
  }
}

// 32 tokens x 32 rows per pass (16 tokens in a last pass of at most 16). The weights stream from
// memory once per call: each block pair's tiles are reused from L2 for every token pass, and the
// next pair's lines are prefetched evenly over this pair's k-steps, so that memory reads go on
// while the tiles compute (a burst of prefetches at the start of each pair would leave the later
// passes with the memory idle). A pass's sums are stored from the tiles and finished (scaled into
// y) a few rows per k-step of the next pass: reading them back at once would stall on the tile
// stores, and this way the vector work overlaps the tile work.
// kSwiGlu: the matrix is a fused gate+up one (block 2j gate, 2j+1 up, b0 even) and y gets
// silu(gate) * up, 16 columns per pair, the first n_cols - (b0 / 2) * 16 of them.
template <bool kSwiGlu>
MOE_AMX void MatmulAmxInt8Impl(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, int64_t n_cols,
                               float* y, int64_t ldy) {
  ConfigureAmxTiles();
  alignas(64) int32_t acc[2][32 * 32];
  struct Pending {
    int64_t b = -1, m0 = 0, rows_done = 0;
    int nb = 0;
  } pending[2];
  int buf = 0;
  const float* scales = w.scales();
  // Finishes rows of the previous pass up to `rows` (of 32).
  auto finish = [&](int which, int64_t rows) {
    Pending& p = pending[which];
    if (p.b < 0 || rows <= p.rows_done) return;
    // A gate+up pair yields 16 columns of y, from unit b / 2 * 16; otherwise each block 16.
    const int64_t n = kSwiGlu ? n_cols - p.b / 2 * 16 : 16, column = (kSwiGlu ? (p.b - b0) / 2 : p.b - b0) * 16;
    FinishInt8Pass<kSwiGlu>(acc[which], scales + p.b * 16, a, p.m0, p.nb, n, p.rows_done, rows, y + column, ldy);
    p.rows_done = rows;
    if (rows >= 32) p.b = -1;
  };
  const int64_t k_tiles = w.layout.k_pad / 64;
  const int64_t rows_per_step = (32 + k_tiles - 1) / k_tiles;
  const int64_t a_stride = a.stride();
  const int64_t block_lines = w.layout.block_bytes() / 64;
  const int64_t steps = (a.m() + 31) / 32 * k_tiles;  // k-steps per block pair
  const int64_t lines_per_step = (2 * block_lines + steps - 1) / steps;
  for (int64_t b = b0; b < b1; b += 2) {  // blocks outer: the weights stream from memory once
    const bool two = b + 1 < b1;
    const uint8_t* w0 = w.block(b);
    const uint8_t* w1 = w.block(two ? b + 1 : b);
    const char* next = b + 2 < b1 ? reinterpret_cast<const char*>(w.block(b + 2)) : nullptr;
    const int64_t next_lines = next == nullptr ? 0 : std::min<int64_t>(2, b1 - b - 2) * block_lines;
    int64_t cursor = 0;
    for (int64_t m0 = 0; m0 < a.m(); m0 += 32) {
      const bool two_m = m0 + 16 < a.m();
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const bool lead = b == b0 && m0 == 0;  // the call's first pair had no earlier pair to fetch it
      for (int64_t t = 0; t < k_tiles; ++t) {
        if (lead && t + kPrefetchTiles < k_tiles) {
          PrefetchTile(w0 + (t + kPrefetchTiles) * 16 * 64);
          if (two) PrefetchTile(w1 + (t + kPrefetchTiles) * 16 * 64);
        }
        for (int64_t i = 0; i < lines_per_step && cursor < next_lines; ++i, ++cursor) {
          _mm_prefetch(next + cursor * 64, _MM_HINT_T1);
        }
        _tile_loadd(4, a.i8(m0) + t * 64, a_stride);
        _tile_loadd(6, w0 + t * 16 * 64, 64);
        _tile_dpbsud(0, 4, 6);  // signed activations x unsigned (offset 128) weights
        if (two_m) {
          _tile_loadd(5, a.i8(m0 + 16) + t * 64, a_stride);
          _tile_dpbsud(2, 5, 6);
        }
        if (two) {
          _tile_loadd(7, w1 + t * 16 * 64, 64);
          _tile_dpbsud(1, 4, 7);
          if (two_m) _tile_dpbsud(3, 5, 7);
        }
        finish(buf ^ 1, (t + 1) * rows_per_step);  // the previous pass, while this one computes
      }
      finish(buf ^ 1, 32);
      _tile_stored(0, acc[buf], 128);
      _tile_stored(1, acc[buf] + 16, 128);
      _tile_stored(2, acc[buf] + 16 * 32, 128);  // still zero after a 16-token pass
      _tile_stored(3, acc[buf] + 16 * 32 + 16, 128);
      pending[buf] = Pending{b, m0, 0, two ? 2 : 1};
      buf ^= 1;
    }
  }
  finish(buf ^ 1, 32);
  _mm_sfence();  // the streaming stores, before whatever tells another thread the rows are there
}

constexpr int64_t kInt4ChunkK = 512;  // K columns unpacked at a time: 16 KB of int8 for a block pair

// Unpacks int4 lines [j0, j1) of a block (32-byte half-lines of q + 8) to signed int8 lines of
// 64 bytes, q in [-8, 7]: the weight-tile layout, with no offset left to correct.
MOE_AMX inline void UnpackInt4Lines(const uint8_t* blk, int64_t j0, int64_t j1, int8_t* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i eight = _mm512_set1_epi8(8);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256i packed = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + j * 32));
    const __m256i lo = _mm256_and_si256(packed, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    _mm512_store_si512(out + (j - j0) * 64, _mm512_sub_epi8(v, eight));
  }
}

// 16 fp32 sums on one cache line.
struct alignas(64) Lanes16 {
  float v[16] = {};
};

// One int4 group's tiles as stored (32 tokens x 32 int32, row stride 32), waiting to be added
// into the fp32 sums of their pass: rows[2i] and rows[2i + 1] for token i, times the group's
// scales of each block (s0, s1).
struct StoredGroup {
  Lanes16* rows = nullptr;
  const float* s0 = nullptr;
  const float* s1 = nullptr;
  int64_t n = 0;
};

MOE_AMX inline void AddGroupSums(const int32_t* c, StoredGroup& p) {
  if (p.rows == nullptr) return;
  const __m512 s0 = _mm512_loadu_ps(p.s0), s1 = _mm512_loadu_ps(p.s1);
  for (int64_t i = 0; i < p.n; ++i) {
    float* r0 = p.rows[2 * i].v;
    float* r1 = p.rows[2 * i + 1].v;
    _mm512_store_ps(r0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + i * 32)), s0, _mm512_load_ps(r0)));
    _mm512_store_ps(r1,
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + i * 32 + 16)), s1, _mm512_load_ps(r1)));
  }
  p.rows = nullptr;
}

// int4 with a scale per row and group: 32 tokens x 32 rows per pass, one group at a time. The
// tiles hold one group's exact int32 sums (tiles of K = 32 for groups of 32, else 64); they are
// stored and added into fp32 sums per token, times the group's row scales, while the tiles
// compute the next group. The same integers and the same fp32 operations in the same order as
// the VNNI kernel, so the results are bitwise equal. Each block pair is unpacked to int8 in
// chunks of kInt4ChunkK columns, which every token pass then reads from L1; the next chunk's
// lines are prefetched evenly over this chunk's steps, as in the int8 kernel.
// A tile step of K = 32 takes as long as one of 64, and every group's tiles go through memory
// once, so with groups of 32 this kernel does about half the int8 kernel's work per second.
// experts/README.md has the figures, and the layouts tried that were slower.
template <bool kSwiGlu>
MOE_AMX void MatmulAmxInt4Impl(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, int64_t n_cols,
                               float* y, int64_t ldy) {
  const int64_t group = w.layout.group, k_pad = w.layout.k_pad, m = a.m();
  const int kk = static_cast<int>(std::min<int64_t>(group, 64));  // K of one tile step
  ConfigureAmxTiles(kk);
  const int64_t group_steps = group / kk, passes = (m + 31) / 32, a_stride = a.stride();
  alignas(64) int8_t unpacked[2][kInt4ChunkK * 16];
  alignas(64) int32_t acc[2][32 * 32];
  thread_local std::vector<Lanes16> sums;  // per token: the pair's two blocks
  if (sums.size() < static_cast<size_t>(2 * m)) sums.resize(2 * m);
  // A group's stored tiles, added into the sums of its pass while the tiles compute the next.
  StoredGroup pending[2];
  int buf = 0;
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two = b + 1 < b1;
    std::fill(sums.begin(), sums.begin() + 2 * m, Lanes16{});
    for (int64_t kc = 0; kc < k_pad; kc += kInt4ChunkK) {
      const int64_t kc_end = std::min(k_pad, kc + kInt4ChunkK);
      UnpackInt4Lines(w.block(b), kc / 4, kc_end / 4, unpacked[0]);
      if (two) UnpackInt4Lines(w.block(b + 1), kc / 4, kc_end / 4, unpacked[1]);
      // The next chunk: the rest of this pair, else the next pair's first.
      const int64_t next_block = kc_end < k_pad ? b : b + 2, next_k = kc_end < k_pad ? kc_end : 0;
      const char* next[2] = {nullptr, nullptr};
      int64_t next_lines = 0;  // per block
      if (next_block < b1) {
        next_lines = (std::min(k_pad, next_k + kInt4ChunkK) - next_k) / 4 * 32 / 64;
        next[0] = reinterpret_cast<const char*>(w.block(next_block) + next_k / 4 * 32);
        next[1] = next_block + 1 < b1 ? reinterpret_cast<const char*>(w.block(next_block + 1) + next_k / 4 * 32)
                                      : nullptr;
      }
      const int64_t total_lines = next[1] != nullptr ? 2 * next_lines : next_lines;
      const int64_t groups = (kc_end - kc) / group, steps = passes * groups * group_steps;
      const int64_t lines_per_step = (total_lines + steps - 1) / steps;
      int64_t cursor = 0;
      for (int64_t m0 = 0; m0 < m; m0 += 32) {
        const bool two_m = m0 + 16 < m;
        for (int64_t g = 0; g < groups; ++g) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t st = 0; st < group_steps; ++st) {
            for (int64_t i = 0; i < lines_per_step && cursor < total_lines; ++i, ++cursor) {
              const int which = cursor < next_lines ? 0 : 1;
              _mm_prefetch(next[which] + (cursor - which * next_lines) * 64, _MM_HINT_T1);
            }
            const int64_t k = kc + (g * group_steps + st) * kk;
            _tile_loadd(4, a.i8(m0) + k, a_stride);
            _tile_loadd(6, unpacked[0] + (k - kc) * 16, 64);  // K / 4 lines of 64 bytes
            _tile_dpbssd(0, 4, 6);
            if (two_m) {
              _tile_loadd(5, a.i8(m0 + 16) + k, a_stride);
              _tile_dpbssd(2, 5, 6);
            }
            if (two) {
              _tile_loadd(7, unpacked[1] + (k - kc) * 16, 64);
              _tile_dpbssd(1, 4, 7);
              if (two_m) _tile_dpbssd(3, 5, 7);
            }
          }
          _tile_stored(0, acc[buf], 128);
          _tile_stored(1, acc[buf] + 16, 128);
          _tile_stored(2, acc[buf] + 16 * 32, 128);
          _tile_stored(3, acc[buf] + 16 * 32 + 16, 128);
          AddGroupSums(acc[buf ^ 1], pending[buf ^ 1]);  // the previous group, while this one's tiles drain
          const int64_t gi = kc / group + g;
          pending[buf] = StoredGroup{sums.data() + 2 * m0, w.block_scales(b, gi),
                                     w.block_scales(two ? b + 1 : b, gi), std::min<int64_t>(32, m - m0)};
          buf ^= 1;
        }
      }
    }
    AddGroupSums(acc[buf ^ 1], pending[buf ^ 1]);
    const int64_t column = kSwiGlu ? (b - b0) / 2 * 16 : (b - b0) * 16;
    const __mmask16 mask = ColumnMask(kSwiGlu ? n_cols - b / 2 * 16 : 16);
    for (int64_t i = 0; i < m; ++i) {
      const __m512 xs = _mm512_set1_ps(a.i8_scale(i));
      EmitRow<kSwiGlu>(y + i * ldy + column, _mm512_mul_ps(_mm512_load_ps(sums[2 * i].v), xs),
                       _mm512_mul_ps(_mm512_load_ps(sums[2 * i + 1].v), xs), two ? 2 : 1, mask);
    }
  }
  _mm_sfence();  // the streaming stores, before whatever tells another thread the rows are there
}

}  // namespace

MOE_AMX void MatmulAmxInt4(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y,
                           int64_t ldy) {
  MatmulAmxInt4Impl<false>(w, a, b0, b1, 0, y, ldy);
}

MOE_AMX void SwiGluAmxInt4(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, int64_t n_cols,
                           float* y, int64_t ldy) {
  MatmulAmxInt4Impl<true>(w, a, b0, b1, n_cols, y, ldy);
}

MOE_AMX void MatmulAmxInt8(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y,
                           int64_t ldy) {
  MatmulAmxInt8Impl<false>(w, a, b0, b1, 0, y, ldy);
}

MOE_AMX void SwiGluAmxInt8(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, int64_t n_cols,
                           float* y, int64_t ldy) {
  MatmulAmxInt8Impl<true>(w, a, b0, b1, n_cols, y, ldy);
}

}  // namespace moe::experts::internal
