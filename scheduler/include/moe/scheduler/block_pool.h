// BlockPool: hands out the block ids of an executor's cache (one id names the same block in every
// paged cache group, moe/runtime/cache.h), counts who holds each, and keeps blocks that were full
// and accepted when freed, keyed by a hash of their contents, so that a later sequence with the
// same prefix can take them again instead of recomputing them (prefix caching; vLLM v1's
// BlockPool with its free-block queue and hash-to-block map).
//
// A block is in one of three states:
// - held: refcount > 0 (by one sequence, or by several that share a cached prefix);
// - cached-free: refcount 0 with a hash: Lookup can revive it; Allocate evicts it last, least
//   recently freed first;
// - free: refcount 0, no hash.
// The scheduler alone decides which sequence holds which block, and sends the block tables in
// every StepPlan. Its rules, which the pool does not check: commit only a full block whose tokens
// are all accepted (no drafts), hash it over the tokens of every block before it too, and never
// write into a block another sequence holds.
//
// Thread-safety: none; the scheduler owns it and calls it from its one thread.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"

namespace moe::scheduler {

// A block's contents and everything before it in its sequence, chained (the caller's hash).
using BlockHash = uint64_t;

// The hash of a full block of `tokens` that follows a block hashed `parent` (for a sequence's first
// block, `parent` is the cache's salt: whatever else changes the block's contents, such as the KV
// cache's dtype). 64 bits, well mixed: two different prefixes share a hash with probability about
// 2^-64 per pair.
BlockHash HashBlock(BlockHash parent, std::span<const int32_t> tokens);

class BlockPool {
 public:
  explicit BlockPool(int num_blocks);

  int num_blocks() const { return static_cast<int>(refcount_.size()); }
  // Blocks Allocate can hand out: free ones and cached-free ones.
  int num_free() const { return static_cast<int>(free_.size() + lru_.size()); }
  // Blocks that hold a hash and no sequence (evicted last).
  int num_cached_free() const { return static_cast<int>(lru_.size()); }
  int refcount(int32_t block) const { return refcount_[block]; }

  // Appends `n` blocks to `table`, each held once: free ones first (lowest id first on a fresh
  // pool), then cached-free ones, least recently freed first (their hashes are forgotten).
  // kResourceExhausted (and nothing taken) if fewer than n are free.
  absl::Status Allocate(int n, std::vector<int32_t>* table);
  // Lets go of every block of `table` and clears it: a block nobody holds any more goes to the
  // cached-free blocks when it has a hash (the table's last block first, so a sequence's tail is
  // evicted before its shared head), else to the free ones.
  void Release(std::vector<int32_t>* table);
  // Marks held block `block` full and accepted with contents `hash`: from now on a Lookup finds it.
  // When another block already has that hash, nothing changes (this one stays private).
  void Commit(int32_t block, BlockHash hash);
  // The longest run of `hashes`, from the first, that the pool holds blocks for: each such block
  // is held once more (revived when cached-free) and appended to `hit_table`. Returns how many.
  int Lookup(std::span<const BlockHash> hashes, std::vector<int32_t>* hit_table);
  // Forgets every hash: cached-free blocks become free and held ones private. For when the cache's
  // contents can no longer be trusted (a failed step, a worker lost and restarted).
  void ForgetAll();

  struct Counters {
    int64_t allocated = 0;  // blocks handed out by Allocate
    int64_t evicted = 0;    // cached-free blocks Allocate took (their hashes forgotten)
    int64_t committed = 0;  // Commit calls that made a block shareable
    int64_t looked_up = 0;  // hashes Lookup was asked about
    int64_t hits = 0;       // blocks Lookup found
  };
  const Counters& counters() const { return counters_; }

 private:
  // Drops `block`'s hash (it is about to be reused).
  void Forget(int32_t block);

  std::vector<int> refcount_;
  std::vector<BlockHash> hash_;  // per block: its hash while has_hash_
  std::vector<bool> has_hash_;
  std::vector<int32_t> free_;                         // popped from the back
  std::list<int32_t> lru_;                            // cached-free blocks, least recently freed first
  std::vector<std::list<int32_t>::iterator> lru_at_;  // per block: its place in lru_ (when there)
  std::vector<bool> in_lru_;
  std::unordered_map<BlockHash, int32_t> cached_;  // hash -> the block committed with it
  Counters counters_;
};

}  // namespace moe::scheduler
