// The CPU reference backend: fp32 accumulation from bf16 (or f32) weights, parallel over a
// oneTBB arena. Weights in bf16 and f32 are used in place from the mapped checkpoint; f16 ones
// are converted to f32 once.
#pragma once

#include <memory>

#include "moe/experts/packed.h"
#include "moe/runtime/backend.h"

namespace moe::runtime {

// threads <= 0: every core this process may run on. `policy` packs Linears' matrices (attention,
// shared experts, dense FFN, an untied LM head; never the embedding or a router) in the expert
// pool's int8/int4 formats, by role, and runs them with its kernels (VNNI for few tokens, AMX for
// many where the CPU has it); bf16 (the default) computes from the checkpoint's weights in fp32 as
// the reference does.
std::unique_ptr<Backend> CreateCpuBackend(int threads = 0, const WeightPolicy& policy = {});

}  // namespace moe::runtime
