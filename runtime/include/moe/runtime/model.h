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
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/experts/expert_pool.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/cache.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/parallel.h"

namespace moe::runtime {

namespace internal {
class HeldExpertsPolicy;
struct LayerWeights;
}  // namespace internal

// One sequence's slice of a batch: its new tokens are consecutive rows of the batch.
struct SequenceChunk {
  int64_t first_position = 0;  // position of the chunk's first token in its sequence
  int32_t num_tokens = 0;
  // The blocks of the cache's first paged group (cache.h: CachePlan::groups) holding positions
  // [0, first_position+num_tokens). Every model today has that one group.
  std::vector<int32_t> block_table;
  // The sequence's id across steps, from the scheduler to the kernels, for executors that mirror
  // sequences in other processes (0: none given). The model itself does not read it.
  uint64_t seq_id = 0;
  // The block tables of the cache's further paged groups, in CachePlan::groups order (recurrent
  // groups have none); empty while the cache has one paged group, as every model's has today.
  std::vector<std::vector<int32_t>> more_block_tables = {};
  // Speculative decoding: the chunk's last num_draft tokens are drafts, and its logit rows are its
  // last num_draft + 1 rows, in order (executor.h: SequenceResult says what is kept). The model
  // computes them as any other rows.
  int32_t num_draft = 0;
  // For an executor that keeps each sequence's tokens across steps (a worker's mirror, whose
  // tokens are the penalties' history): a sequence it has not seen that starts at
  // first_position > 0 (a prefix-cache hit) comes with its first first_position tokens here.
  // Empty otherwise; the model does not read it.
  std::vector<int32_t> prefix = {};
  // The sequence's slot in the cache's recurrent groups, or -1 (no model has such groups yet).
  int32_t state_slot = -1;
  // Drafts wanted from the executor's own drafter (an MTP head, a draft model beside the target)
  // for the step after this one: up to this many, returned in SequenceResult::drafts. Executors
  // without a drafter return none. The model does not read it.
  int32_t want_drafts = 0;
};
// A chunk may start below positions an earlier step wrote (a rollback after rejected drafts):
// attention reads only positions below each row's own, so the positions from first_position on
// are simply written again.

// One step's input. Rows of token_ids are grouped by sequence, in the order of `sequences`.
struct ForwardBatch {
  std::vector<int32_t> token_ids;
  std::vector<SequenceChunk> sequences;
  std::vector<int32_t> logit_rows;  // rows of token_ids whose logits are returned, in this order
  // Also return the logit rows' hidden states (StepOutputs::hidden), for an MTP head or a drafter
  // that reads the target's. Needs no more logit rows than tokens. Off: nothing is gathered.
  bool want_hidden = false;
  // Return every row's hidden state instead (StepOutputs::hidden [rows x hidden_size]): what an
  // MTP head's KV cache takes to follow the target's sequences. Host backends only (no graphs).
  bool want_all_hidden = false;
  // A model loaded as an MTP head (ModelOptions::nextn_head) reads, for each row, the target's
  // hidden state of the position before (the residual before the final norm, or the head's own
  // for a chained draft): [rows x hidden_size] fp32 in host memory, read during the step. The
  // row's token is the one that followed it. Ignored by other models.
  const float* head_hidden = nullptr;
};

// What a step leaves in the backend's step arena, valid until the next step.
struct StepOutputs {
  Tensor logits;  // [logit_rows x vocab] fp32; no rows on a rank that holds no logits
  // [logit_rows x hidden_size] fp32 when ForwardBatch::want_hidden: the residual stream of each
  // logit row after the last layer, before the final norm (what an MTP layer takes in); every
  // row's with want_all_hidden. Else empty.
  Tensor hidden;
};

// What the routed experts computed on the host beside a GPU (hybrid execution) took: the pool's
// calls, and the time from one layer's call ending to the next layer's starting within a step
// (the GPU's work between them, the copies and the host calls' latency).
struct HostExpertComputeTiming {
  int64_t calls = 0;
  double compute_seconds = 0;
  int64_t betweens = 0;
  double between_seconds = 0;
};

// Computes the weighted sum of each token's routed experts for one MoE layer, in two phases so
// that the caller can run the shared experts in between. Tensors are the backend's.
class RoutedExperts {
 public:
  virtual ~RoutedExperts() = default;
  // hidden: [tokens x hidden_size] activation dtype; ids/weights: [tokens x top_k] int32/fp32;
  // out: [tokens x hidden_size] fp32, overwritten. All stay valid until Finish().
  virtual absl::Status Start(int layer, const Tensor& hidden, const Tensor& ids, const Tensor& weights,
                             const Tensor& out) = 0;
  // Waits for the call Start began.
  virtual absl::Status Finish() = 0;
  // Hybrid execution's host calls since the last reset.
  virtual HostExpertComputeTiming timing() const { return {}; }
  virtual void ResetTiming() {}
};

// Where routed experts run: on the backend (the CPU backend's plain reference path, or the GPU),
// or in the CPU expert pool (packed bf16/int8/int4 weights in a host arena, optimised kernels).
enum class RoutedExpertsMode { kBackend, kPool };

struct ModelOptions {
  int threads = 0;  // CPU backend threads; 0: all cores
  // The CPU backend's Linear weights (when Load makes the backend), by role: bf16 as stored (fp32
  // math, the reference), or packed int8/int4 run by the expert pool's kernels (--weight-format).
  WeightPolicy weights;
  RoutedExpertsMode experts = RoutedExpertsMode::kPool;
  experts::ExpertPoolOptions pool;  // used with kPool; model_id is filled in by Load
  // The pool's format follows the checkpoint (--expert-format auto): a GGUF file's block types kept
  // as stored (native), bf16 for a Hugging Face checkpoint; `pool.format` is then ignored.
  bool pool_format_auto = false;
  // With kPool: the model layers whose routed experts the pool holds (unset: every MoE layer); the
  // others' run on the backend. On a GPU backend the pool's layers run on the host beside it
  // (hybrid execution: --cpu-moe, --n-cpu-moe, --override-tensor).
  std::optional<std::vector<int>> pool_layers;
  // Of the pool's layers, experts the backend holds too (--gpu-experts-per-layer): each token's
  // picks of them run on the backend while the pool computes the rest.
  std::map<int, std::vector<int>> backend_experts;
  // Of every pool layer, this many experts the backend holds too, chosen while serving
  // (--gpu-experts-per-layer without a profile): each step counts the router's picks on the
  // backend; every `held_experts_refresh_steps` steps the counts (older ones weighed down by 3/4
  // at each refresh, so older traffic fades) rank the experts, and the held ones that fell clearly
  // out of the top (routing_profile.h: PlanHeldExpertSwaps) are replaced by the newcomers, one
  // expert's weights a step, so serving never pauses. Until the first refresh the
  // backend holds experts 0..n-1. Not with backend_experts.
  int held_experts_per_layer = 0;
  int held_experts_refresh_steps = 256;
  // Hybrid prefill: a step of at least this many tokens streams each pool layer's packed experts to
  // the GPU over PCIe and computes them there (--prefill-offload-tokens). -1: measured at load
  // (one layer both ways); 0: never.
  int prefill_offload_tokens = -1;
  // Expert deferral (--defer-experts, off by default, not lossless): in a pool layer followed by
  // another, each token's N lowest-weighted routed experts finish in the pool while the next
  // layer's attention runs, and their sum joins that layer's MoE output instead of this one's
  // (KTransformers' expert deferral). In [0, top_k); needs pool layers.
  int defer_experts = 0;
  // The pool's ExpertPoolOptions::linger_us. Unset: 0 on a backend that computes on the host's
  // cores (the cores are the backend's between MoE layers, or with share_host_threads the threads
  // stay awake through a step anyway and rest after it), pool.linger_us otherwise.
  std::optional<int64_t> expert_linger_us;
  // On a backend that computes on the host's cores, with routed experts in the pool: the backend's
  // operations run on the pool's pinned threads (Backend::UseHostThreads), which stay awake from
  // one operation to the next within a step and rest after it (for expert_linger_us). Off: the
  // backend keeps its own threads (--shared-threads).
  bool share_host_threads = true;
  // The largest step: tokens in one Forward, and rows that want logits. They size the step
  // arena, reserved once at load.
  int max_step_tokens = 2048;
  int max_logit_rows = 256;
  // Longest sequence the KV cache will serve (0: the model's max_position_embeddings).
  int max_context = 0;
  // The KV cache's element type (--kv-cache-dtype): unset, the backend's activation dtype (bf16 on a
  // GPU, fp32 on the CPU); fp8 e4m3 with per-position, per-head scales on a GPU.
  std::optional<core::DType> kv_cache_dtype;
  // Decode steps replayed as CUDA graphs on backends that have them (off: eager, for debugging).
  bool graphs = true;
  // How MLA layers attend (backend.h): absorbed for decode, expanded for prefill by default; one
  // form throughout for tests that compare them.
  MlaForm mla_form = MlaForm::kAuto;
  // Loading progress (bytes, GB/s) on stderr.
  bool progress = false;
  // Load the checkpoint's first MTP (nextn) layer as a model of its own: a step embeds each row's
  // token (the layer's embed_tokens, or the model's), normalises it (enorm) and the hidden state
  // it is given (ForwardBatch::head_hidden, hnorm), projects the two concatenated (eh_proj), runs
  // the decoder layer with its own KV cache, then shared_head.norm and the head (shared_head.head,
  // or the model's LM head). On a host backend (the CPU's), its routed experts on the backend.
  // kFailedPrecondition for a checkpoint without the layer.
  bool nextn_head = false;
  // Several ranks (parallel.h): this model is rank `parallel.rank`'s share. A tensor split holds a
  // share of every layer (heads, FFN columns, its routed experts, LM-head rows) and sums the
  // shares with one all-reduce after attention and one after the FFN or MoE block; a layer split
  // holds a range of layers, receives the hidden states from the stage before and sends them to
  // the next. Every rank runs every step's Forward with the same batch.
  ParallelConfig parallel;
};

// 1 / theta^(2i / rotary_dim) for i < rotary_dim / 2, computed in fp32 as transformers does when
// it loads a checkpoint.
std::vector<float> RopeInverseFrequencies(const ModelSpec& spec);

class Model {
 public:
  // Opens the checkpoint at `path` (OpenCheckpoint: a Hugging Face folder or a file) and loads its
  // weights onto `backend` (the CPU backend when null). Every expected tensor is checked first;
  // errors name the tensor, the file, what the config expects and what was found. Unused tensors
  // give one warning.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& path, const ModelOptions& options = {},
                                                     std::shared_ptr<Backend> backend = nullptr);
  ~Model();

