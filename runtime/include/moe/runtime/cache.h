// The cache a model keeps per sequence across steps, described as groups of layers that share a
// kind and a layout (vLLM v1's KVCacheSpec per layer, grouped). PlanCache is the one place the
// bytes of a cache are computed: the model (its KV block bytes and the cache it creates), the
// memory plan and the backend's allocation all read a CachePlan.
//
// Kinds:
// - kPagedKv: keys and values of every KV head, paged in blocks of block_size positions (GQA/MHA
//   attention). Every model served today is one group of this kind over all its layers.
// - kPagedLatent: one compressed row per position (DeepSeek-V3 MLA: the 512-wide latent and the
//   64-wide rope key), paged like K/V but with no separate V.
// - kRecurrent: a fixed state per sequence slot (Qwen3-Next Gated DeltaNet), not paged;
//   slots_per_seq = 1 + the longest draft, so that a rejected draft can roll back to the state
//   after the last accepted token.
//
// The scheduler's BlockPool (moe/scheduler/block_pool.h) hands out block ids; one id names the same
// block in every paged group (a step plan's SequenceChunk carries one table per paged group; today
// every group shares the first table).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/core/dtype.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/parallel.h"

namespace moe::runtime {

class DeviceBuffer;

enum class CacheKind { kPagedKv, kPagedLatent, kRecurrent };

const char* CacheKindName(CacheKind kind);

// A set of layers whose cache has one kind and one layout.
struct CacheGroup {
  CacheKind kind = CacheKind::kPagedKv;
  std::vector<int> layers;  // model layer ids, ascending; the cache's layer i is layers[i]
  core::DType dtype = core::DType::kF32;
  // Paged kinds: positions per block, and one position's row: `heads` vectors of `head_dim`
  // elements (kPagedKv: K and V each; kPagedLatent: one latent head of the latent width).
  int block_size = 16;
  int heads = 0;
  int head_dim = 0;
  int64_t bytes_per_block_layer = 0;  // one block of one layer, scales included
  // kRecurrent: bytes of one state slot of one layer, and slots per sequence.
  int64_t state_bytes = 0;
  int slots_per_seq = 0;

  bool paged() const { return kind != CacheKind::kRecurrent; }
  int num_layers() const { return static_cast<int>(layers.size()); }
  // One block of every layer of the group (0 for a recurrent group).
  int64_t BlockBytes() const { return paged() ? bytes_per_block_layer * num_layers() : 0; }
};

struct CacheOptions {
  int block_size = 16;
  core::DType dtype = core::DType::kF32;  // the element type of paged caches
  // The longest draft a step may carry: recurrent groups keep 1 + max_draft slots per sequence.
  int max_draft = 0;
};

struct CachePlan {
  std::vector<CacheGroup> groups;

