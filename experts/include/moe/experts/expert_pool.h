// ExpertPool: the routed experts of every MoE layer, held packed in a HostArena and computed by
// the CPU cores.
//
// Submit(layer, hidden[T x H], topk_ids[T x k], topk_weights[T x k], out[T x H]) computes, for
// each token, the weighted sum of its top-k experts' SwiGLU outputs. Tokens are grouped by
// expert; each expert's fused gate+up blocks, then its down blocks, are split into tasks over a
// oneTBB arena of pinned threads, so a single token's decode uses every core. Few tokens (decode)
// and many tokens (prefill) are scheduled differently; see ExpertPoolOptions::decode_max_tokens. At one token the
// speed is bounded by reading the touched experts' weights from RAM (MeasureReadBandwidth gives
// the bound on the same threads); at many tokens by the kernels' arithmetic.
//
// Submit returns at once; Wait() joins the work (the waiting thread helps). One call in flight
// at a time; the arrays passed to Submit must stay valid until Wait returns. Between calls the
// threads linger awake for ExpertPoolOptions::linger_us.
//
// Thread-safety: one thread at a time drives the pool: Submit, Wait, Compute, SetKernel, the
// measurements and the phase report. SetKernel and the measurements wait for no call in flight
// (the call's threads read the kernel choice; the measurements return zeros). The const accessors
// but options() may be read from any thread; the weights are read-only once Create returns.
// The pool's own threads share a call's work through atomics (see expert_schedules.h).
// host_threads() lends the same threads to the caller's other parallel work, from the same
// thread that drives the pool (HostThreads says how).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/tensor.h"
#include "moe/experts/arena.h"
#include "moe/experts/host_threads.h"
#include "moe/experts/kernels.h"
#include "moe/experts/packed.h"

namespace moe::experts {

struct ExpertShape {
  int num_layers = 0;  // MoE layers held, addressed 0..num_layers-1 in Submit
  int num_experts = 0;
  int top_k = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
};

// One matrix of an expert as the checkpoint holds it: a tensor of bf16, f16 or f32 values, or
// rows of GGUF blocks (gguf_types.h) of a ggml type. A TensorView converts to one implicitly.
struct ExpertMatrix {
  ExpertMatrix() = default;
  ExpertMatrix(const core::TensorView& t) : tensor(t) {}  // NOLINT(google-explicit-constructor)
  ExpertMatrix(const void* data, core::DType dtype, core::Shape shape) : tensor{data, dtype, std::move(shape)} {}
  // `rows` rows of `cols` values of GGUF type `type_id`, row-major as a GGUF tensor stores them
  // (cols / block_elements blocks per row).
  static ExpertMatrix Gguf(const void* data, int64_t rows, int64_t cols, int type_id) {
    ExpertMatrix m;
    m.tensor = core::TensorView{data, core::DType::kI8, {rows, cols}};
    m.gguf_type = type_id;
    return m;
  }

  // fp8 e4m3 codes (`tensor`, dtype kF8E4M3, [rows x cols]) with one scale per [scale_rows x
  // scale_cols] block: `scales` [ceil(rows / scale_rows) x ceil(cols / scale_cols)], f32 or bf16
  // (an FP8 checkpoint's weight and weight_scale_inv). Value = code * its block's scale.
  static ExpertMatrix Fp8(const void* codes, int64_t rows, int64_t cols, const void* scales, core::DType scale_dtype,
                          int scale_rows, int scale_cols) {
    ExpertMatrix m;
    m.tensor = core::TensorView{codes, core::DType::kF8E4M3, {rows, cols}};
    m.scales = scales;
    m.scale_dtype = scale_dtype;
    m.scale_rows = scale_rows;
    m.scale_cols = scale_cols;
    return m;
  }

  // The values (dtype bf16, f16 or f32), or for GGUF blocks their data and the shape in values,
  // or fp8 codes.
  core::TensorView tensor;
  int gguf_type = -1;  // ggml type id of GGUF blocks; -1: a tensor of values
  // fp8: the block scales (null: not fp8).
  const void* scales = nullptr;
  core::DType scale_dtype = core::DType::kF32;
  int scale_rows = 0, scale_cols = 0;

