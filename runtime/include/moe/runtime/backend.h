// The Backend interface: the operations the model forward is written over. The forward in
// model.cc calls only these, so it knows nothing of where they run. The CPU backend
// (backend_cpu.h) is the reference (fp32 activations, fp32 KV cache); the CUDA backend
// (backend_cuda.h) computes in bf16 with fp32 accumulation and a bf16 KV cache.
//
// The life of a step:
// - at load, the model asks the backend for its weights (PrepareWeight), its KV cache
//   (CreateKvCache) and one step arena (ReserveArena) sized for the largest step it will run;
// - each step starts with BeginStep: the arena is reset and the step's inputs (token ids,
//   positions, block tables, logit rows) are uploaded in one copy; every activation of the step
//   is then carved from the arena (Take), so no operation allocates;
// - operations are queued in order on the backend's one stream and may run asynchronously; they
//   return nothing: an error (a CUDA fault, a lost context) is kept and surfaces at the next
//   Synchronize(), which waits for everything queued. After a lost context the error is sticky:
//   every later Synchronize returns it.
// - results reach the host through CopyToHost into host memory from AllocateHost (pinned on a
//   GPU), valid after Synchronize.
//
// Tensors are views of backend memory ("device" memory: host memory for the CPU backend). The
// residual stream is fp32; activations that feed a Linear are activation_dtype().
//
// Thread-safety: a Backend is used by one thread at a time (the one running the model's step).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/core/dtype.h"
#include "moe/core/tensor.h"
#include "moe/experts/host_threads.h"
#include "moe/experts/packed.h"
#include "moe/runtime/cache.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/sampler.h"
#include "moe/runtime/weight_policy.h"

namespace moe::comm {
class Communicator;
}

namespace moe::runtime {

// A typed [rows x cols] view of backend memory, row-major and dense. Does not own.
struct Tensor {
  void* data = nullptr;
  core::DType dtype = core::DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;

  int64_t numel() const { return rows * cols; }
  int64_t bytes() const { return numel() * core::DTypeSize(dtype); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  // Rows [first, first + n) of this tensor.
  Tensor Rows(int64_t first, int64_t n) const {
    return Tensor{static_cast<char*>(data) + first * cols * core::DTypeSize(dtype), dtype, n, cols};
  }
  // The same bytes seen as [rows x cols] (the element count must match).
  Tensor Reshaped(int64_t new_rows, int64_t new_cols) const { return Tensor{data, dtype, new_rows, new_cols}; }
  explicit operator bool() const { return data != nullptr; }
};

// Backend memory; released when destroyed.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual Tensor tensor() const = 0;
};

// Host memory the backend can copy to and from asynchronously (pinned on a GPU).
class HostBuffer {
 public:
  virtual ~HostBuffer() = default;
  virtual void* data() const = 0;
  virtual int64_t bytes() const = 0;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data());
  }
};

// A point in the backend's stream: Record marks it, Wait blocks the host until the work before
// it is done. For overlapping host work (the CPU expert pool) with the stream.
class Event {
 public:
  virtual ~Event() = default;
  virtual void Record() = 0;
  virtual absl::Status Wait() = 0;
};

// A weight in the form the backend computes with (for the CPU backend, a view of the mapped
// checkpoint when its dtype is bf16 or f32; the checkpoint must outlive it).
class DeviceWeight {
 public:
  virtual ~DeviceWeight() = default;
  const core::Shape& shape() const { return shape_; }
  int64_t rows() const { return shape_[0]; }
  int64_t cols() const { return shape_.size() > 1 ? shape_[1] : 1; }
  virtual int64_t bytes() const = 0;

 protected:
  core::Shape shape_;
};

// One MoE layer's routed experts in the backend's memory, each expert's gate and up rows fused.
class BackendExpertWeights {
 public:
  virtual ~BackendExpertWeights() = default;
  virtual int64_t bytes() const = 0;
};