  // Bytes of one block id across every paged group: what each block the scheduler hands out
  // costs.
  int64_t BlockBytes() const;
  // Bytes one position of one sequence takes in the paged groups.
  int64_t BytesPerToken() const;
  // Bytes of one sequence's recurrent state slots (0 without recurrent groups).
  int64_t StateBytesPerSequence() const;
  // The positions per block of the paged groups (they share one block size), 0 with none.
  int block_size() const;
  // Index of the first group of `kind`, or -1.
  int Find(CacheKind kind) const;
};

// The cache of the layers [layers.begin, layers.end) of a model whose (local: this rank's share of
// a tensor split, so its KV heads) spec is `local_spec`. A GQA model gets one kPagedKv group with K
// and V of local_spec.num_kv_heads heads of head_dim, in options.dtype; fp8 (e4m3) adds one fp32
// scale per position, KV head and each of K and V. An MLA model (deepseek_v3) gets one
// kPagedLatent group of one row of mla.latent_width() values a position (no V).
CachePlan PlanCache(const ModelSpec& local_spec, Range layers, const CacheOptions& options);

// Blocks needed to hold `positions` positions.
inline int BlocksFor(int64_t positions, int block_size) {
  return static_cast<int>((positions + block_size - 1) / block_size);
}

// Bytes one position takes in one layer's paged K/V cache, K and V, in `dtype`: fp8 adds one fp32
// scale per KV head to each of K and V. PlanCache's kPagedKv rule.
inline int64_t KvBytesPerPositionLayer(int kv_heads, int head_dim, core::DType dtype) {
  return 2 * static_cast<int64_t>(kv_heads) *
         (head_dim * core::DTypeSize(dtype) + (dtype == core::DType::kF8E4M3 ? int64_t{4} : int64_t{0}));
}

// Bytes one position takes in one layer's paged latent cache (MLA): kv_lora_rank + qk_rope_head_dim
// values, `width`, in `dtype`; fp8 adds one fp32 scale. PlanCache's kPagedLatent rule.
inline int64_t LatentBytesPerPositionLayer(int width, core::DType dtype) {
  return int64_t{width} * core::DTypeSize(dtype) + (dtype == core::DType::kF8E4M3 ? int64_t{4} : int64_t{0});
}

// The shape of a paged group's buffers, as the attention kernels index them (a kPagedLatent group:
// one head of the latent width).
struct KvCacheShape {
  int num_layers = 0;
  int num_blocks = 0;  // blocks the scheduler may hand out; the cache holds one more (scratch)
  int block_size = 16;
  int num_kv_heads = 0;
  int head_dim = 0;

  int64_t elements_per_block_layer() const { return static_cast<int64_t>(block_size) * num_kv_heads * head_dim; }
};

// The buffers of a paged group of `num_blocks` blocks.
KvCacheShape KvShapeOf(const CacheGroup& group, int num_blocks);

// The paged KV cache (a kPagedKv group): fixed-size blocks of positions, each holding the keys and
// values of every layer for `block_size` consecutive positions of one sequence. A sequence's block
// table lists its blocks in position order; position p lives in block table[p / block_size], slot
// p % block_size. Layout, for K and V separately: [layer][block][kv_head][slot][head_dim], in the
// cache's dtype, so that one head's keys in one block are contiguous. Block `num_blocks` (one past
// the last the scheduler hands out) is scratch: padded rows of a step write there. An fp8 cache
// (e4m3) also holds one fp32 scale per position and KV head for each of K and V,
// [layer][block][kv_head][slot]: a head's stored vector times its scale is the key or value.
// Backend::CreateKvCache makes one from a CachePlan. A kPagedLatent group's cache keeps its rows in
// K alone (kind() says which): v() and the scales are null.
class KvCache {
 public:
  KvCache(const KvCacheShape& shape, core::DType dtype, std::unique_ptr<DeviceBuffer> k,
          std::unique_ptr<DeviceBuffer> v, std::unique_ptr<DeviceBuffer> k_scale = nullptr,
          std::unique_ptr<DeviceBuffer> v_scale = nullptr);
  ~KvCache();

  const KvCacheShape& shape() const { return shape_; }
  core::DType dtype() const { return dtype_; }
  CacheKind kind() const { return v_ == nullptr ? CacheKind::kPagedLatent : CacheKind::kPagedKv; }
  int scratch_block() const { return shape_.num_blocks; }
  // Layer `layer`'s K (or V) storage: [num_blocks + 1][kv_heads][block_size][head_dim].
  void* k(int layer) const;
  void* v(int layer) const;
  // An fp8 cache's scales of layer `layer`: [num_blocks + 1][kv_heads][block_size] fp32; null for
  // other dtypes.
  float* k_scale(int layer) const;
  float* v_scale(int layer) const;

 private:
  KvCacheShape shape_;
  core::DType dtype_;
  std::unique_ptr<DeviceBuffer> k_;
  std::unique_ptr<DeviceBuffer> v_;
  std::unique_ptr<DeviceBuffer> k_scale_;
  std::unique_ptr<DeviceBuffer> v_scale_;
};

}  // namespace moe::runtime
