// AMX expert kernels: 32 tokens x 32 rows per pass in four accumulator tiles (tmm0-3), two
// activation tiles (tmm4-5) and two weight tiles (tmm6-7) read straight from the packed blocks.
// Bound by tile throughput at many tokens.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

MOE_AMX void ConfigureAmxTiles() {
  thread_local bool configured = false;
  if (configured) return;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12's ldtilecfg builtin does not mark the 64-byte struct as read, so the stores above
  // would be dropped as dead: let the struct escape first.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  configured = true;
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

// The int32 sums of one pass (32 tokens x nb blocks, row stride 32), rows [r0, r1), as floats:
// minus the weights' offset times the activation sums, times the row and token scales. Then
// either stored to y (nb blocks of 16 columns), or, for a gate+up pass (block 0 gate, block 1 up
// of the same 16 units), silu(gate) * up stored to y's first n columns.
template <bool kSwiGlu>
MOE_AMX void FinishInt8Pass(const int32_t* acc, const float* row_scales, const Activations& a, int64_t m0, int nb,
                            int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  const __m512 ws0 = _mm512_loadu_ps(row_scales), ws1 = _mm512_loadu_ps(row_scales + (nb > 1 ? 16 : 0));
  const __mmask16 mask = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  r1 = std::min(r1, a.m() - m0);
  for (int64_t i = r0; i < r1; ++i) {
    const __m512i offset = _mm512_set1_epi32(128 * a.i8_sum(m0 + i, 0));
    const __m512 xs = _mm512_set1_ps(a.i8_scale(m0 + i));
    float* dst = y + (m0 + i) * ldy;
    const __m512i v0 = _mm512_sub_epi32(_mm512_load_si512(acc + i * 32), offset);
    const __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(v0), _mm512_mul_ps(ws0, xs));
    if (!kSwiGlu) StoreLine(dst, f0);
    if (nb > 1) {
      const __m512i v1 = _mm512_sub_epi32(_mm512_load_si512(acc + i * 32 + 16), offset);
      const __m512 f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(v1), _mm512_mul_ps(ws1, xs));
      if (kSwiGlu && mask != 0xFFFF) {
        _mm512_mask_storeu_ps(dst, mask, SiluMul16(f0, f1));
      } else if (kSwiGlu) {
        StoreLine(dst, SiluMul16(f0, f1));
      } else {
        StoreLine(dst + 16, f1);
      }
    }
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

}  // namespace

MOE_AMX void MatmulAmxInt8(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y,
                           int64_t ldy) {
  MatmulAmxInt8Impl<false>(w, a, b0, b1, 0, y, ldy);
}

MOE_AMX void SwiGluAmxInt8(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, int64_t n_cols,
                           float* y, int64_t ldy) {
  MatmulAmxInt8Impl<true>(w, a, b0, b1, n_cols, y, ldy);
}

}  // namespace moe::experts::internal