  const ModelSpec& spec() const { return spec_; }
  // What the model was loaded from; its tensors stay mapped while the model lives.
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  const ModelOptions& options() const { return options_; }
  // Decode steps from CUDA graphs (ModelOptions::graphs) from the next step on: a benchmark
  // times both ways on one loaded model.
  void set_graphs(bool on) { options_.graphs = on; }
  Backend& backend() { return *backend_; }
  // Bytes of weights on the backend (routed experts included when the backend runs them).
  int64_t weight_bytes() const;

  // Bytes of the step arena ReserveStep reserves for steps of up to `max_tokens` tokens and
  // `max_logit_rows` logit rows with activations in `activation` (what a memory plan counts
  // before loading); `inputs` of them hold the step's uploaded inputs.
  struct StepArena {
    int64_t total = 0;
    int64_t inputs = 0;
  };
  // `vocab_parts` > 1: the LM head split by rows in a tensor split of that many ranks.
  static StepArena StepArenaBytes(const ModelSpec& spec, core::DType activation, int64_t max_tokens,
                                  int64_t max_logit_rows, int max_context, int vocab_parts = 1);

  const ParallelConfig& parallel() const { return options_.parallel; }
  // Whether Forward produces logits on this rank: every rank but the layer split's non-final
  // stages (a tensor split gathers the LM head's shards on every rank).
  bool holds_logits() const;
  // The dtype of this model's KV caches.
  core::DType kv_dtype() const { return options_.kv_cache_dtype.value_or(backend_->activation_dtype()); }
  // This rank's cache (its layers and KV heads, in kv_dtype()) in blocks of `block_size`
  // positions: PlanCache's groups for this model.
  CachePlan CachePlanFor(int block_size) const;
  // Bytes one block of `block_size` positions takes in this rank's caches.
  int64_t KvBlockBytes(int block_size) const { return CachePlanFor(block_size).BlockBytes(); }
  // A KV cache for this model with `num_blocks` blocks of `block_size` positions.
  absl::StatusOr<std::unique_ptr<KvCache>> NewKvCache(int num_blocks, int block_size = 16);

