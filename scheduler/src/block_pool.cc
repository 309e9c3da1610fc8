#include "moe/scheduler/block_pool.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace moe::scheduler {

BlockHash HashBlock(BlockHash parent, std::span<const int32_t> tokens) {
  // splitmix64's finalizer over the parent, then each token folded in and mixed again.
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(parent + 0x9e3779b97f4a7c15ull);
  for (const int32_t t : tokens) h = mix(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(t)) + 0x9e3779b97f4a7c15ull));
  return mix(h ^ tokens.size());
}

BlockPool::BlockPool(int num_blocks)
    : refcount_(num_blocks, 0),
      hash_(num_blocks, 0),
      has_hash_(num_blocks, false),
      free_(num_blocks),
      lru_at_(num_blocks),
      in_lru_(num_blocks, false) {
  // Hand out low block ids first: pop from the back of a descending list.
  std::iota(free_.rbegin(), free_.rend(), 0);
}

void BlockPool::Forget(int32_t block) {
  if (!has_hash_[block]) return;
  auto it = cached_.find(hash_[block]);
  if (it != cached_.end() && it->second == block) cached_.erase(it);
  has_hash_[block] = false;
}

absl::Status BlockPool::Allocate(int n, std::vector<int32_t>* table) {
  if (n > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: ", n, " blocks wanted, ", num_free(), " of ", num_blocks(), " free"));
  }
  for (int i = 0; i < n; ++i) {
    int32_t block;
    if (!free_.empty()) {
      block = free_.back();
      free_.pop_back();
    } else {
      block = lru_.front();
      lru_.pop_front();
      in_lru_[block] = false;
      Forget(block);
      ++counters_.evicted;
    }
    refcount_[block] = 1;
    table->push_back(block);
  }
  counters_.allocated += n;
  return absl::OkStatus();
}

void BlockPool::Release(std::vector<int32_t>* table) {
  for (auto it = table->rbegin(); it != table->rend(); ++it) {
    const int32_t block = *it;
    if (--refcount_[block] > 0) continue;
    if (has_hash_[block]) {
      lru_at_[block] = lru_.insert(lru_.end(), block);
      in_lru_[block] = true;
    } else {
      free_.push_back(block);
    }
  }
  table->clear();
}

void BlockPool::Commit(int32_t block, BlockHash hash) {
  if (has_hash_[block]) return;
  if (!cached_.try_emplace(hash, block).second) return;  // another block holds these contents
  hash_[block] = hash;
  has_hash_[block] = true;
  ++counters_.committed;
}

int BlockPool::Lookup(std::span<const BlockHash> hashes, std::vector<int32_t>* hit_table) {
  counters_.looked_up += static_cast<int64_t>(hashes.size());
  int hits = 0;
  for (const BlockHash hash : hashes) {
    auto it = cached_.find(hash);
    if (it == cached_.end()) break;
    const int32_t block = it->second;
    if (in_lru_[block]) {
      lru_.erase(lru_at_[block]);
      in_lru_[block] = false;
    }
    ++refcount_[block];
    hit_table->push_back(block);
    ++hits;
  }
  counters_.hits += hits;
  return hits;
}

void BlockPool::ForgetAll() {
  for (const int32_t block : lru_) {
    in_lru_[block] = false;
    free_.push_back(block);
  }
  lru_.clear();
  cached_.clear();
  std::fill(has_hash_.begin(), has_hash_.end(), false);
}

}  // namespace moe::scheduler
