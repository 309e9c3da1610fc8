// Random GGUF blocks for the tests: random codes, with scales small enough to be sane.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "moe/experts/gguf_types.h"

namespace moe::experts {

// Byte offsets of the fp16 scales (d, dmin) in each type's block.
inline std::vector<int> HalfOffsets(int type_id) {
  switch (type_id) {
    case kGgufQ4_1: case kGgufQ5_1: case kGgufQ4_K: case kGgufQ5_K: return {0, 2};
    case kGgufQ2_K: return {80, 82};
    case kGgufQ3_K: return {108};
    case kGgufQ6_K: return {208};
    case kGgufIQ1_M: return {};
    default: return {0};
  }
}

// Random blocks of `type` for a row of k values: random codes, scales between 2^-9 and 2^-6.
inline std::vector<uint8_t> RandomRow(const GgufType& type, int64_t k, std::mt19937& rng) {
  std::vector<uint8_t> row(GgufRowBytes(type, k));
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& b : row) b = static_cast<uint8_t>(byte(rng));
  for (int64_t blk = 0; blk < k / type.block_elements; ++blk) {
    uint8_t* p = row.data() + blk * type.block_bytes;
    for (int off : HalfOffsets(type.id)) {
      const uint16_t h = static_cast<uint16_t>((0x1800 + (byte(rng) << 4)) | (byte(rng) & 0x8000 ? 0x8000 : 0));
      std::memcpy(p + off, &h, 2);
    }
    if (type.id == kGgufIQ1_M) {  // the scale's nibbles at the top of the four u16 scale words
      const uint16_t h = static_cast<uint16_t>(0x1800 + (byte(rng) << 4));
      for (int i = 0; i < 4; ++i) {
        uint16_t w;
        std::memcpy(&w, p + 48 + 2 * i, 2);
        w = static_cast<uint16_t>((w & 0x0FFF) | (((h >> (4 * i)) & 0xF) << 12));
        std::memcpy(p + 48 + 2 * i, &w, 2);
      }
    }
  }
  return row;
}

}  // namespace moe::experts