  bool is_gguf() const { return gguf_type >= 0; }
  bool is_fp8() const { return scales != nullptr; }
  // fp8: the scale of the block holding (row, col).
  float Fp8Scale(int64_t row, int64_t col) const;
  const core::Shape& shape() const { return tensor.shape; }
  // Bytes the source holds (for a GGUF matrix its blocks'; 0 for a type gguf_types.h lacks; fp8:
  // the codes and the scales).
  int64_t bytes() const;
  // "Q4_K", "F8_E4M3" or "BF16".
  std::string TypeName() const;
};

// One expert's weights as the checkpoint holds them: gate and up [I x H], down [H x I].
struct ExpertWeights {
  ExpertMatrix gate, up, down;
};
using ExpertWeightSource = std::function<absl::StatusOr<ExpertWeights>(int layer, int expert)>;

struct ExpertPoolOptions {
  // How the arena holds the experts. bf16, int8, int4: every matrix converted (GGUF matrices
  // dequantized first, bit-identical to llama.cpp). A GGUF format (kQ4_K, ...): every matrix must
  // come in that GGUF type, and is kept as it is. kNative ("native"): each layer's matrices keep
  // the GGUF type the source gives them (gate and up of a layer must share one, as llama.cpp's
  // quantizer makes them; layers may differ, as Q4_K_M files' down matrices do), read from expert
  // 0 of each layer before loading; every expert of a layer must then have the same types.
  ExpertFormat format = ExpertFormat::kBF16;
  int group = 32;                    // int4 group size: 32, 64 or 128
  int threads = 0;                   // 0: every core this process may use
  std::optional<KernelKind> kernel;  // unset: chosen per call from the CPU and the token count
  bool pin_threads = true;
  std::string shm_name;  // share the arena across processes under this name
  std::string model_id;  // identifies the weights in a shared segment's key
  bool progress = true;  // loading progress on stderr
  // Calls of at most this many tokens use the decode schedule (long contiguous streams of the
  // active experts' weights, a few units per thread); larger calls the batch schedule (work
  // items per expert). 0: always the batch schedule.
  int64_t decode_max_tokens = 16;
  // Units of work per thread and stage in the decode schedule: more balance the load across
  // threads, fewer give longer sequential streams.
  int decode_units_per_thread = 4;
  // Microseconds the threads stay awake after a call, spinning (then yielding the core), so that
  // the next call starts at once: a forward's other work between two MoE layers (attention on
  // the GPU, the shared experts) fits in it. Threads that sleep take up to hundreds of
  // microseconds to wake. 0: they sleep right after each call.
  int64_t linger_us = 2000;
};

// A slot of topk_ids that the call skips: its weight is not read and no expert runs for it. A
// token whose every slot is skipped gets zeros. (A tensor split's rank computes the experts it
// owns, and expert deferral splits a token's picks over two calls.)
inline constexpr int32_t kSkippedSlot = -1;

class ExpertPool {
 public:
  // Packs every expert from `source` into the arena (or attaches to a published shared segment).
  // kInvalidArgument for a bad shape or option; kFailedPrecondition for a kernel this CPU lacks.
  static absl::StatusOr<std::unique_ptr<ExpertPool>> Create(const ExpertShape& shape, const ExpertPoolOptions& options,
                                                            const ExpertWeightSource& source);
  ~ExpertPool();

  struct Ticket {
    uint64_t id = 0;
  };
  // topk_ids may hold kSkippedSlot. kInvalidArgument for a layer or expert id out of range
  // (nothing is started);
  // kFailedPrecondition if a call is already in flight.
  absl::StatusOr<Ticket> Submit(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                                const float* topk_weights, float* out);
  absl::Status Wait(const Ticket& ticket);
  absl::Status Compute(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                       const float* topk_weights, float* out);

