// Loading the expert pool's arena: every routed expert of a checkpoint packed into it by the
// pool's threads, or a published shared segment attached to instead.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "moe/experts/arena.h"
#include "moe/experts/expert_pool.h"
#include "oneapi/tbb/task_arena.h"
#include "packed_experts.h"

namespace moe::experts::internal {

struct LoadedExperts {
  std::unique_ptr<HostArena> arena;  // filled and published, or attached to
  // From the start, the arena's creation included: a shared-memory one gets its pages then, if
  // ever it is filled in advance.
  double seconds = 0;
  int64_t checkpoint_bytes = 0;  // read from the source (0 when attached)
};

// Makes an arena for every expert of `shape` laid out as `layout` (a private one, or the shared
// segment options.shm_name, attached to if it is already published) and, unless attached, packs
// each expert from `source` into it, in a parallel loop in `threads`, with progress on stderr
// when options.progress. Errors: the arena's and the source's; kInvalidArgument for a weight of
// another shape than `shape` says.
absl::StatusOr<LoadedExperts> LoadExperts(const ExpertShape& shape, const ExpertPoolOptions& options,
                                          const PackedExperts& layout, tbb::task_arena& threads,
                                          const ExpertWeightSource& source);

}  // namespace moe::experts::internal
