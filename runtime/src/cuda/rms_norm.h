// RMSNorm on the GPU: the first CUDA kernel, reached through plain host functions.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace moe::runtime::cuda {

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w for rows of `cols` floats; w in bf16. Copies
// the inputs to the current GPU, runs the kernel on a new stream, copies the result back.
absl::Status RmsNormOnDevice(const float* host_x, const uint16_t* host_w_bf16, int64_t rows, int64_t cols, float eps,
                             float* host_out);

}  // namespace moe::runtime::cuda
