#include "moe/runtime/parallel.h"

#include "absl/strings/str_cat.h"

namespace moe::runtime {

const char* ParallelModeName(ParallelMode mode) {
  switch (mode) {
    case ParallelMode::kNone:
      return "none";
    case ParallelMode::kTensor:
      return "tensor";
    case ParallelMode::kLayer:
      return "layer";
  }
  return "?";
}

namespace {

// The share [rank * n / size, (rank + 1) * n / size) of n.
Range Share(int64_t n, int rank, int size) { return Range{rank * n / size, (rank + 1) * n / size}; }

}  // namespace

absl::StatusOr<TensorShard> PlanTensorShard(const ModelSpec& spec, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of a tensor split of ", size));
  }
  const int heads = spec.num_heads, kv = spec.num_kv_heads;
  if (heads % size != 0) {
    return absl::FailedPreconditionError(absl::StrCat("a tensor split of ", size, " needs num_attention_heads (", heads,
                                                      ") divisible by it: use a size that divides ", heads,
                                                      " (parallel.size)"));
  }
  if (kv % size != 0 && size % kv != 0) {
    return absl::FailedPreconditionError(absl::StrCat("a tensor split of ", size, " needs num_key_value_heads (", kv,
                                                      ") divisible by it, or dividing it (each KV head then held by ",
                                                      "several ranks): use a size that divides ", kv,
                                                      " or a multiple of it that divides ", heads, " (parallel.size)"));
  }
  TensorShard s;
  s.rank = rank;
  s.size = size;
  s.q_heads = Share(heads, rank, size);
  if (kv % size == 0) {
    s.kv_heads = Share(kv, rank, size);
  } else {  // fewer KV heads than ranks: the one this rank's query heads read
    const int group = heads / kv;
    s.kv_heads = Range{s.q_heads.begin / group, s.q_heads.begin / group + 1};
  }
  s.dense = Share(spec.intermediate_size, rank, size);
  s.shared = Share(spec.shared_expert_intermediate_size, rank, size);
  // The LM head is split by rows when the vocabulary divides evenly (the shards are gathered into
  // one row of logits); otherwise every rank holds it whole.
  s.vocab = spec.vocab_size % size == 0 ? Share(spec.vocab_size, rank, size) : Range{0, spec.vocab_size};
  return s;
}

absl::StatusOr<Range> PlanLayerStage(const ModelSpec& spec, int rank, int stages) {
  if (stages < 1 || rank < 0 || rank >= stages) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", rank, " of a layer split of ", stages));
  }
  if (stages > spec.num_layers) {
    return absl::FailedPreconditionError(absl::StrCat("a layer split of ", stages,
                                                      " stages needs at least as many "
                                                      "layers; the model has ",
                                                      spec.num_layers, " (num_hidden_layers): use at most ",
                                                      spec.num_layers, " stages (parallel.stages)"));
  }
  const int base = spec.num_layers / stages, extra = spec.num_layers % stages;
  const int begin = rank * base + std::min(rank, extra);
  return Range{begin, begin + base + (rank < extra ? 1 : 0)};
}

}  // namespace moe::runtime