// One step's inputs as the host builds them (model.cc), uploaded once by BeginStep.
struct StepInputs {
  std::vector<int32_t> token_ids;    // [T]
  std::vector<int32_t> positions;    // [T]
  std::vector<int32_t> row_seq;      // [T] sequence index of each row
  std::vector<int32_t> seq_start;    // [S+1]
  std::vector<int32_t> seq_len;      // [S] KV length after the step
  std::vector<int32_t> block_table;  // [S x max_blocks], padded with the scratch block
  std::vector<int32_t> logit_rows;   // [L]
  int max_blocks = 0;
  int max_q_len = 0;
  int max_kv_len = 0;
  int num_tokens() const { return static_cast<int>(token_ids.size()); }
  int num_seqs() const { return static_cast<int>(seq_len.size()); }
};

// The uploaded inputs: int32 tensors in the step arena, with the host-known sizes.
struct StepTensors {
  Tensor token_ids, positions, row_seq, seq_start, seq_len, block_table, logit_rows;
  int num_tokens = 0;
  int num_seqs = 0;
  int max_blocks = 0;
  int max_q_len = 0;
  int max_kv_len = 0;
  // The host copy, for backends that compute on the host (the CPU backend reads it directly).
  const StepInputs* host = nullptr;
};

// One row of logits to sample on the backend, by the algorithm of sampler.h.
struct SampleInput {
  const SamplingParams* params = nullptr;
  SampleKey key;
  const std::vector<int32_t>* history = nullptr;  // prompt then output, when params->penalized()
  int prompt_len = 0;
  int logprobs = 0;  // top alternatives wanted (0: none)
};
struct SampleOutput {
  int32_t token = 0;
  int32_t non_finite_at = -1;  // the first NaN or infinity in the row's logits, or -1
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

// Attention of one layer: the fused QKV projection's output in, attention's output out.
struct AttentionArgs {
  Tensor qkv;  // [T x (H + 2 KV) * head_dim] activation dtype, bias added: q heads, k heads, v heads
  Tensor q;    // [T x H * head_dim] scratch for the rotated queries
  Tensor out;  // [T x H * head_dim] activation dtype
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;
  float scale = 1.0f;
  float eps = 1e-6f;
  const DeviceWeight* q_norm = nullptr;  // per-head RMSNorm weights [head_dim], or null
  const DeviceWeight* k_norm = nullptr;
  const Tensor* inv_freq = nullptr;  // [1 x rotary_dim / 2] fp32 RoPE inverse frequencies
  KvCache* cache = nullptr;
  int layer = 0;
};

// How MLA attends: expanded (each head's K and V made from the cached latents by kv_b_proj, then
// attention as written), or absorbed (kv_b_proj's K half folded into the query and its V half
// applied to the output: attention over the latent rows themselves, as one head). kAuto absorbs
// for one-token chunks (decode) and expands longer ones (prefill).
enum class MlaForm { kAuto, kExpanded, kAbsorbed };

// Multi-head latent attention of one layer (MlaSpec in model_spec.h): the q projection's and the
// compressed KV projection's outputs in, the heads' values out (o_proj's input).
struct MlaAttentionArgs {
  Tensor q;           // [T x H * (nope + rope)] activation dtype; each head's rope half is rotated in place
  Tensor kv;          // [T x (kv_lora + rope)] kv_a_proj_with_mqa's output; normed and rotated in place
  Tensor out;         // [T x H * v_head_dim] activation dtype
  int num_heads = 0;  // this rank's heads (a tensor split's share); the latent is every rank's
  MlaSpec mla;
  float scale = 1.0f;                  // the softmax scale (ModelSpec::attention_scale)
  float rope_attention_factor = 1.0f;  // YaRN's multiplier of cos and sin
  float eps = 1e-6f;
  const DeviceWeight* kv_norm = nullptr;  // kv_a_layernorm [kv_lora], kVector
  const DeviceWeight* kv_b = nullptr;     // kv_b_proj [H * (nope + v) x kv_lora] of these heads, kVector
  const Tensor* inv_freq = nullptr;       // [1 x rope / 2] fp32
  KvCache* cache = nullptr;               // a kPagedLatent cache: one row of kv_lora + rope a position
  int layer = 0;
  MlaForm form = MlaForm::kAuto;
};

// Routed experts computed on the host beside a device's stream (hybrid execution): the CPU expert
// pool behind an interface the backend calls from a host thread, in stream order.
class HostExpertCompute {
 public:
  virtual ~HostExpertCompute() = default;
  // hidden [rows x H] fp32, ids and weights [rows x top_k]; out [rows x H] fp32, overwritten.
  // Host memory, valid for the call only. An error fails the step (at Synchronize).
  virtual absl::Status Compute(int layer, const float* hidden, int64_t rows, const int32_t* ids, const float* weights,
                               float* out) = 0;
};

class Backend;

// One model's step state on a backend: its step arena and input staging (ReserveArena, BeginStep,
// Take carve the current context's), and the key space of the graphs recorded from its steps. A
// backend serves several models (a target and its draft model or MTP head on one GPU) by switching
// contexts between their steps (Backend::UseContext), so that one model's step never overwrites
// another's arena or replays another's graphs. The backend's scratch for its own kernels is shared:
// it is sized for the largest of them (ReserveScratch only grows it). Made by
// Backend::CreateContext; it must not outlive the backend, and leaves it when destroyed.
class StepContext {
 public:
  ~StepContext();
  StepContext(const StepContext&) = delete;
  StepContext& operator=(const StepContext&) = delete;
  uint64_t id() const { return id_; }
  int64_t arena_bytes() const { return arena_bytes_; }

