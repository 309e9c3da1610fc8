// The CPU reference backend: fp32 accumulation from bf16 (or f32) weights, parallel over a
// oneTBB arena. Weights in bf16 and f32 are used in place from the mapped checkpoint; f16 ones
// are converted to f32 once.
#pragma once

#include <memory>

#include "moe/runtime/backend.h"

namespace moe::runtime {

// threads <= 0: every core this process may run on.
std::unique_ptr<Backend> CreateCpuBackend(int threads = 0);

}  // namespace moe::runtime
