#include "moe/scheduler/kv_block_allocator.h"

#include <numeric>

#include "absl/strings/str_cat.h"

namespace moe::scheduler {

KvBlockAllocator::KvBlockAllocator(int num_blocks) : num_blocks_(num_blocks), free_(num_blocks) {
  // Hand out low block ids first: pop from the back of a descending list.
  std::iota(free_.rbegin(), free_.rend(), 0);
}

absl::Status KvBlockAllocator::Allocate(int n, std::vector<int32_t>* table) {
  if (n > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: ", n, " blocks wanted, ", num_free(), " of ", num_blocks_, " free"));
  }
  for (int i = 0; i < n; ++i) {
    table->push_back(free_.back());
    free_.pop_back();
  }
  return absl::OkStatus();
}

void KvBlockAllocator::Free(std::vector<int32_t>* table) {
  free_.insert(free_.end(), table->rbegin(), table->rend());
  table->clear();
}

}  // namespace moe::scheduler
