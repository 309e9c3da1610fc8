// FP8 checkpoints: the `quantization_config` of a Hugging Face config.json, and the weight source
// that pairs each fp8 weight with its scales.
//
// The layout read is DeepSeek-V3's and the Qwen3 / GLM "-FP8" releases': `quant_method: "fp8"`,
// `fmt: "e4m3"`, `weight_block_size: [rows, cols]` (128 x 128), dynamic activations; each quantized
// weight W [N x K] is F8_E4M3 with a sibling `<name>_scale_inv` of [ceil(N / rows) x ceil(K / cols)]
// scales (F32 or BF16), and W's value is code * scale of its block. Tensors the method leaves alone
// (norms, the router, embeddings, `modules_to_not_convert`) stay bf16. Without weight_block_size
// each fp8 weight has one scale ([] or [1]).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/weight_source.h"

namespace moe::runtime::internal {

struct WeightQuantization {
  enum class Method { kNone, kFp8 };
  Method method = Method::kNone;
  // kFp8: the scale block (0 x 0: one scale per tensor).
  int block_rows = 0, block_cols = 0;
  // "fp8 e4m3, scale per 128x128 block"; "" for kNone.
  std::string Describe() const;
};

// Reads `quantization_config` from config.json's text (`source` names the file): kNone when absent;
// kInvalidArgument naming the key for a method moeserve does not read (gptq, awq,
// compressed-tensors, bitsandbytes, ...), an fp8 format other than e4m3, static activation scales,
// or a weight_block_size that is not two integers in [1, 4096].
absl::StatusOr<WeightQuantization> ReadQuantizationConfig(std::string_view config_json, const std::string& source);

// `base` with its fp8 weights as WeightFormat::kBlockScaled views (GetStored) carrying their
// scales, and the `_scale_inv` tensors out of Names(). Checked when made, before any tensor is
// handed out: every F8_E4M3 tensor is 2-D and has its
// scales, of F32 or BF16 and the shape the block gives; a missing or misshapen scale is
// kInvalidArgument naming both tensors and the file.
absl::StatusOr<std::unique_ptr<WeightSource>> WrapFp8Source(std::unique_ptr<WeightSource> base,
                                                            const WeightQuantization& q);

}  // namespace moe::runtime::internal