  // Runs one step. `logits` gets [batch.logit_rows.size() x vocab_size] floats.
  // kInvalidArgument for a malformed batch (token id outside the vocabulary, a block table too
  // short for its positions, a logit row out of range, more tokens or logit rows than the model
  // was loaded for); the cache is then left unchanged. kInternal for a failure of the backend
  // (a CUDA error), naming the operation.
  absl::Status Forward(const ForwardBatch& batch, KvCache& cache, std::vector<float>* logits);
  // The same step, leaving the logits [logit_rows x vocab] fp32 (and the hidden states when
  // asked) in the backend's step arena (valid until the next step) for sampling there. Nothing is
  // synchronized.
  absl::StatusOr<StepOutputs> ForwardOnDevice(const ForwardBatch& batch, KvCache& cache);

  // The CPU expert pool, or null when the backend runs the routed experts.
  experts::ExpertPool* expert_pool() { return pool_.get(); }
  // The model layers whose routed experts the pool holds (empty without a pool).
  const std::vector<int>& pool_layers() const { return pool_layers_; }
  // Hybrid prefill: the tokens from which a step streams the pool's experts to the GPU (0: never),
  // and what the load measured to choose it ("" when set by hand or off).
  int prefill_offload_tokens() const { return prefill_offload_tokens_; }
  const std::string& prefill_offload_note() const { return prefill_offload_note_; }
  // The experts the backend holds of pool layer `layer` now (backend_experts or chosen while
  // serving), in slot order; empty for other layers.
  std::vector<int> held_experts(int layer) const;
  // Held experts chosen while serving: refreshes so far, swaps applied, and the share of the picks
  // counted since load that went to the experts held when they were counted.
  struct HeldExpertsStats {
    int64_t refreshes = 0;
    int64_t swaps = 0;
    int64_t picks = 0;
    int64_t held_picks = 0;
  };
  HeldExpertsStats held_experts_stats() const;
  // Hybrid execution: the host calls of the routed experts since the last reset (benchmarks).
  HostExpertComputeTiming host_experts_timing() const { return routed_experts_->timing(); }
  void ResetHostExpertsTiming() { routed_experts_->ResetTiming(); }