 private:
  friend class Backend;
  StepContext(Backend* backend, uint64_t id) : backend_(backend), id_(id) {}
  Backend* backend_;
  uint64_t id_;
  std::unique_ptr<DeviceBuffer> arena_;
  std::unique_ptr<HostBuffer> staging_;
  int64_t arena_bytes_ = 0;
  int64_t arena_used_ = 0;
};

class Backend {
 public:
  Backend();
  virtual ~Backend();
  virtual std::string name() const = 0;
  // True when the backend computes on the host's CPU cores (the CPU backend): then the expert
  // pool's threads must not stay awake between MoE layers, they would take the cores from it.
  virtual bool ComputesOnHostCores() const { return false; }
  // True when Tensor::data is a host address the CPU may read (the CPU backend).
  virtual bool HostAddressable() const { return false; }
  // Lends a backend that computes on the host's cores a set of threads for its operations (the
  // expert pool's pinned crew: one set of threads for the whole step), in place of its own; null
  // gives them back. Others ignore it. `threads` must stay valid until given back, and is driven
  // from the thread that runs this backend's steps; Synchronize lets them rest.
  virtual void UseHostThreads(experts::HostThreads* threads) {}
  virtual experts::HostThreads* host_threads() const { return nullptr; }
  // The dtype of activations that feed a Linear and of the KV cache.
  virtual core::DType activation_dtype() const = 0;

  // ---- Weights: what it takes and what they cost ----
  // The form each weight takes here (weight_policy.h); WeightBytes is the memory plan's answer for
  // this backend, and SupportsWeight says which stored formats PrepareWeight reads (the loader
  // converts the others on the host first).
  virtual const WeightPolicy& weight_policy() const = 0;
  WeightHome weight_home() const { return HostAddressable() ? WeightHome::kHost : WeightHome::kGpu; }
  bool SupportsWeight(const WeightFormat& stored, WeightUse use) const {
    return SupportsStoredWeight(weight_home(), stored, use);
  }
  int64_t WeightBytes(const core::Shape& shape, const WeightFormat& stored, WeightUse use, TensorRole role) const {
    return DeviceWeightBytes(weight_home(), weight_policy(), shape, stored, use, role);
  }

