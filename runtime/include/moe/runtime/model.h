// Model: a loaded checkpoint and its forward pass, written once over the Backend interface.
//
// Forward runs one step over a batch of sequence chunks (prefill chunks and single decode
// tokens alike), reading and extending each sequence's paged KV cache, and returns the logits
// of the rows that ask for them. Routed experts go through a RoutedExperts implementation: the
// CPU expert pool (default) or the plain reference path through the backend; the shared experts
// run while the routed ones are computed.
//
// Thread-safety: one Forward at a time per Model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/experts/expert_pool.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/kv_cache.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/weight_source.h"

namespace moe::runtime {

// One step's input. Rows of token_ids are grouped by sequence, in the order of `sequences`.
struct ForwardBatch {
  std::vector<int32_t> token_ids;
  std::vector<SequenceChunk> sequences;
  std::vector<int32_t> logit_rows;  // rows of token_ids whose logits are returned, in this order
};

// Computes the weighted sum of each token's routed experts for one MoE layer, in two phases so
// that the caller can run the shared experts in between.
class RoutedExperts {
 public:
  virtual ~RoutedExperts() = default;
  // hidden: [tokens x hidden_size]; topk_ids/topk_weights: host [tokens x top_k]; out:
  // [tokens x hidden_size], overwritten. All must stay valid until Finish().
  virtual absl::Status Start(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                             const float* topk_weights, float* out) = 0;
  // Waits for the call Start began.
  virtual absl::Status Finish() = 0;
};

// Precision of the RoPE inverse frequencies. transformers keeps them in fp32 when it loads a
// checkpoint (from_pretrained), which is right for serving; a model cast whole with
// `model.to(torch.bfloat16)` rounds them to bf16, as the test fixtures' goldens were made.
// bf16 frequencies drift by whole radians at long context: use them only to reproduce such
// references.
enum class RopeFrequencies { kFloat32, kBFloat16 };

// Where routed experts run: the plain path through the backend (a reference), or the CPU
// expert pool (packed bf16/int8/int4 weights in a host arena, optimised kernels).
enum class RoutedExpertsMode { kReference, kPool };

struct ModelOptions {
  int threads = 0;  // CPU backend threads; 0: all cores
  RopeFrequencies rope_frequencies = RopeFrequencies::kFloat32;
  RoutedExpertsMode experts = RoutedExpertsMode::kPool;
  experts::ExpertPoolOptions pool;  // used with kPool; model_id is filled in by Load
  // The pool's ExpertPoolOptions::linger_us. Unset: 0 on a backend that computes on the host's
  // cores (between MoE layers they are its own), pool.linger_us otherwise.
  std::optional<int64_t> expert_linger_us;
};

// 1 / theta^(2i / rotary_dim) for i < rotary_dim / 2, computed in fp32 as transformers does,
// then rounded to bf16 if asked.
std::vector<float> RopeInverseFrequencies(const ModelSpec& spec, RopeFrequencies precision);

class Model {
 public:
  // Loads config.json and the safetensors weights of `model_dir` onto `backend` (the CPU
  // backend when null). Every expected tensor is checked first; errors name the tensor, the
  // file, what the config expects and what was found. Unused tensors give one warning.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& model_dir,
                                                     const ModelOptions& options = {},
                                                     std::shared_ptr<Backend> backend = nullptr);
  ~Model();

  const ModelSpec& spec() const { return spec_; }
  Backend& backend() { return *backend_; }

  // A KV cache for this model with `num_blocks` blocks of `block_size` positions.
  absl::StatusOr<std::unique_ptr<KvCache>> NewKvCache(int num_blocks, int block_size = 16);

  // Runs one step. `logits` gets [batch.logit_rows.size() x vocab_size] floats.
  // kInvalidArgument for a malformed batch (token id outside the vocabulary, a block table too
  // short for its positions, a logit row out of range); the cache is then left unchanged.
  absl::Status Forward(const ForwardBatch& batch, KvCache& cache, std::vector<float>* logits);

  // The CPU expert pool, or null on the reference path.
  experts::ExpertPool* expert_pool() { return pool_.get(); }

  struct Weights;

 private:
  Model() = default;
  absl::Status CheckBatch(const ForwardBatch& batch, const KvCache& cache) const;
  absl::Status RunMoe(int layer, const float* h, int64_t rows, float* out);

  ModelSpec spec_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<WeightSource> source_;
  std::unique_ptr<Weights> weights_;
  std::vector<float> rope_inv_freq_;
  std::unique_ptr<experts::ExpertPool> pool_;
  std::unique_ptr<RoutedExperts> routed_experts_;  // the reference path or the pool's adapter
};

}  // namespace moe::runtime
