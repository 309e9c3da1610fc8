// The fp8 format's 64-byte lines (packed.h): 16 rows x 4 consecutive k of e4m3 codes, ordered so
// that AVX-512's byte unpacks give bf16 pairs lane by lane: byte
//   16 * (r / 4) + 8 * ((k % 4) / 2) + 2 * (r % 4) + k % 2
// of line k / 4 holds row r's code at k. Widened to bf16 words, unpacklo_epi8 of a line gives row
// r's pair (k0, k1) in dword r, and unpackhi_epi8 its pair (k2, k3): the operands of vdpbf16ps
// against the broadcast activation pairs, as the bf16 format's lines are.
#pragma once

#include <array>
#include <cstdint>

#include "moe/core/dtype.h"

namespace moe::experts::internal {

// Byte of (row r of the block, column k) in the block's lines.
constexpr int64_t Fp8Index(int64_t r, int64_t k) {
  return (k / 4) * 64 + 16 * (r / 4) + 8 * ((k % 4) / 2) + 2 * (r % 4) + k % 2;
}

// bf16 bits of each e4m3 magnitude (code & 0x7f), split in high and low bytes for the byte
// permutes: e4m3 values are exact in bf16 (3 mantissa bits, exponents 2^-9 .. 2^8).
struct Fp8Bf16Table {
  alignas(64) std::array<uint8_t, 128> hi;
  alignas(64) std::array<uint8_t, 128> lo;
};
inline const Fp8Bf16Table& Fp8ToBf16Table() {
  static const Fp8Bf16Table t = [] {
    Fp8Bf16Table t{};
    for (int c = 0; c < 128; ++c) {
      const uint16_t b = core::FloatToBf16(core::F8E4M3ToFloat(static_cast<uint8_t>(c)));
      t.hi[c] = static_cast<uint8_t>(b >> 8);
      t.lo[c] = static_cast<uint8_t>(b & 0xff);
    }
    return t;
  }();
  return t;
}

}  // namespace moe::experts::internal