  // ---- Memory, at load ----
  // `role` picks the form a matrix takes under the backend's policy. kInvalidArgument for a dtype
  // the backend cannot compute with; kResourceExhausted when out of memory (the message gives the
  // bytes needed and free).
  virtual absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareWeight(const core::TensorView& host, WeightUse use,
                                                                      TensorRole role = TensorRole::kOther) = 0;
  // One weight made of `parts` stacked by rows (2-D parts with the same number of columns, or
  // 1-D parts concatenated): the fused QKV and gate+up projections and their biases.
  virtual absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareFusedWeight(const std::vector<core::TensorView>& parts,
                                                                           WeightUse use,
                                                                           TensorRole role = TensorRole::kOther) = 0;
  // Weights as stored, for a format SupportsWeight takes that is not plain (a GGUF block type on the
  // CPU backend: kept in its type and run by the expert pool's kernels). `parts` stacked by rows,
  // all of one format. kUnimplemented where the backend takes no such format.
  virtual absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareStoredWeight(const std::vector<WeightView>& parts,
                                                                            WeightUse use, TensorRole role) {
    return absl::UnimplementedError(name() + " reads no weights stored as " +
                                    (parts.empty() ? std::string("?") : parts[0].format.Name()));
  }
  // One MoE layer's routed experts (gate, up, down of each), for MoeExperts. Backends that do not
  // run routed experts themselves return kUnimplemented.
  virtual absl::StatusOr<std::unique_ptr<BackendExpertWeights>> PrepareExperts(
      const std::vector<core::TensorView>& gate, const std::vector<core::TensorView>& up,
      const std::vector<core::TensorView>& down) {
    return absl::UnimplementedError(name() + " keeps no routed experts");
  }
  virtual absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(core::DType dtype, int64_t rows, int64_t cols) = 0;
  virtual absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(int64_t bytes) = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  // Whether the backend's attention reads a KV cache of `dtype`: its activation dtype, and on a GPU
  // fp8 e4m3 too (--kv-cache-dtype fp8).
  virtual bool SupportsKvDtype(core::DType dtype) const { return dtype == activation_dtype(); }
  // The cache `plan` describes (PlanCache: its one paged group: a kPagedKv group's K and V, fp8's
  // scales too; a kPagedLatent group's rows alone), with `num_blocks` blocks and a scratch block.
  // kInvalidArgument for a non-positive size, a dtype SupportsKvDtype refuses or an fp8 latent;
  // kUnimplemented for a plan of a recurrent group or of several groups; kResourceExhausted when it
  // does not fit.
  absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(const CachePlan& plan, int num_blocks);
  // ---- Step contexts: one per model on this backend ----
  // A new context (its arena unreserved). The backend starts in a default context of its own.
  std::unique_ptr<StepContext> CreateContext();
  // Makes `context` (this backend's) the one ReserveArena, BeginStep, Take and RunGraph use, until
  // another is chosen; null goes back to the default context. Between steps only.
  void UseContext(StepContext* context);
  StepContext& context() const { return *current_; }
  // The step arena of the current context: `bytes` of backend memory, carved by Take during a step,
  // and a host staging buffer of `input_bytes` for BeginStep's upload.
  absl::Status ReserveArena(int64_t bytes, int64_t input_bytes);
  int64_t arena_bytes() const { return current_->arena_bytes_; }
  // Scratch the backend's own kernels need for the largest step (attention splits, expert
  // grouping, sampling), reserved at load. Shared by every context: a second model's call only
  // grows what a first one reserved (forgetting recorded graphs when it must reallocate).
  struct StepLimits {
    int max_tokens = 0;
    int max_logit_rows = 0;
    int max_context = 0;
    int num_heads = 0;
    int head_dim = 0;
    int vocab = 0;
    int hidden = 0;
    int num_experts = 0;
    int top_k = 0;
    int moe_intermediate = 0;
    int max_bias_width = 0;     // the widest Linear with a bias (the fused QKV), 0 when none has one
    bool host_experts = false;  // some layers' routed experts run on the host (StartHostExperts)
  };
  virtual absl::Status ReserveScratch(const StepLimits& limits) { return absl::OkStatus(); }
  // Bytes of device memory free now (the host's available memory for the CPU backend).
  virtual int64_t FreeMemoryBytes() const = 0;

  // The two ceilings a step is measured against, measured now: memory bandwidth (the GPU's
  // device-to-device copy of `bytes`, counting bytes read and written; the host's read bandwidth
  // for the CPU) and the matrix rate (a bf16 8192^3 GEMM on the GPU; the fp32 Linear on the CPU).
  struct Roofline {
    double memory_gbps = 0;
    std::string memory_what;
    double matmul_tflops = 0;
    std::string matmul_what;
  };
  virtual absl::StatusOr<Roofline> MeasureRoofline(int64_t bytes) = 0;

