// The paged KV cache (KvCache, KvCacheShape) is declared in backend.h: the backend creates it.
// What is left here hands out its blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "moe/runtime/backend.h"

namespace moe::runtime {

// Hands out block ids of one KvCache. Not thread-safe: the scheduler owns it.
class KvBlockAllocator {
 public:
  explicit KvBlockAllocator(int num_blocks);

  int num_free() const { return static_cast<int>(free_.size()); }
  int num_blocks() const { return num_blocks_; }
  // Appends `n` blocks to `table`; kResourceExhausted (and nothing taken) if fewer are free.
  absl::Status Allocate(int n, std::vector<int32_t>* table);
  // Returns every block of `table` and clears it.
  void Free(std::vector<int32_t>* table);

 private:
  int num_blocks_;
  std::vector<int32_t> free_;
};

}  // namespace moe::runtime