  // Debugging: `tap` sees each intermediate tensor of a step as it is written (what, the layer or
  // -1, the backend's tensor), so that two backends can be compared op by op. A tapped step runs
  // eagerly; the tap may synchronize. Not for serving. An empty function turns it off.
  using StepTap = std::function<void(std::string_view what, int layer, const Tensor& t)>;
  void SetStepTap(StepTap tap) { tap_ = std::move(tap); }

  struct Weights;
  struct StepBuffers;

 private:
  Model() = default;
  // The share of the model this rank holds (ModelOptions::parallel): local_, shard_, layers_.
  absl::Status PlanShare();
  // The LM head's shards gathered into each row of logits (a tensor split of a vocabulary that
  // divides evenly), or 1.
  int VocabParts() const;
  absl::Status CheckBatch(const ForwardBatch& batch, const KvCache& cache) const;
  absl::Status ReserveStep();
  StepInputs BuildInputs(const ForwardBatch& batch, const KvCache& cache, int pad_to, int kv_bucket) const;
  absl::StatusOr<StepBuffers> TakeBuffers(int64_t rows, int64_t logit_rows);
  absl::Status RunLayers(const StepTensors& step, const StepBuffers& b, KvCache& cache);
  // One layer's attention into b.attn: grouped-query, or multi-head latent (whose output, a view of
  // b.attn's first values, it returns).
  void RunGqa(const StepTensors& step, const StepBuffers& b, const internal::LayerWeights& lw, const Tensor& inv_freq,
              KvCache& cache, int layer);
  Tensor RunMla(const StepTensors& step, const StepBuffers& b, const internal::LayerWeights& lw, const Tensor& inv_freq,
                KvCache& cache, int layer);

  ModelSpec spec_;
  // This rank's share of the model (a split's local head counts and FFN widths), the full spec
  // when there is no split; and its layers [first, end).
  ModelSpec local_;
  TensorShard shard_;
  Range layers_;
  ModelOptions options_;
  std::shared_ptr<Backend> backend_;
  // This model's step arena and graphs on the backend (declared after it: destroyed before it).
  std::unique_ptr<StepContext> context_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<Weights> weights_;
  std::unique_ptr<DeviceBuffer> rope_inv_freq_;  // [1 x rotary_dim / 2] fp32
  std::unique_ptr<HostBuffer> host_logits_;      // [max_logit_rows x vocab] fp32
  StepInputs inputs_;                            // the step in flight's inputs
  std::unique_ptr<experts::ExpertPool> pool_;
  std::vector<int> pool_layers_;
  int prefill_offload_tokens_ = 0;
  std::string prefill_offload_note_;
  absl::Status SetUpStreamedExperts();
  // Held experts chosen while serving (ModelOptions::held_experts_per_layer), run before each step.
  std::unique_ptr<internal::HeldExpertsPolicy> held_;
  std::unique_ptr<RoutedExperts> routed_experts_;  // per layer, the backend's or the pool's
  StepTap tap_;
  // The step in flight's ForwardBatch::head_hidden and want_all_hidden (holds_logits too).
  const float* head_hidden_ = nullptr;
  bool all_hidden_ = false;
  // The KV cache the backend's decode graphs were recorded on (they hold its addresses): a step
  // on another cache records them anew.
  struct GraphCache {
    const void* k = nullptr;
    const void* v = nullptr;
    int num_blocks = 0;
    int block_size = 0;
    bool operator==(const GraphCache&) const = default;
  };
  GraphCache graph_cache_;
};

}  // namespace moe::runtime