  // Device time per operation over the steps queued between BeginOpTiming and EndOpTiming, for a
  // benchmark's step budget. While timing, RunGraph runs its body eagerly (a replayed graph is
  // one launch, with nothing to time inside), and a backend may hold each step until it is queued
  // whole, so that its operations run back to back and their times exclude the host's launch
  // latency. `span_seconds` adds each step's time from its first operation's start to its last
  // one's end: its excess over the sum is the device idle between operations.
  // kUnimplemented where the backend has no device clock. A backend may time only the first
  // kMaxTimedOperations operations (the CUDA backend does); time fewer steps than that holds.
  static constexpr int kMaxTimedOperations = 4096;
  struct OpTime {
    std::string op;  // the operation (a Linear by its weight's shape)
    double seconds = 0;
    int calls = 0;
  };
  struct OpTiming {
    std::vector<OpTime> ops;  // most time first
    double busy_seconds = 0;  // their sum
    double span_seconds = 0;
    // What one operation's time includes for the timing itself (a pair of timing events around
    // nothing, queued back to back), measured in the same run.
    double overhead_seconds_per_op = 0;
  };
  virtual absl::Status BeginOpTiming() { return absl::UnimplementedError(name() + " does not time its operations"); }
  virtual absl::StatusOr<OpTiming> EndOpTiming() {
    return absl::UnimplementedError(name() + " does not time its operations");
  }

  // ---- A step ----
  // Resets the arena and uploads the step's inputs (one copy). `inputs` must stay valid until the
  // step's Synchronize.
  absl::StatusOr<StepTensors> BeginStep(const StepInputs& inputs);
  // A [rows x cols] tensor from the arena; kResourceExhausted when the arena is too small (a
  // step larger than the one it was sized for).
  absl::StatusOr<Tensor> Take(core::DType dtype, int64_t rows, int64_t cols);
  // Copies `src` into host memory (asynchronous: valid after Synchronize; `host_dst` must hold
  // src.bytes() and, on a GPU, be an AllocateHost buffer for the copy to overlap).
  virtual void CopyToHost(const Tensor& src, void* host_dst) = 0;
  virtual void CopyFromHost(const void* host_src, const Tensor& dst) = 0;
  // Waits for everything queued; the first error since the last Synchronize (sticky once the
  // device is lost), naming the operation.
  virtual absl::Status Synchronize() = 0;
  // Runs `body`, which queues operations on this backend. A backend with graphs records it the
  // first time under `key` (in the current context's key space) and replays the recording later
  // (the same key must queue the same operations on the same buffers: only their contents change).
  // Others just run it.
  virtual absl::Status RunGraph(uint64_t key, absl::FunctionRef<absl::Status()> body) { return body(); }
  virtual bool SupportsGraphs() const { return false; }
  // Forgets every recorded graph (their buffers, the KV cache's among them, are about to change).
  virtual void ClearGraphs() {}
  // Forgets the graphs recorded in one step context (a model whose KV cache changed, or that is
  // going away); the other models' stay.
  virtual void ClearContextGraphs(uint64_t context_id) {}

  // Samples every row of `logits` [rows x vocab] fp32 (modified: the penalties are applied in
  // place) on the backend, waiting for the result. kUnimplemented where the backend does not
  // sample (the caller copies the logits to the host and samples there); kResourceExhausted for a
  // step whose rows carry more penalty history than the backend reserved (likewise).
  virtual absl::Status SampleRows(const Tensor& logits, const std::vector<SampleInput>& rows,
                                  std::vector<SampleOutput>* out) {
    return absl::UnimplementedError(name() + " samples on the host");
  }

