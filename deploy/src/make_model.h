// Random-weight checkpoints at real shapes, in the Hugging Face layout (config.json plus
// safetensors, sharded with an index when large), for demos and benchmarks. Every architecture
// the loader reads (runtime::SupportedModelTypes()) can be written, with the tensor names and
// config keys of its published checkpoints.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/runtime/model_spec.h"

namespace moe::deploy {

// Limits on what a user may ask for. They keep a typo (--vocab 99999999999) from becoming a
// checkpoint that fills the disk, while leaving room for every published MoE shape.
inline constexpr int64_t kMakeModelMaxLayers = runtime::kMaxLayers;  // what the loader accepts
inline constexpr int64_t kMakeModelMaxVocab = runtime::kMaxVocab;
inline constexpr int64_t kMakeModelMinShardBytes = int64_t{1} << 20;
inline constexpr int64_t kMakeModelMaxShardBytes = int64_t{1} << 40;

struct MakeModelOptions {
  std::string arch = "qwen3_moe";  // a model_type of runtime::SupportedModelTypes()
  std::string preset = "tiny";     // one of MakeModelPresets(arch)
  int64_t layers = 0;              // 0: the preset's; else 1..kMakeModelMaxLayers
  int64_t vocab = 0;               // 0: the preset's; else 1..kMakeModelMaxVocab
  uint64_t seed = 0;
  // Tensor bytes per safetensors shard (kMakeModelMinShardBytes..kMakeModelMaxShardBytes);
  // a bigger checkpoint is split, with an index.
  int64_t max_shard_bytes = int64_t{4} << 30;
  std::string out;         // the model directory to create
  bool overwrite = false;  // replace a non-empty `out` (only once the new one is complete)
  bool progress = true;    // progress lines on stderr
  // Write the projections and experts as an FP8 release does: F8_E4M3 with a weight_scale_inv of
  // one fp32 scale per 128 x 128 block, and quantization_config in config.json.
  bool fp8 = false;
};

// Every preset name, over all architectures (for help text).
// The presets that fit `arch` ("tiny" first); empty for an unknown arch.
std::vector<std::string> MakeModelPresets(std::string_view arch);

// Checks every option without touching the disk: kInvalidArgument naming the option (--arch,
// --preset, --layers, --vocab, --max-shard-mb, --out) when one is unknown or out of range.
absl::Status ValidateMakeModelOptions(const MakeModelOptions& options);

// The bytes the checkpoint will take on disk (tensors, headers, config and index), after the
// same checks as ValidateMakeModelOptions.
absl::StatusOr<int64_t> MakeModelCheckpointBytes(const MakeModelOptions& options);

// Writes the checkpoint into a temporary directory beside `out` and renames it into place at
// the end; on any error what was written is removed and `out` is left as it was.
//   kInvalidArgument: a bad option (as ValidateMakeModelOptions), or `out` (or a parent) is not
//     a directory;
//   kAlreadyExists: `out` is a non-empty directory and `overwrite` is not set;
//   kResourceExhausted: the checkpoint does not fit in the free space of `out`'s filesystem
//     (checked before anything is written), or a write failed for lack of space or a file size
//     limit;
//   kPermissionDenied: `out` or its parent cannot be written;
//   kInternal: another file system error (creating, renaming).
absl::Status MakeModel(const MakeModelOptions& options);

}  // namespace moe::deploy
