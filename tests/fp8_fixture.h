// FP8 copies of the fixture models, written as the FP8 releases lay theirs out (fp8_test,
// cuda_goldens_test).
#pragma once

#include <functional>
#include <string>

#include "moe/core/dtype.h"
#include "moe/runtime/safetensors_writer.h"

namespace moe::testing {

struct Fp8Layout {
  int block_rows = 128, block_cols = 128;
  core::DType scale_dtype = core::DType::kF32;
};

// Writes fixture `arch` into `fp8_dir` as an FP8 checkpoint: each projection and expert F8_E4M3
// (per block, scale = amax / 448, codes rounded to nearest) beside its `_scale_inv`, the
// embedding, norms and router as stored, quantization_config in config.json. When `f32_dir` is not
// empty, the same values (code * scale) as plain f32 go into `f32_dir`. `edit` may change the FP8
// entries (name, dtype, shape; return false to drop one) before they are written.
void WriteFp8Fixture(const std::string& arch, const Fp8Layout& layout, const std::string& fp8_dir,
                     const std::string& f32_dir,
                     const std::function<bool(runtime::TensorEntry&)>& edit = nullptr);

}  // namespace moe::testing
