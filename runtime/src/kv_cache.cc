#include "moe/runtime/kv_cache.h"

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"

namespace moe::runtime {

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(Backend& backend, const KvCacheShape& shape) {
  if (shape.num_blocks <= 0 || shape.block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache needs positive num_blocks and block_size, got ",
                                                   shape.num_blocks, " and ", shape.block_size));
  }
  const int64_t floats = shape.floats_per_block_layer() * shape.num_blocks * shape.num_layers;
  auto k = backend.Allocate(floats);
  auto v = k.ok() ? backend.Allocate(floats) : absl::StatusOr<std::unique_ptr<DeviceBuffer>>(k.status());
  if (!k.ok() || !v.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate a KV cache of ", shape.bytes() >> 20,
                                                     " MiB (", shape.num_blocks, " blocks of ", shape.block_size,
                                                     " positions) on ", backend.name()));
  }
  return std::unique_ptr<KvCache>(new KvCache(shape, std::move(*k), std::move(*v)));
}

}  // namespace moe::runtime
