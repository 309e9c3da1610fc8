// Splitting one model over several ranks (one worker process each), as plain functions: which
// share of every layer a rank holds in a tensor split, and which layers in a layer split. The
// model (model.h) loads and runs its share by them; the cluster config checks a plan with them
// before anything starts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/model_spec.h"

namespace moe::comm {
class Communicator;
}

namespace moe::runtime {

enum class ParallelMode { kNone, kTensor, kLayer };

// "none", "tensor", "layer".
const char* ParallelModeName(ParallelMode mode);

// The split a model runs in. `comm` (not owned, outliving the model) joins the ranks: host
// buffers (Gloo) for the CPU backend, device buffers on the backend's stream (NCCL) for a GPU.
struct ParallelConfig {
  ParallelMode mode = ParallelMode::kNone;
  int rank = 0;
  int size = 1;
  comm::Communicator* comm = nullptr;

  bool split() const { return mode != ParallelMode::kNone && size > 1; }
  // The rank that samples and answers with the step's tokens: a layer split's last stage, else
  // rank 0 (a tensor split's ranks all hold the logits; the others need not sample them).
  int answering_rank() const { return AnsweringRank(mode, size); }
  bool answers() const { return rank == answering_rank(); }
  static int AnsweringRank(ParallelMode mode, int size) { return mode == ParallelMode::kLayer ? size - 1 : 0; }
};

// A contiguous range [begin, end).
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range&) const = default;
};

// Rank `rank`'s share of each layer in a tensor split of `size`:
// - attention: query heads [q_heads), and the KV heads those read ([kv_heads]: a share of them when
//   there are at least as many KV heads as ranks, else the one or few each rank's queries need,
//   held by several ranks);
// - the dense FFN's and the shared experts' intermediate columns, and the LM head's vocabulary rows;
// - the routed experts it owns: expert e belongs to rank e % size (each rank computes only those,
//   and the block's all-reduce sums them with the rest).
// The router, norms, embedding and routing biases are held whole by every rank.
struct TensorShard {
  int rank = 0, size = 1;
  Range q_heads, kv_heads;
  Range dense, shared, vocab;
  bool OwnsExpert(int expert) const { return expert % size == rank; }
};

// kFailedPrecondition naming the config key and the fix when the split cannot work: query heads
// that do not divide by the ranks, KV heads that neither divide nor are divided by them, more ranks
// than query heads.
absl::StatusOr<TensorShard> PlanTensorShard(const ModelSpec& spec, int rank, int size);

// Rank `rank`'s layers [begin, end) in a layer split of `stages`: contiguous, as even as the layer
// count allows (the first stages take one more). kFailedPrecondition for more stages than layers.
absl::StatusOr<Range> PlanLayerStage(const ModelSpec& spec, int rank, int stages);

}  // namespace moe::runtime