  // ---- Operations ----
  // x[t] = table[token_ids[t]] as fp32; x [T x hidden].
  virtual void Embed(const DeviceWeight& table, const StepTensors& step, const Tensor& x) = 0;
  // Per row: x += delta (when given; fp32 in place); out = x * rsqrt(mean(x^2) + eps) * w, in
  // out's dtype. Norm weights are kVector.
  virtual void AddRmsNorm(const Tensor& x, const Tensor* delta, const DeviceWeight& w, float eps,
                          const Tensor& out) = 0;
  // out [rows x N] = x [rows x K] . w^T (+ bias), w [N x K]; fp32 accumulation; out fp32 or the
  // activation dtype.
  virtual void Linear(const Tensor& x, const DeviceWeight& w, const DeviceWeight* bias, const Tensor& out) = 0;
  // q/k norm, RoPE, the new K and V into the cache, then causal paged attention (GQA).
  virtual void Attention(const AttentionArgs& args, const StepTensors& step) = 0;
  // Whether the backend runs attention of `kind` (AttentionMla for kMla). The model refuses at
  // load a model with layers of a kind its backend does not run.
  virtual bool SupportsAttention(AttentionKind kind) const { return kind == AttentionKind::kGqa; }
  // The latent's norm, RoPE of the rope halves, the new latent rows into the cache, then causal
  // attention over the paged latents in args.form. Only where SupportsAttention(kMla).
  virtual void AttentionMla(const MlaAttentionArgs& args, const StepTensors& step) {}
  // out[r][i] = silu(gate_up[r][i]) * gate_up[r][W + i], W = out.cols.
  virtual void SiluMul(const Tensor& gate_up, const Tensor& out) = 0;
  // Router logits [T x E] fp32 to ids [T x top_k] int32 and weights [T x top_k] fp32, as
  // routing.h defines it; correction_bias is a kVector weight or null.
  virtual void Route(const Tensor& logits, const RoutingSpec& spec, const DeviceWeight* correction_bias,
                     const Tensor& ids, const Tensor& weights) = 0;
  // out [T x H] fp32 = sum_j weights[t][j] * expert_{ids[t][j]}(x[t]); x activation dtype.
  virtual void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                          const BackendExpertWeights& experts, const Tensor& out) {}
  // Routed experts on the host for a backend whose memory the CPU cannot address (hybrid
  // execution): x (activation dtype), ids and weights go to pinned host memory, `host` computes
  // `layer` there, and its sum lands in out [T x H] fp32. Queued beside the stream, so that the
  // operations queued before FinishHostExperts (the shared experts) overlap it; FinishHostExperts
  // makes the stream wait for it. One call in flight; recorded into graphs like any operation, so
  // `host` must outlive the backend's graphs. kUnimplemented where the backend computes on the host
  // (the pool reads its tensors directly) or reserved no host buffers (StepLimits::host_experts).
  // `pool_layer` is the layer's index among the host's (for SetStreamedExperts).
  virtual absl::Status StartHostExperts(HostExpertCompute& host, int layer, int pool_layer, const Tensor& x,
                                        const Tensor& ids, const Tensor& weights, const Tensor& out) {
    return absl::UnimplementedError(name() + " runs no routed experts on the host");
  }
  virtual absl::Status FinishHostExperts() {
    return absl::UnimplementedError(name() + " runs no routed experts on the host");
  }
  // How the stream hands a layer to the host and waits for its answer: host-function nodes (the
  // driver's callback thread runs the experts), or mapped flags (a kernel posts a request that a
  // pinned host thread polls for, another kernel polls for its answer). Changing it forgets the
  // recorded graphs.
  enum class HostHandoff { kHostFunction, kMappedFlags };
  // Hybrid prefill: the host's packed experts (the expert pool's arena, experts/packed.h), which
  // a StartHostExperts call of at least `min_tokens` rows streams to the backend over PCIe (a
  // layer at a time, the next one's copy overlapping this one's compute) and computes there
  // instead of on the host. The memory must stay mapped while the backend lives; it is pinned
  // (page-locked) here. min_tokens 0: never.
  struct StreamedExpertArena {
    const uint8_t* data = nullptr;
    int64_t bytes = 0;
    int num_layers = 0;
    int num_experts = 0;
    int64_t expert_bytes = 0;
    experts::MatrixLayout gate_up, down;
    int intermediate = 0;
    int min_tokens = 0;
  };
  virtual absl::Status SetStreamedExperts(const StreamedExpertArena& experts) {
    return absl::UnimplementedError(name() + " does not stream experts from the host");
  }
  // Changes SetStreamedExperts' threshold (0: never stream).
  virtual void SetStreamTokens(int min_tokens) {}
  // Before the host memory and the HostExpertCompute given to this backend go away (the model's pool):
  // waits for every host call, stops the host thread and unpins the streamed experts. Graphs
  // recorded with host calls must be cleared first (ClearGraphs).
  virtual void ReleaseHostExperts() {}
  // Host experts calls that streamed their layer, since the backend was made (benchmarks).
  virtual int64_t streamed_calls() const { return 0; }
  virtual absl::Status SetHostHandoff(HostHandoff handoff) {
    return absl::UnimplementedError(name() + " runs no routed experts on the host");
  }
  virtual HostHandoff host_handoff() const { return HostHandoff::kHostFunction; }
  // Each row's picks split between the host and the backend's own copies of some experts, as
  // SplitPicks (routing.h) does: ids/weights [T x k], backend_index [1 x E] int32 (-1: not on the
  // backend); the outputs [T x k] each.
  virtual void SplitRouting(const Tensor& ids, const Tensor& weights, const Tensor& backend_index,
                            const Tensor& host_ids, const Tensor& host_weights, const Tensor& backend_ids,
                            const Tensor& backend_weights) = 0;
  // Routing statistics for the experts a backend holds while serving (--gpu-experts-per-layer
  // without a profile): counts [1 x E] int32 += each pick (id >= 0) of ids [T x k], over the rows
  // whose sequence is real (padding rows of a graph step, whose block table holds only
  // `scratch_block`, are left out).
  virtual void CountPicks(const Tensor& ids, const StepTensors& step, int scratch_block, const Tensor& counts) = 0;
  // Overwrites expert `slot` of `experts` (PrepareExperts' order) with another expert's weights
  // (gate, up [I x H], down [H x I]). Between steps: nothing queued may be reading them.
  virtual absl::Status ReplaceExpert(BackendExpertWeights& experts, int slot, const core::TensorView& gate,
                                     const core::TensorView& up, const core::TensorView& down) {
    return absl::UnimplementedError(name() + " keeps no routed experts");
  }
  // out += sigmoid(gate) * shared per row (gate null: out += shared); fp32.
  virtual void AddSharedExpert(const Tensor& out, const Tensor& shared, const Tensor* gate) = 0;
  // out[i] = src[rows[i]]; rows int32 [n x 1].
  virtual void GatherRows(const Tensor& src, const Tensor& rows, const Tensor& out) = 0;

