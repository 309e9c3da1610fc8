// The bound for loading a checkpoint's experts: how fast the same threads read the checkpoint
// files themselves, from the page cache and, for what was not cached before the load, from disk.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::bench {

// The checkpoint files of a model directory (*.safetensors), sorted; kNotFound if there are none.
absl::StatusOr<std::vector<std::string>> CheckpointFiles(const std::string& dir);

// The share of the files' bytes whose pages are in the page cache now (0 to 1).
absl::StatusOr<double> CachedShare(const std::vector<std::string>& files);

// Reads the files whole with `threads` threads, in 8 MiB pieces into each thread's own buffer, and
// returns GB/s. `direct`: with O_DIRECT, past the page cache (the disk's speed); kUnimplemented
// where the filesystem refuses it.
absl::StatusOr<double> ReadFilesGbps(const std::vector<std::string>& files, int threads, bool direct);

}  // namespace moe::bench
