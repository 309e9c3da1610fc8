#include "moe/runtime/token_mask.h"

#include <bit>
#include <limits>

namespace moe::runtime {

int TokenMask::Count(int vocab) const {
  int n = 0;
  for (int32_t id = 0; id < vocab; ++id) n += allows(id) ? 1 : 0;
  return n;
}

void TokenMask::Apply(float* logits, int vocab) const {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < vocab; ++i) {
    const size_t w = static_cast<size_t>(i) / 32;
    if (w >= words_.size() || ((words_[w] >> (i % 32)) & 1u) == 0) logits[i] = kNone;
  }
}

}  // namespace moe::runtime