  // ---- Several ranks (parallel.h): a step's tensors over a communicator ----
  // The CPU backend runs each at once on host memory (a Gloo communicator); a GPU queues it on its
  // stream (an NCCL communicator made on stream_handle()). An error surfaces at Synchronize.
  // t, in place: summed over the ranks (fp32 or the activation dtype).
  virtual void AllReduceSum(const Tensor& t, comm::Communicator& comm) = 0;
  // out [comm.size() * t.rows x t.cols] = every rank's t, in rank order.
  virtual void AllGather(const Tensor& t, comm::Communicator& comm, const Tensor& out) = 0;
  // t to rank `peer`, or from it into t; paired in order with the peer's call.
  virtual void SendTensor(const Tensor& t, int peer, comm::Communicator& comm) = 0;
  virtual void RecvTensor(const Tensor& t, int peer, comm::Communicator& comm) = 0;
  // out [rows x parts * cols] = the `parts` blocks of stacked [parts * rows x cols], side by side
  // (the LM head's shards gathered into rows of logits).
  virtual void ConcatColumns(const Tensor& stacked, int parts, const Tensor& out) = 0;
  // The stream an NCCL communicator for this backend's tensors must queue on (a cudaStream_t), or
  // null for a backend that computes on the host.
  virtual void* stream_handle() const { return nullptr; }

 private:
  friend class StepContext;
  StepContext default_context_;
  StepContext* current_ = &default_context_;
  uint64_t next_context_id_ = 1;
};

}  // namespace moe::runtime
