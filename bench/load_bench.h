// `moeserve bench load`: loading a checkpoint's experts against its bounds, measured right after
// with the pool's thread count: how fast the same threads read the checkpoint files themselves,
// from the page cache and, for what was not cached before the load, from disk; and how fast they
// copy them from the page cache into fresh memory of the arena's kind and size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::experts {
class ExpertPool;
}  // namespace moe::experts

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

// The bound for a load: reading the checkpoint files at page-cache speed for the share that was
// cached before it, at disk speed for the rest.
struct LoadBound {
  double page_cache_gbps = 0, disk_gbps = 0, gbps = 0;
  // Copying the files from the page cache into fresh memory of the arena's kind and size, and
  // the bound that gives (the disk's share as in gbps).
  double copy_gbps = 0, copy_bound_gbps = 0;
  std::string disk_note;  // why the disk's speed is not in the bound, if it is not
};

// One load against its bound (zeros in `bound` when the pool attached to a published arena).
struct LoadBenchResult {
  std::string pool;  // ExpertPool::Describe()
  bool attached = false;
  int threads = 0;
  int64_t arena_bytes = 0;
  std::string pages;             // HostArena::page_kind()
  int64_t checkpoint_bytes = 0;  // read by the load (0 when attached)
  double expert_seconds = 0;     // the pool's load
  double load_gbps = 0;          // checkpoint bytes over expert_seconds (0 when attached)
  double model_load_seconds = 0;
  double cached_before = 0;  // the files' share in the page cache before the load
  LoadBound bound;
  double ratio = 0, copy_ratio = 0;  // load_gbps over bound.gbps and bound.copy_bound_gbps
};

// A model's expert pool, loaded: owned by the caller, and valid until RunLoadBench returns.
using ExpertPoolLoader = std::function<absl::StatusOr<const experts::ExpertPool*>()>;

// Times `load` of the model in `model_dir`, whose pool is in the shared segment `shm_name` (""
// for a private arena), after noting which share of its checkpoint files the page cache holds;
// then, unless the pool attached to a published arena, measures the bound with the pool's
// threads. Errors: the loader's, and the checkpoint files' (kNotFound when there are none).
absl::StatusOr<LoadBenchResult> RunLoadBench(const std::string& model_dir, const std::string& shm_name,
                                             const ExpertPoolLoader& load);

// The result as lines of text, or as one JSON object on one line.
void PrintLoadBench(const LoadBenchResult& result, bool json, std::ostream& out);

}  // namespace moe::bench
