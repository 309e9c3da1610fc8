// KvBlockAllocator: hands out the block ids of an executor's KV cache. The executor holds the
// cache (in this process or in a worker); the scheduler alone decides which sequence owns which
// block, and sends the block tables in every StepPlan.
//
// Thread-safety: none; the scheduler owns it and calls it from its one thread.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace moe::scheduler {

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

}  // namespace moe::scheduler
