// The paged KV cache: fixed-size blocks of positions, each holding the keys and values of
// every layer for `block_size` consecutive positions of one sequence. A sequence's block table
// lists its blocks in position order; position p lives in block table[p / block_size], slot
// p % block_size.
//
// Layout, for K and V separately: [layer][block][kv_head][slot][head_dim] fp32, so that the
// keys of one head in one block are contiguous for the attention's inner loop.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/backend.h"

namespace moe::runtime {

struct KvCacheShape {
  int num_layers = 0;
  int num_blocks = 0;
  int block_size = 16;
  int num_kv_heads = 0;
  int head_dim = 0;

  int64_t floats_per_block_layer() const {
    return static_cast<int64_t>(block_size) * num_kv_heads * head_dim;
  }
  int64_t bytes() const {
    return 2 * floats_per_block_layer() * num_blocks * num_layers * static_cast<int64_t>(sizeof(float));
  }
};

class KvCache {
 public:
  // kResourceExhausted if the backend cannot hold it.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(Backend& backend, const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }
  // Start of block `block` of `layer` in the K (or V) storage.
  float* k(int layer, int block) { return k_->data() + Offset(layer, block); }
  float* v(int layer, int block) { return v_->data() + Offset(layer, block); }

 private:
  KvCache(const KvCacheShape& shape, std::unique_ptr<DeviceBuffer> k, std::unique_ptr<DeviceBuffer> v)
      : shape_(shape), k_(std::move(k)), v_(std::move(v)) {}
  int64_t Offset(int layer, int block) const {
    return (static_cast<int64_t>(layer) * shape_.num_blocks + block) * shape_.floats_per_block_layer();
  }

  KvCacheShape shape_;
  std::unique_ptr<DeviceBuffer> k_;
  std::unique_ptr<DeviceBuffer> v_;
};

// Blocks needed to hold `positions` positions.
inline int BlocksFor(int64_t positions, int block_size) {
  return static_cast<int>((positions + block_size - 1) / block_size);
}

}  // namespace moe::runtime
