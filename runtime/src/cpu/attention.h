// Causal attention of one step's queries over the CPU backend's paged fp32 KV cache: the plain
// reference (one query at a time, as the backend first computed it) and the blocked kernel it
// runs, which reads each key and value once for a block of up to 16 queries (the heads of one
// GQA group, and for a prefill chunk several of its tokens) with an online softmax. Decode rows
// with long contexts also split their keys, so that one sequence's few blocks keep every thread
// busy; the splits are then combined.
//
// A row's output does not depend on the rows it is batched with, nor on the cache's block size or
// where its blocks lie, to the bit: each query is one lane of its block and lanes never mix, the
// keys go in tiles of 16 positions from position 0, masked keys add exact zeros, and whether a
// row's keys are split depends only on its own sequence (a one-token chunk) and length. So a
// decode row gets the bits its row got in a prefill, unless its keys were split (more than 128).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"

namespace moe::runtime::internal {

// One layer's keys and values in the paged cache, [block][kv_head][slot][head_dim] fp32 each.
struct PagedKv {
  const float* k = nullptr;
  const float* v = nullptr;
  int block_size = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
};

// A step's rotated queries and where their outputs go. The rows of sequence s are
// [seq_start[s], seq_start[s + 1]); row r attends to positions 0..positions[r] of its sequence,
// found through the sequence's row of block_table.
struct AttentionQueries {
  const float* q = nullptr;  // [rows x num_heads * head_dim]
  float* out = nullptr;      // [rows x num_heads * head_dim]
  int num_heads = 0;
  float scale = 1.0f;
  const int32_t* positions = nullptr;  // [rows]
  const int32_t* seq_start = nullptr;  // [num_seqs + 1]
  int num_seqs = 0;
  const int32_t* block_table = nullptr;  // [num_seqs x max_blocks]
  int max_blocks = 0;
};

// Runs body(begin, end) over ranges that cover [0, n), in parallel (the backend's threads).
using ParallelLoop =
    absl::FunctionRef<void(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t begin, int64_t end)> body)>;

// The reference: for each row and head, every score by DotF32, the softmax with std::exp, then
// an Axpy of each value row.
void PagedAttentionReference(const PagedKv& kv, const AttentionQueries& q, ParallelLoop parallel);

// The instruction sets the blocked kernel is compiled for: one source, three builds.
enum class AttentionIsa { kPortable, kAvx2, kAvx512 };
const char* AttentionIsaName(AttentionIsa isa);
// Whether this CPU runs `isa`.
bool AttentionIsaSupported(AttentionIsa isa);
// The fastest this CPU runs.
AttentionIsa BestAttentionIsa();

// What the blocked kernel keeps between calls: its work list and the key splits' partial
// results, grown to the largest step, so that a warm step allocates nothing. One per caller.
class AttentionScratch {
 public:
  struct Item;
  struct Merge;
  struct Lanes;
  AttentionScratch();
  ~AttentionScratch();

 private:
  friend void PagedAttention(const PagedKv&, const AttentionQueries&, AttentionIsa, ParallelLoop, AttentionScratch&);
  std::vector<Item> items_;
  std::vector<Merge> merges_;
  std::vector<Lanes> partials_;
};

// The blocked kernel, built for `isa` (which this CPU must run). A split's partial result is only
// a few kilobytes, so head_dim may be anything.
void PagedAttention(const PagedKv& kv, const AttentionQueries& q, AttentionIsa isa, ParallelLoop parallel,
                    AttentionScratch& scratch);

}  // namespace moe::runtime::internal