  const ExpertShape& shape() const { return shape_; }
  const ExpertPoolOptions& options() const { return options_; }
  int threads() const { return threads_; }
  const HostArena& arena() const { return *arena_; }
  // The pool's pinned threads for the driving thread's other parallel loops (the CPU backend's
  // operations), so that one set of threads does all the host's work; valid while the pool lives.
  // A loop finishes a call in flight first. The pool's linger_us applies after Rest.
  HostThreads& host_threads();
  // The packed experts as they lie in the arena (packed.h): expert e of layer l at
  // data + layers[l].offset + e * layers[l].expert_bytes, its fused gate+up matrix (16-row blocks
  // that alternate gate and up rows of 16 intermediate units) and then its down matrix; a layer's
  // experts are contiguous. Each matrix's layout carries its format (for GGUF formats the ggml
  // type, layout.gguf_type). Where every layer is laid out alike (uniform: every format but
  // native, and native files with one type per matrix kind), expert e of layer l is also at
  // data + (l * num_experts + e) * expert_bytes with gate_up and down; otherwise those three
  // are layer 0's. For streaming them to a GPU (which must know the formats it unpacks).
  struct LayerArena {
    int64_t offset = 0, expert_bytes = 0;
    MatrixLayout gate_up, down;
  };
  struct ArenaLayout {
    const uint8_t* data = nullptr;
    int64_t expert_bytes = 0;
    MatrixLayout gate_up, down;
    bool uniform = true;
    std::vector<LayerArena> layers;  // one per MoE layer, always filled
  };
  ArenaLayout arena_layout() const;
  int64_t expert_bytes() const { return expert_bytes_; }
  double load_seconds() const { return load_seconds_; }
  int64_t loaded_bytes() const { return loaded_bytes_; }  // checkpoint bytes read (0 when attached)
  // The kernel a call with `tokens` tokens per expert uses.
  KernelKind KernelFor(int64_t tokens) const;
  // Forces a kernel for later calls (unset: per call); kFailedPrecondition if this CPU lacks it.
  absl::Status SetKernel(std::optional<KernelKind> kernel);
  // Reads a `bytes` buffer with the pool's threads, best of `repeats`: GB/s (0 during a call).
  double MeasureReadBandwidth(size_t bytes, int repeats = 5);
  // How fast the kernels alone stream the arena's weights, against MeasureReadBandwidth: every
  // thread runs the kernel a call with `tokens` tokens per expert uses (SetKernel's if forced)
  // over its share of all the arena's experts, in a batch call's work items, best of `repeats`.
  // GB/s of weights for gate+up alone, down alone, and both per expert; zeros during a call, for
  // tokens < 1, or if the kernel cannot run on this thread (AMX refused by the OS).
  struct KernelStream {
    double gate_up_gbps = 0, down_gbps = 0, all_gbps = 0;
  };
  KernelStream MeasureKernelStream(int64_t tokens, int repeats = 3);
  // Mean wall time of each phase of a call since the last ResetPhases(), and the share of the
  // threads' time in the sort and experts phase each kind of work took (the rest idle: before a
  // thread's first piece of work, after its last, or waiting in between), for benchmarks.
  std::string PhaseReport() const;
  void ResetPhases();
  // "int8 experts: 2 layers x 128, 1.2 GB in transparent huge pages, 32 pinned threads"
  std::string Describe() const;

 private:
  // The threads, the experts' layout in the arena and the calls' scratch (expert_pool.cc).
  class Impl;

  ExpertPool() = default;
  // One call, on the thread that leads it.
  absl::Status Run(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                   const float* topk_weights, float* out);

  ExpertShape shape_;
  ExpertPoolOptions options_;
  int threads_ = 0;
  int64_t expert_bytes_ = 0;
  std::unique_ptr<HostArena> arena_;
  std::unique_ptr<Impl> impl_;
  double load_seconds_ = 0;
  int64_t loaded_bytes_ = 0;
  uint64_t next_ticket_ = 1;
  bool in_flight_ = false;
};

// The host read bandwidth `threads` pinned threads (0: every core this process may use) reach
// over a `bytes` buffer, best of `repeats`, in GB/s: what ExpertPool::MeasureReadBandwidth gives,
// without a pool (planning before anything loads). 0 if the buffer cannot be had.
double MeasureHostReadBandwidth(int threads, size_t bytes, int repeats = 3);

// Bytes the pool's arena takes for one expert of `shape` in `format` (its fused gate+up and its
// down, packed): what one routed expert reads per token. (kNative: kInvalidArgument, the types
// come with the source; a GGUF format: its blocks.)
absl::StatusOr<int64_t> PackedExpertBytes(const ExpertShape& shape, ExpertFormat format, int group = 32);

}  // namespace moe::experts
