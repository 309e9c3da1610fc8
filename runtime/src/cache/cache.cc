#include "moe/runtime/cache.h"

#include <utility>

#include "moe/runtime/backend.h"

namespace moe::runtime {

const char* CacheKindName(CacheKind kind) {
  switch (kind) {
    case CacheKind::kPagedKv:
      return "paged K/V";
    case CacheKind::kPagedLatent:
      return "paged latent";
    case CacheKind::kRecurrent:
      return "recurrent state";
  }
  return "?";
}

int64_t CachePlan::BlockBytes() const {
  int64_t bytes = 0;
  for (const CacheGroup& g : groups) bytes += g.BlockBytes();
  return bytes;
}

int64_t CachePlan::BytesPerToken() const {
  int64_t bytes = 0;
  for (const CacheGroup& g : groups) {
    if (g.paged()) bytes += g.BlockBytes() / g.block_size;
  }
  return bytes;
}

int64_t CachePlan::StateBytesPerSequence() const {
  int64_t bytes = 0;
  for (const CacheGroup& g : groups) {
    if (!g.paged()) bytes += g.state_bytes * g.slots_per_seq * g.num_layers();
  }
  return bytes;
}

int CachePlan::block_size() const {
  for (const CacheGroup& g : groups) {
    if (g.paged()) return g.block_size;
  }
  return 0;
}

int CachePlan::Find(CacheKind kind) const {
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].kind == kind) return static_cast<int>(i);
  }
  return -1;
}

CachePlan PlanCache(const ModelSpec& local_spec, Range layers, const CacheOptions& options) {
  CacheGroup g;
  g.kind = local_spec.uses_mla() ? CacheKind::kPagedLatent : CacheKind::kPagedKv;
  for (int64_t layer = layers.begin; layer < layers.end; ++layer) g.layers.push_back(static_cast<int>(layer));
  g.dtype = options.dtype;
  g.block_size = options.block_size;
  if (g.kind == CacheKind::kPagedLatent) {
    // One row a position, whatever the heads (a tensor split replicates it on every rank).
    g.heads = 1;
    g.head_dim = local_spec.mla.latent_width();
    g.bytes_per_block_layer = LatentBytesPerPositionLayer(g.head_dim, g.dtype) * g.block_size;
  } else {
    g.heads = local_spec.num_kv_heads;
    g.head_dim = local_spec.head_dim;
    g.bytes_per_block_layer = KvBytesPerPositionLayer(g.heads, g.head_dim, g.dtype) * g.block_size;
  }
  CachePlan plan;
  plan.groups.push_back(std::move(g));
  return plan;
}

KvCacheShape KvShapeOf(const CacheGroup& group, int num_blocks) {
  KvCacheShape shape;
  shape.num_layers = group.num_layers();
  shape.num_blocks = num_blocks;
  shape.block_size = group.block_size;
  shape.num_kv_heads = group.heads;
  shape.head_dim = group.head_dim;
  return shape;
}

namespace {

void* LayerAt(const DeviceBuffer& b, const KvCacheShape& shape, int layer, int64_t per_block, core::DType dtype) {
  return static_cast<char*>(b.tensor().data) +
         static_cast<int64_t>(layer) * (shape.num_blocks + 1) * per_block * core::DTypeSize(dtype);
}

}  // namespace

KvCache::KvCache(const KvCacheShape& shape, core::DType dtype, std::unique_ptr<DeviceBuffer> k,
                 std::unique_ptr<DeviceBuffer> v, std::unique_ptr<DeviceBuffer> k_scale,
                 std::unique_ptr<DeviceBuffer> v_scale)
    : shape_(shape),
      dtype_(dtype),
      k_(std::move(k)),
      v_(std::move(v)),
      k_scale_(std::move(k_scale)),
      v_scale_(std::move(v_scale)) {}

KvCache::~KvCache() = default;

void* KvCache::k(int layer) const { return LayerAt(*k_, shape_, layer, shape_.elements_per_block_layer(), dtype_); }
void* KvCache::v(int layer) const {
  if (v_ == nullptr) return nullptr;
  return LayerAt(*v_, shape_, layer, shape_.elements_per_block_layer(), dtype_);
}

float* KvCache::k_scale(int layer) const {
  if (k_scale_ == nullptr) return nullptr;
  return static_cast<float*>(
      LayerAt(*k_scale_, shape_, layer, int64_t{shape_.block_size} * shape_.num_kv_heads, core::DType::kF32));
}

float* KvCache::v_scale(int layer) const {
  if (v_scale_ == nullptr) return nullptr;
  return static_cast<float*>(
      LayerAt(*v_scale_, shape_, layer, int64_t{shape_.block_size} * shape_.num_kv_heads, core::DType::kF32));
}

}  // namespace moe::runtime
