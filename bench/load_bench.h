// The bounds for loading a checkpoint's experts: how fast the same threads read the checkpoint
// files themselves, from the page cache and, for what was not cached before the load, from disk;
// and how fast they copy them from the page cache into fresh memory the size of the arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::bench {

// The checkpoint files of a model directory (*.safetensors), sorted; kNotFound if there are none.
absl::StatusOr<std::vector<std::string>> CheckpointFiles(const std::string& dir);

// The share of the files' bytes whose pages are in the page cache now (0 to 1).
absl::StatusOr<double> CachedShare(const std::vector<std::string>& files);

// Reads the files whole with `threads` threads, each a run of 8 MiB pieces into its own buffer
// (from the page cache in chunks of 256 KiB, which stay in L2), and returns GB/s. `direct`: with
// O_DIRECT, past the page cache (the disk's speed); kUnimplemented where the filesystem refuses it.
absl::StatusOr<double> ReadFilesGbps(const std::vector<std::string>& files, int threads, bool direct);

// Reads the files as ReadFilesGbps does from the page cache, in chunks that stay in the thread's
// caches, and writes each chunk's share of `dst` with streaming stores: the file bytes at offset g
// (counted across the files, of `total` in all) go to dst[g * dst_bytes / total], the first
// bytes of each chunk as many as its share. So every byte of `dst` is written once: the least
// memory traffic of any load that reads the files and fills a new arena of dst_bytes (the packing
// left out). Pass memory that was never touched, as a new arena is. Returns GB/s of file bytes.
absl::StatusOr<double> CopyFilesGbps(const std::vector<std::string>& files, int threads, uint8_t* dst,
                                     size_t dst_bytes);

}  // namespace moe::bench
