// Random-weight checkpoints at real shapes, in the Hugging Face layout (config.json plus
// safetensors, sharded with an index when large), for demos and benchmarks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace moe::deploy {

struct MakeModelOptions {
  std::string arch = "qwen3_moe";
  std::string preset = "tiny";  // tiny | qwen3-30b-a3b
  int layers = 0;               // 0: the preset's
  int vocab = 0;                // 0: the preset's
  uint64_t seed = 0;
  int64_t max_shard_bytes = 4ll << 30;
  std::string out;
  bool progress = true;  // progress lines on stderr
};

const std::vector<std::string>& MakeModelPresets();

// kInvalidArgument for an unknown arch or preset or a bad size; kResourceExhausted when the
// disk is full (space is reserved before writing).
absl::Status MakeModel(const MakeModelOptions& options);

}  // namespace moe::deploy
