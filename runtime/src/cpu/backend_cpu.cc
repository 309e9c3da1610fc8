#include "moe/runtime/backend_cpu.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu/attention.h"
#include "cpu/kernels.h"
#include "cpu/mla_attention.h"
#include "moe/comm/communicator.h"
#include "moe/core/cpu_features.h"
#include "moe/core/memory.h"
#include "moe/core/status.h"
#include "moe/experts/gguf_types.h"
#include "moe/experts/kernels.h"
#include "moe/runtime/routing.h"
#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/info.h"
#include "oneapi/tbb/parallel_for.h"
#include "oneapi/tbb/task_arena.h"

namespace moe::runtime {
namespace {

using core::DType;

class CpuBuffer : public DeviceBuffer {
 public:
  CpuBuffer(core::AlignedBuffer buffer, DType dtype, int64_t rows, int64_t cols)
      : buffer_(std::move(buffer)), dtype_(dtype), rows_(rows), cols_(cols) {}
  Tensor tensor() const override { return Tensor{buffer_.data(), dtype_, rows_, cols_}; }

 private:
  core::AlignedBuffer buffer_;
  DType dtype_;
  int64_t rows_, cols_;
};

class CpuHostBuffer : public HostBuffer {
 public:
  explicit CpuHostBuffer(core::AlignedBuffer buffer) : buffer_(std::move(buffer)) {}
  void* data() const override { return buffer_.data(); }
  int64_t bytes() const override { return static_cast<int64_t>(buffer_.size()); }

 private:
  core::AlignedBuffer buffer_;
};

// The CPU runs every operation when it is queued: an event is always reached.
class CpuEvent : public Event {
 public:
  void Record() override {}
  absl::Status Wait() override { return absl::OkStatus(); }
};

// bf16 or f32, in place in the mapped checkpoint, or an owned copy (f16 converted to f32, fused
// weights, vectors).
class CpuWeight : public DeviceWeight {
 public:
  CpuWeight(core::Shape shape, DType dtype, const void* data, core::AlignedBuffer owned)
      : owned_(std::move(owned)), dtype_(dtype), data_(owned_.data() != nullptr ? owned_.data() : data) {
    shape_ = std::move(shape);
  }
  int64_t bytes() const override {
    if (gguf_type_ >= 0) return shape_[0] * row_bytes_;
    return packed_ ? packed_->layout.bytes() : core::NumElements(shape_) * core::DTypeSize(dtype_);
  }
  // Rows of GGUF blocks where they lie in the mapped file (an embedding: its rows are gathered one
  // token at a time and dequantized as they are).
  static std::unique_ptr<CpuWeight> GgufRows(core::Shape shape, int type_id, int64_t row_bytes, const void* data) {
    auto w = std::unique_ptr<CpuWeight>(new CpuWeight(std::move(shape), DType::kI8, data, {}));
    w->gguf_type_ = type_id;
    w->row_bytes_ = row_bytes;
    return w;
  }
  DType dtype() const { return dtype_; }
  const float* f32() const { return static_cast<const float*>(data_); }
  const uint16_t* bf16() const { return static_cast<const uint16_t*>(data_); }
  // Row r as floats: a pointer into the weight, or into `scratch` after conversion.
  const float* RowF32(int64_t r, float* scratch) const {
    const int64_t k = cols();
    if (gguf_type_ >= 0) {
      experts::DequantizeRow(gguf_type_, static_cast<const uint8_t*>(data_) + r * row_bytes_, k, scratch);
      return scratch;
    }
    if (dtype_ == DType::kF32) return f32() + r * k;
    internal::Bf16RowToF32(bf16() + r * k, k, scratch);
    return scratch;
  }
  float Dot(const float* x, int64_t r) const {
    const int64_t k = cols();
    if (gguf_type_ >= 0) {
      thread_local std::vector<float> row;
      row.resize(k);
      return internal::DotF32(x, RowF32(r, row.data()), k);
    }
    return dtype_ == DType::kF32 ? internal::DotF32(x, f32() + r * k, k) : internal::DotBf16(x, bf16() + r * k, k);
  }
  // Packed in the expert pool's int8 or int4 form (the weight's only form then).
  static std::unique_ptr<CpuWeight> Packed(core::Shape shape, experts::MatrixLayout layout, core::AlignedBuffer data) {
    auto w = std::unique_ptr<CpuWeight>(new CpuWeight(std::move(shape), DType::kI8, nullptr, std::move(data)));
    w->packed_ = experts::PackedMatrix{layout, static_cast<const uint8_t*>(w->data_)};
    return w;
  }
  const std::optional<experts::PackedMatrix>& packed() const { return packed_; }
  int64_t packed_bytes() const { return packed_ ? packed_->layout.bytes() : 0; }

 private:
  std::optional<experts::PackedMatrix> packed_;
  int gguf_type_ = -1;  // GgufRows
  int64_t row_bytes_ = 0;
  core::AlignedBuffer owned_;
  DType dtype_;
  const void* data_;
};

const CpuWeight& AsCpu(const DeviceWeight& w) { return static_cast<const CpuWeight&>(w); }

// One layer's routed experts for the reference path: each expert's gate and up fused.
class CpuExpertWeights : public BackendExpertWeights {
 public:
  int64_t bytes() const override {
    int64_t n = 0;
    for (const auto& e : gate_up) n += e->bytes();
    for (const auto& e : down) n += e->bytes();
    return n;
  }
  std::vector<std::unique_ptr<DeviceWeight>> gate_up, down;
};

absl::Status CheckWeightDType(const core::TensorView& t) {
  if (t.dtype == DType::kBF16 || t.dtype == DType::kF16 || t.dtype == DType::kF32) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", core::DTypeName(t.dtype), " is not a weight type (BF16, F16, F32)"));
}

// Operations run when they are queued, each a parallel loop over the backend's threads: its own
// oneTBB arena, or the expert pool's pinned crew once lent one (UseHostThreads), so that the
// step's operations and the pool's calls share one set of threads, awake from one to the next.
class CpuBackend : public Backend {
  // The first failed collective of the step, returned by the next Synchronize (as a GPU's queued
  // work reports its errors there).
  absl::Status comm_error_;
  void KeepCommError(absl::Status s, const std::string& what) {
    if (!s.ok() && comm_error_.ok()) comm_error_ = core::Annotate(s, what);
  }

 public:
  CpuBackend(int threads, WeightPolicy policy) : arena_(threads), policy_(std::move(policy)) {}

  std::string name() const override {
    return host_threads_ != nullptr ? absl::StrCat("cpu (", threads(), " threads, the expert pool's)")
                                    : absl::StrCat("cpu (", threads(), " threads)");
  }
  bool ComputesOnHostCores() const override { return true; }
  bool HostAddressable() const override { return true; }
  void UseHostThreads(experts::HostThreads* threads) override {
    if (host_threads_ != nullptr) host_threads_->Rest();
    host_threads_ = threads;
  }
  experts::HostThreads* host_threads() const override { return host_threads_; }
  DType activation_dtype() const override { return DType::kF32; }

  const WeightPolicy& weight_policy() const override { return policy_; }

  absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareWeight(const core::TensorView& host, WeightUse use,
                                                              TensorRole role = TensorRole::kOther) override {
    if (host.rank() < 1 || host.rank() > 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights must be 1-D or 2-D, got ", core::ShapeString(host.shape)));
    }
    MOE_RETURN_IF_ERROR(CheckWeightDType(host));
    if (const experts::ExpertFormat f = policy_.MatrixFormat(role);
        use == WeightUse::kMatrix && f != experts::ExpertFormat::kBF16) {
      return Pack({host}, f);
    }
    // Matrices in bf16 or f32 are used where they lie; everything else becomes an f32 copy.
    if (use != WeightUse::kVector && host.dtype != DType::kF16) {
      return std::unique_ptr<DeviceWeight>(new CpuWeight(host.shape, host.dtype, host.data, {}));
    }
    return Fused({host}, /*f32=*/use == WeightUse::kVector);
  }

  // GGUF Linears: the parts' blocks re-ordered for the kernels (experts/packed.h), as small as the
  // file.
  absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareStoredWeight(const std::vector<WeightView>& parts,
                                                                    WeightUse use, TensorRole role) override {
    if (use == WeightUse::kEmbedding && parts.size() == 1 && parts[0].rank() == 2 &&
        experts::FindGgufType(parts[0].format.type_id) != nullptr) {
      const WeightView& e = parts[0];
      return std::unique_ptr<DeviceWeight>(
          CpuWeight::GgufRows(e.shape, e.format.type_id, e.format.RowBytes(e.shape[1]), e.data));
    }
    if (parts.empty() || use != WeightUse::kMatrix) {
      return absl::InvalidArgumentError("stored weights are Linears or an embedding");
    }
    const WeightFormat& stored = parts[0].format;
    int64_t rows = 0;
    for (const WeightView& p : parts) {
      if (p.rank() != 2 || p.shape[1] != parts[0].shape[1] || !(p.format == stored)) {
        return absl::InvalidArgumentError("stored weights stack 2-D parts of one format and width");
      }
      rows += p.shape[0];
    }
    const int64_t cols = parts[0].shape[1];
    // Row r of the stacked parts: its part and its row there.
    const auto part_row = [&](int64_t r) -> std::pair<const WeightView*, int64_t> {
      for (const WeightView& p : parts) {
        if (r < p.shape[0]) return {&p, r};
        r -= p.shape[0];
      }
      return {nullptr, 0};
    };
    if (stored.kind == WeightFormat::Kind::kBlockScaled) {
      // fp8 codes and their block scales as they are (SupportsStoredWeight: a group fits the blocks).
      const int group = Fp8Group(stored);
      if (group == 0) return absl::InvalidArgumentError(absl::StrCat("no fp8 layout for ", stored.Name()));
      MOE_ASSIGN_OR_RETURN(const experts::MatrixLayout layout,
                           experts::MakeLayout(experts::ExpertFormat::kFp8, rows, cols, group));
      MOE_ASSIGN_OR_RETURN(auto data, core::AlignedBuffer::Allocate(layout.bytes()));
      experts::PackFp8Rows(
          layout,
          [&](int64_t r) {
            const auto [p, pr] = part_row(r);
            return p == nullptr ? nullptr : static_cast<const uint8_t*>(p->data) + pr * cols;
          },
          [&](int64_t r, int64_t g) {
            const auto [p, pr] = part_row(r);
            const int64_t scale_cols = p->scale_shape.size() == 2 ? p->scale_shape[1] : 1;
            return p->Scale((pr / stored.scale_rows) * scale_cols + g * group / stored.scale_cols);
          },
          data.as<uint8_t>());
      return std::unique_ptr<DeviceWeight>(CpuWeight::Packed(core::Shape{rows, cols}, layout, std::move(data)));
    }
    MOE_ASSIGN_OR_RETURN(const experts::ExpertFormat format, experts::FormatForGgufType(stored.type_id));
    MOE_ASSIGN_OR_RETURN(const experts::MatrixLayout layout, experts::MakeLayout(format, rows, cols));
    MOE_ASSIGN_OR_RETURN(auto data, core::AlignedBuffer::Allocate(layout.bytes()));
    const int64_t row_bytes = stored.RowBytes(cols);
    experts::PackGgufRows(
        layout,
        [&](int64_t r) -> const uint8_t* {
          const auto [p, pr] = part_row(r);
          return p == nullptr ? nullptr : static_cast<const uint8_t*>(p->data) + pr * row_bytes;
        },
        data.as<uint8_t>());
    return std::unique_ptr<DeviceWeight>(CpuWeight::Packed(core::Shape{rows, cols}, layout, std::move(data)));
  }

  absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareFusedWeight(const std::vector<core::TensorView>& parts,
                                                                   WeightUse use,
                                                                   TensorRole role = TensorRole::kOther) override {
    for (const auto& p : parts) MOE_RETURN_IF_ERROR(CheckWeightDType(p));
    if (const experts::ExpertFormat f = policy_.MatrixFormat(role);
        use == WeightUse::kMatrix && f != experts::ExpertFormat::kBF16) {
      return Pack(parts, f);
    }
    return Fused(parts);
  }

  absl::StatusOr<std::unique_ptr<BackendExpertWeights>> PrepareExperts(
      const std::vector<core::TensorView>& gate, const std::vector<core::TensorView>& up,
      const std::vector<core::TensorView>& down) override {
    auto experts = std::make_unique<CpuExpertWeights>();
    for (size_t e = 0; e < gate.size(); ++e) {
      MOE_ASSIGN_OR_RETURN(auto gate_up, PrepareFusedWeight({gate[e], up[e]}, WeightUse::kMatrix));
      MOE_ASSIGN_OR_RETURN(auto d, PrepareWeight(down[e], WeightUse::kMatrix));
      experts->gate_up.push_back(std::move(gate_up));
      experts->down.push_back(std::move(d));
    }
    return std::unique_ptr<BackendExpertWeights>(std::move(experts));
  }

  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(DType dtype, int64_t rows, int64_t cols) override {
    const int64_t bytes = std::max<int64_t>(rows * cols * core::DTypeSize(dtype), 1);
    MOE_ASSIGN_OR_RETURN(auto buffer, core::AlignedBuffer::Allocate(bytes));
    return std::unique_ptr<DeviceBuffer>(new CpuBuffer(std::move(buffer), dtype, rows, cols));
  }
  absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(int64_t bytes) override {
    MOE_ASSIGN_OR_RETURN(auto buffer, core::AlignedBuffer::Allocate(std::max<int64_t>(bytes, 1)));
    return std::unique_ptr<HostBuffer>(new CpuHostBuffer(std::move(buffer)));
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return std::unique_ptr<Event>(new CpuEvent()); }
  int64_t FreeMemoryBytes() const override {
    return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  }

  absl::StatusOr<Roofline> MeasureRoofline(int64_t bytes) override {
    Roofline r;
    const int64_t n = bytes / 4;
    MOE_ASSIGN_OR_RETURN(auto buffer, core::AlignedBuffer::Allocate(n * 4));
    float* v = buffer.as<float>();
    ParallelFor(n, 1 << 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) v[i] = static_cast<float>(i & 7);
    });
    double best = 0;
    for (int repeat = 0; repeat < 5; ++repeat) {
      const auto start = std::chrono::steady_clock::now();
      std::atomic<float> sink{0};
      // In sixteen partial sums: one running sum is bound by its adds' latency, not by memory (it
      // read half as fast as the expert pool's probe on the same threads).
      ParallelFor(n, 1 << 16, [&](int64_t begin, int64_t end) {
        sink.store(internal::SumF32(v + begin, end - begin), std::memory_order_relaxed);
      });
      best = std::max(best, n * 4 / std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    r.memory_gbps = best / 1e9;
    r.memory_what = absl::StrCat("host read bandwidth, ", threads(), " threads");
    // The fp32 Linear at a prefill-like shape.
    const int64_t m = 256, k = 2048, out = 2048;
    std::vector<float> x(m * k, 0.5f), w(out * k, 0.25f), y(m * out);
    core::TensorView wv{w.data(), DType::kF32, {out, k}};
    MOE_ASSIGN_OR_RETURN(auto weight, PrepareWeight(wv, WeightUse::kMatrix));
    const Tensor xt{x.data(), DType::kF32, m, k}, yt{y.data(), DType::kF32, m, out};
    Linear(xt, *weight, nullptr, yt);
    const auto start = std::chrono::steady_clock::now();
    const int reps = 3;
    for (int i = 0; i < reps; ++i) Linear(xt, *weight, nullptr, yt);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    r.matmul_tflops = 2.0 * m * k * out * reps / seconds / 1e12;
    r.matmul_what = policy_.matrices == experts::ExpertFormat::kBF16
                        ? "fp32 Linear 256x2048x2048"
                        : absl::StrCat(experts::FormatName(policy_.matrices), " packed Linear 256x2048x2048");
    return r;
  }

  void CopyToHost(const Tensor& src, void* dst) override { std::memcpy(dst, src.data, src.bytes()); }
  void CopyFromHost(const void* src, const Tensor& dst) override { std::memcpy(dst.data, src, dst.bytes()); }
  // Every operation has run by now: the threads may rest until the next step.
  absl::Status Synchronize() override {
    if (host_threads_ != nullptr) host_threads_->Rest();
    absl::Status s = std::move(comm_error_);
    comm_error_ = absl::OkStatus();
    return s;
  }

  void AllReduceSum(const Tensor& t, comm::Communicator& comm) override {
    KeepCommError(comm.AllReduceSum(t.data, t.numel(), t.dtype), "all-reduce");
  }
  void AllGather(const Tensor& t, comm::Communicator& comm, const Tensor& out) override {
    KeepCommError(comm.AllGather(t.data, out.data, t.bytes()), "all-gather");
  }
  void SendTensor(const Tensor& t, int peer, comm::Communicator& comm) override {
    KeepCommError(comm.Send(t.data, t.bytes(), peer), absl::StrCat("send to rank ", peer));
  }
  void RecvTensor(const Tensor& t, int peer, comm::Communicator& comm) override {
    KeepCommError(comm.Recv(t.data, t.bytes(), peer), absl::StrCat("receive from rank ", peer));
  }
  void ConcatColumns(const Tensor& stacked, int parts, const Tensor& out) override {
    const int64_t rows = out.rows, cols = stacked.cols, elem = core::DTypeSize(out.dtype);
    for (int p = 0; p < parts; ++p) {
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(static_cast<char*>(out.data) + (r * out.cols + p * cols) * elem,
                    static_cast<const char*>(stacked.data) + ((p * rows + r) * cols) * elem, cols * elem);
      }
    }
  }

  void Embed(const DeviceWeight& table, const StepTensors& step, const Tensor& x) override {
    const CpuWeight& t = AsCpu(table);
    const int64_t h = t.cols();
    float* out = x.as<float>();
    const int32_t* ids = step.token_ids.as<int32_t>();
    For(step.num_tokens, [&](int64_t i) {
      const float* row = t.RowF32(ids[i], out + i * h);
      if (row != out + i * h) std::memcpy(out + i * h, row, h * sizeof(float));
    });
  }

  void AddRmsNorm(const Tensor& x, const Tensor* delta, const DeviceWeight& w, float eps, const Tensor& out) override {
    const float* wr = AsCpu(w).f32();
    const int64_t cols = x.cols;
    float* xs = x.as<float>();
    const float* ds = delta != nullptr ? delta->as<float>() : nullptr;
    For(x.rows, [&](int64_t r) {
      float* xr = xs + r * cols;
      if (ds != nullptr) {
        const float* dr = ds + r * cols;
        for (int64_t i = 0; i < cols; ++i) xr[i] += dr[i];
      }
      NormRow(xr, wr, eps, cols, out.as<float>() + r * cols);
    });
  }

  void Linear(const Tensor& x, const DeviceWeight& w, const DeviceWeight* bias, const Tensor& out) override {
    const CpuWeight& wt = AsCpu(w);
    const int64_t n = wt.rows();
    const int64_t k = wt.cols();
    const int64_t rows = x.rows;
    const float* xs = x.as<float>();
    float* o = out.as<float>();
    const float* b = bias != nullptr ? AsCpu(*bias).f32() : nullptr;
    if (wt.packed()) {
      PackedLinear(*wt.packed(), xs, rows, k, n, b, o);
      return;
    }
    // Each weight row is read once (converted once) and used for every token: bandwidth-bound
    // at one token, compute-bound (fp32 FMA) for long prefills.
    ParallelFor(n, 16, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scratch;
      if (rows > 1 && scratch.size() < static_cast<size_t>(k)) scratch.resize(k);
      for (int64_t j = begin; j < end; ++j) {
        const float bj = b == nullptr ? 0.0f : b[j];
        if (rows == 1) {
          o[j] = wt.Dot(xs, j) + bj;
          continue;
        }
        const float* wj = wt.RowF32(j, scratch.data());
        for (int64_t t = 0; t < rows; ++t) o[t * n + j] = internal::DotF32(xs + t * k, wj, k) + bj;
      }
    });
  }

  void Attention(const AttentionArgs& a, const StepTensors& step) override {
    const StepInputs& in = *step.host;
    KvCache& cache = *a.cache;
    const int bs = cache.shape().block_size;
    const int d = a.head_dim;
    const int64_t q_width = static_cast<int64_t>(a.num_heads) * d;
    const int64_t kv_width = static_cast<int64_t>(a.num_kv_heads) * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const float* inv_freq = a.inv_freq->as<float>();
    const float* q_norm = a.q_norm != nullptr ? AsCpu(*a.q_norm).f32() : nullptr;
    const float* k_norm = a.k_norm != nullptr ? AsCpu(*a.k_norm).f32() : nullptr;
    float* k_cache = static_cast<float*>(cache.k(a.layer));
    float* v_cache = static_cast<float*>(cache.v(a.layer));
    const int64_t per_block = cache.shape().elements_per_block_layer();
    auto slot_of = [&](int64_t r, int h) {
      const int p = in.positions[r];
      const int block = in.block_table[static_cast<int64_t>(in.row_seq[r]) * in.max_blocks + p / bs];
      return block * per_block + (static_cast<int64_t>(h) * bs + p % bs) * d;
    };
    // Per row: q and k get their per-head norm and RoPE; k and v go into the cache first, since a
    // chunk's later tokens attend to its earlier ones.
    For(step.num_tokens, [&](int64_t r) {
      const float* src = a.qkv.as<float>() + r * qkv_width;
      float* q = a.q.as<float>() + r * q_width;
      std::memcpy(q, src, q_width * sizeof(float));
      // Per-thread scratch: this runs per token and layer, so nothing is allocated per row.
      thread_local std::vector<float> k;
      k.assign(src + q_width, src + q_width + kv_width);
      if (q_norm != nullptr) {
        for (int h = 0; h < a.num_heads; ++h) NormRow(q + h * d, q_norm, a.eps, d, q + h * d);
        for (int h = 0; h < a.num_kv_heads; ++h) NormRow(k.data() + h * d, k_norm, a.eps, d, k.data() + h * d);
      }
      RotateQk(q, a.num_heads, k.data(), a.num_kv_heads, d, a.rotary_dim, inv_freq, in.positions[r]);
      for (int h = 0; h < a.num_kv_heads; ++h) {
        std::memcpy(k_cache + slot_of(r, h), k.data() + h * d, d * sizeof(float));
        std::memcpy(v_cache + slot_of(r, h), src + q_width + kv_width + h * d, d * sizeof(float));
      }
    });
    // Then every row's queries against its sequence's keys, in blocks that read each key once for
    // the heads of a GQA group (cpu/attention.h).
    const internal::PagedKv kv{k_cache, v_cache, bs, a.num_kv_heads, d};
    const internal::AttentionQueries queries{a.q.as<float>(), a.out.as<float>(),     a.num_heads,
                                             a.scale,         in.positions.data(),   in.seq_start.data(),
                                             in.num_seqs(),   in.block_table.data(), in.max_blocks};
    auto loop = [this](int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body) {
      ParallelFor(n, grain, body);
    };
    internal::PagedAttention(kv, queries, attention_isa_, loop, attention_scratch_);
  }

  bool SupportsAttention(AttentionKind kind) const override {
    return kind == AttentionKind::kGqa || kind == AttentionKind::kMla;
  }

  void AttentionMla(const MlaAttentionArgs& a, const StepTensors& step) override {
    const StepInputs& in = *step.host;
    const internal::MlaDims d{a.num_heads, a.mla.qk_nope_head_dim, a.mla.qk_rope_head_dim, a.mla.v_head_dim,
                              a.mla.kv_lora_rank};
    KvCache& cache = *a.cache;
    const int bs = cache.shape().block_size;
    const int64_t width = d.latent(), q_width = int64_t{d.heads} * d.qk();
    const float* inv_freq = a.inv_freq->as<float>();
    const float* kv_norm = AsCpu(*a.kv_norm).f32();
    float* rows = static_cast<float*>(cache.k(a.layer));
    // Per token: the latent normed, k_rope and each head's q_rope rotated, the row into the cache
    // first, since a chunk's later tokens attend to its earlier ones.
    For(step.num_tokens, [&](int64_t r) {
      float* kv = a.kv.as<float>() + r * width;
      const int32_t p = in.positions[r];
      NormRow(kv, kv_norm, a.eps, d.lora, kv);
      internal::RotateMla(kv + d.lora, d.rope, inv_freq, p, a.rope_attention_factor, a.mla.rope_interleave);
      float* q = a.q.as<float>() + r * q_width;
      for (int h = 0; h < d.heads; ++h) {
        internal::RotateMla(q + int64_t{h} * d.qk() + d.nope, d.rope, inv_freq, p, a.rope_attention_factor,
                            a.mla.rope_interleave);
      }
      const int block = in.block_table[static_cast<int64_t>(in.row_seq[r]) * in.max_blocks + p / bs];
      std::memcpy(rows + (static_cast<int64_t>(block) * bs + p % bs) * width, kv, width * sizeof(float));
    });
    const internal::PagedLatent latent{rows, bs};
    const internal::MlaQueries queries{a.q.as<float>(),     a.out.as<float>(),     a.scale,      in.positions.data(),
                                       in.seq_start.data(), in.block_table.data(), in.max_blocks};
    auto loop = [this](int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body) {
      ParallelFor(n, grain, body);
    };
    const float* kv_b = AsCpu(*a.kv_b).f32();
    auto absorb = [&](int s) {
      const bool one_token = in.seq_start[s + 1] - in.seq_start[s] == 1;
      return a.form == MlaForm::kAbsorbed || (a.form == MlaForm::kAuto && one_token);
    };
    // Runs of absorbed sequences (a decode batch is one) go to the blocked kernel together.
    for (int s = 0; s < in.num_seqs();) {
      if (!absorb(s)) {
        internal::MlaAttendExpanded(d, kv_b, latent, queries, s++, loop);
        continue;
      }
      int end = s + 1;
      while (end < in.num_seqs() && absorb(end)) ++end;
      internal::MlaAttendAbsorbed(d, kv_b, latent, queries, s, end - s, attention_isa_, loop, attention_scratch_,
                                  &mla_queries_, &mla_outputs_);
      s = end;
    }
  }

  void SiluMul(const Tensor& gate_up, const Tensor& out) override {
    const int64_t width = out.cols;
    For(out.rows, [&](int64_t r) {
      const float* g = gate_up.as<float>() + r * 2 * width;
      const float* u = g + width;
      float* o = out.as<float>() + r * width;
      for (int64_t i = 0; i < width; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    });
  }

  void Route(const Tensor& logits, const RoutingSpec& spec, const DeviceWeight* correction_bias, const Tensor& ids,
             const Tensor& weights) override {
    const int64_t e = logits.cols, k = ids.cols;
    ParallelFor(logits.rows, 16, [&](int64_t begin, int64_t end) {
      RouteTokens(spec, logits.as<float>() + begin * e, end - begin,
                  correction_bias != nullptr ? AsCpu(*correction_bias).f32() : nullptr, ids.as<int32_t>() + begin * k,
                  weights.as<float>() + begin * k);
    });
  }

  void CountPicks(const Tensor& ids, const StepTensors& step, int scratch_block, const Tensor& counts) override {
    const StepInputs& in = *step.host;
    const int64_t k = ids.cols;
    for (int64_t r = 0; r < ids.rows; ++r) {
      if (in.block_table[static_cast<int64_t>(in.row_seq[r]) * in.max_blocks] == scratch_block) continue;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = ids.as<int32_t>()[r * k + j];
        if (e >= 0 && e < counts.cols) ++counts.as<int32_t>()[e];
      }
    }
  }

  absl::Status ReplaceExpert(BackendExpertWeights& experts, int slot, const core::TensorView& gate,
                             const core::TensorView& up, const core::TensorView& down) override {
    auto& ex = static_cast<CpuExpertWeights&>(experts);
    if (slot < 0 || slot >= static_cast<int>(ex.gate_up.size())) {
      return absl::InvalidArgumentError(absl::StrCat("expert slot ", slot, " outside [0, ", ex.gate_up.size(), ")"));
    }
    MOE_ASSIGN_OR_RETURN(auto gate_up, PrepareFusedWeight({gate, up}, WeightUse::kMatrix));
    MOE_ASSIGN_OR_RETURN(auto d, PrepareWeight(down, WeightUse::kMatrix));
    ex.gate_up[slot] = std::move(gate_up);
    ex.down[slot] = std::move(d);
    return absl::OkStatus();
  }

  void SplitRouting(const Tensor& ids, const Tensor& weights, const Tensor& backend_index, const Tensor& host_ids,
                    const Tensor& host_weights, const Tensor& backend_ids, const Tensor& backend_weights) override {
    const int64_t k = ids.cols;
    For(ids.rows, [&](int64_t r) {
      SplitPicks(ids.as<int32_t>() + r * k, weights.as<float>() + r * k, static_cast<int>(k),
                 backend_index.as<int32_t>(), host_ids.as<int32_t>() + r * k, host_weights.as<float>() + r * k,
                 backend_ids.as<int32_t>() + r * k, backend_weights.as<float>() + r * k);
    });
  }

  // The plain routed-expert path: tokens grouped by expert, each expert's FFN run on its rows,
  // outputs added back with their routing weights.
  void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights, const BackendExpertWeights& experts,
                  const Tensor& out) override {
    const auto& ex = static_cast<const CpuExpertWeights&>(experts);
    const int64_t tokens = x.rows, h = x.cols, k = ids.cols;
    const int num_experts = static_cast<int>(ex.gate_up.size());
    std::vector<std::vector<int32_t>> rows(num_experts);
    std::vector<std::vector<float>> scales(num_experts);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = ids.as<int32_t>()[t * k + j];
        if (e < 0 || e >= num_experts) continue;  // a skipped slot (SplitPicks')
        rows[e].push_back(static_cast<int32_t>(t));
        scales[e].push_back(weights.as<float>()[t * k + j]);
      }
    }
    std::fill(out.as<float>(), out.as<float>() + out.numel(), 0.0f);
    for (int e = 0; e < num_experts; ++e) {
      const int64_t n = static_cast<int64_t>(rows[e].size());
      if (n == 0) continue;
      const int64_t width = ex.down[e]->cols();
      std::vector<float> xe(n * h), gate_up(n * 2 * width), act(n * width), y(n * h);
      for (int64_t i = 0; i < n; ++i) std::memcpy(&xe[i * h], x.as<float>() + rows[e][i] * h, h * sizeof(float));
      Linear(Tensor{xe.data(), DType::kF32, n, h}, *ex.gate_up[e], nullptr,
             Tensor{gate_up.data(), DType::kF32, n, 2 * width});
      SiluMul(Tensor{gate_up.data(), DType::kF32, n, 2 * width}, Tensor{act.data(), DType::kF32, n, width});
      Linear(Tensor{act.data(), DType::kF32, n, width}, *ex.down[e], nullptr, Tensor{y.data(), DType::kF32, n, h});
      for (int64_t i = 0; i < n; ++i) internal::Axpy(scales[e][i], &y[i * h], h, out.as<float>() + rows[e][i] * h);
    }
  }

  void AddSharedExpert(const Tensor& out, const Tensor& shared, const Tensor* gate) override {
    const int64_t cols = out.cols;
    For(out.rows, [&](int64_t r) {
      const float s = gate == nullptr ? 1.0f : 1.0f / (1.0f + std::exp(-gate->as<float>()[r]));
      float* o = out.as<float>() + r * cols;
      const float* x = shared.as<float>() + r * cols;
      for (int64_t i = 0; i < cols; ++i) o[i] += x[i] * s;
    });
  }

  void GatherRows(const Tensor& src, const Tensor& rows, const Tensor& out) override {
    const int64_t row_bytes = src.cols * core::DTypeSize(src.dtype);
    for (int64_t i = 0; i < rows.rows; ++i) {
      std::memcpy(static_cast<char*>(out.data) + i * row_bytes,
                  static_cast<const char*>(src.data) + rows.as<int32_t>()[i] * row_bytes, row_bytes);
    }
  }

 private:
  // out = x * rsqrt(mean(x^2) + eps) * w over n values; out may equal x.
  static void NormRow(const float* x, const float* w, float eps, int64_t n, float* out) {
    const float ss = internal::DotF32(x, x, n);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
  }
  // RoPE (NeoX half-split) of the first rotary_dim dims of every q and k head of one row, by
  // position * inv_freq[i]; the angles are computed once for both.
  static void RotateQk(float* q, int q_heads, float* k, int k_heads, int head_dim, int rotary_dim,
                       const float* inv_freq, int32_t position) {
    const int half = rotary_dim / 2;
    thread_local std::vector<float> cos_v, sin_v;
    cos_v.resize(half);
    sin_v.resize(half);
    const float pos = static_cast<float>(position);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cos_v[i] = std::cos(angle);
      sin_v[i] = std::sin(angle);
    }
    auto rotate = [&](float* x, int heads) {
      for (int h = 0; h < heads; ++h) {
        float* v = x + static_cast<int64_t>(h) * head_dim;
        for (int i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cos_v[i] - b * sin_v[i];
          v[i + half] = b * cos_v[i] + a * sin_v[i];
        }
      }
    };
    rotate(q, q_heads);
    rotate(k, k_heads);
  }

  // `parts` stacked by rows and packed in `format` (the policy's group for int4).
  absl::StatusOr<std::unique_ptr<DeviceWeight>> Pack(const std::vector<core::TensorView>& parts,
                                                     experts::ExpertFormat format) {
    int64_t rows = 0;
    for (const auto& p : parts) {
      if (p.rank() != 2 || p.shape[1] != parts[0].shape[1]) {
        return absl::InvalidArgumentError("packed weights must be 2-D parts with the same number of columns");
      }
      rows += p.shape[0];
    }
    const int64_t cols = parts[0].shape[1];
    MOE_ASSIGN_OR_RETURN(const experts::MatrixLayout layout, experts::MakeLayout(format, rows, cols, policy_.group));
    MOE_ASSIGN_OR_RETURN(auto data, core::AlignedBuffer::Allocate(layout.bytes()));
    experts::PackRows(
        layout,
        [&](int64_t r, float* dst) {
          for (const auto& p : parts) {
            if (r < p.shape[0]) {
              core::ConvertToFloat(static_cast<const char*>(p.data) + r * cols * core::DTypeSize(p.dtype), p.dtype, dst,
                                   cols);
              return;
            }
            r -= p.shape[0];
          }
        },
        data.as<uint8_t>());
    return std::unique_ptr<DeviceWeight>(CpuWeight::Packed(core::Shape{rows, cols}, layout, std::move(data)));
  }

  // out [rows x n] = x [rows x k] . W^T (+ bias) through the expert pool's kernels: the
  // activations quantized once, 16-row blocks of W split over the threads.
  void PackedLinear(const experts::PackedMatrix& w, const float* x, int64_t rows, int64_t k, int64_t n,
                    const float* bias, float* out) {
    const experts::ExpertFormat f = w.layout.format;
    const core::CpuFeatures& cpu = core::GetCpuFeatures();
    auto usable = [&](experts::KernelKind kind) { return experts::KernelUnsupportedReason(kind, f, cpu).empty(); };
    // The fastest kernel that exists for the format and runs here (GGUF formats have no AMX one).
    auto exists = [&](experts::KernelKind kind) { return experts::GetKernel(kind, f) != nullptr && usable(kind); };
    const experts::KernelKind kind = rows >= 16 && exists(experts::KernelKind::kAmx) ? experts::KernelKind::kAmx
                                     : exists(experts::KernelKind::kVnni)            ? experts::KernelKind::kVnni
                                     : exists(experts::KernelKind::kAvx512Bf16)      ? experts::KernelKind::kAvx512Bf16
                                                                                     : experts::KernelKind::kPortable;
    // GGUF blocks group their scales by 16 or 32 columns; their kernels read sums per 16.
    const int sum_group = w.layout.gguf_type >= 0                  ? 16
                          : f == experts::ExpertFormat::kInt4 ? w.layout.group
                                                              : static_cast<int>(w.layout.k_pad);
    experts::Activations act;
    if (!act.Prepare(x, rows, k, w.layout.k_pad, kind, f, sum_group).ok()) {
      std::fill(out, out + rows * n, std::numeric_limits<float>::quiet_NaN());  // loud rather than wrong
      return;
    }
    const experts::MatmulKernel kernel = experts::GetKernel(kind, f);
    const int64_t blocks = w.layout.blocks();
    const int64_t grain = std::max<int64_t>(1, blocks / (4 * threads()));
    ParallelFor(blocks, grain, [&](int64_t begin, int64_t end) {
      (void)experts::PrepareThreadForKernel(kind);
      const int64_t ld = (end - begin) * 16;
      thread_local std::vector<float> y;
      if (y.size() < static_cast<size_t>(act.m_pad() * ld)) y.resize(act.m_pad() * ld);
      kernel(w, act, begin, end, y.data(), ld);
      const int64_t c0 = begin * 16, c1 = std::min(n, end * 16);
      for (int64_t t = 0; t < rows; ++t) {
        for (int64_t c = c0; c < c1; ++c) out[t * n + c] = y[t * ld + (c - c0)] + (bias != nullptr ? bias[c] : 0.0f);
      }
    });
  }

  // `parts` stacked into one owned copy: bf16 matrices stay bf16 unless `f32` (a kVector use, such
  // as MLA's kv_b_proj, which the backend reads as floats); everything else becomes f32.
  absl::StatusOr<std::unique_ptr<DeviceWeight>> Fused(const std::vector<core::TensorView>& parts, bool f32 = false) {
    bool all_bf16 = true;
    int64_t rows = 0, numel = 0;
    for (const auto& p : parts) {
      all_bf16 = all_bf16 && p.dtype == DType::kBF16;
      rows += p.shape[0];
      numel += p.numel();
    }
    const bool vector = parts[0].rank() == 1;
    const DType dtype = all_bf16 && !vector && !f32 ? DType::kBF16 : DType::kF32;
    MOE_ASSIGN_OR_RETURN(auto owned, core::AlignedBuffer::Allocate(numel * core::DTypeSize(dtype)));
    int64_t at = 0;
    for (const auto& p : parts) {
      if (dtype == DType::kBF16) {
        std::memcpy(owned.as<uint16_t>() + at, p.data, p.bytes());
      } else {
        core::ConvertToFloat(p.data, p.dtype, owned.as<float>() + at, p.numel());
      }
      at += p.numel();
    }
    core::Shape shape = vector ? core::Shape{rows} : core::Shape{rows, parts[0].shape[1]};
    return std::unique_ptr<DeviceWeight>(new CpuWeight(std::move(shape), dtype, nullptr, std::move(owned)));
  }

  int threads() const { return host_threads_ != nullptr ? host_threads_->size() : arena_.max_concurrency(); }

  // body(begin, end) over ranges of at least `grain` that cover [0, n), on the lent threads or the
  // backend's own arena. Which thread runs which range is not fixed, so no result may depend on it.
  void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body) {
    if (host_threads_ != nullptr) {
      host_threads_->ParallelFor(n, grain, body);
      return;
    }
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, std::max<int64_t>(grain, 1)),
                        [&](const tbb::blocked_range<int64_t>& r) { body(r.begin(), r.end()); });
    });
  }
  template <typename F>
  void For(int64_t n, F&& f) {
    ParallelFor(n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) f(i);
    });
  }

  tbb::task_arena arena_;
  experts::HostThreads* host_threads_ = nullptr;  // lent by the expert pool, or null: arena_
  const WeightPolicy policy_;
  const internal::AttentionIsa attention_isa_ = internal::BestAttentionIsa();
  internal::AttentionScratch attention_scratch_;
  // MLA's absorbed queries and latent outputs, [rows x heads x (kv_lora + rope)], grown to the largest step.
  std::vector<float> mla_queries_, mla_outputs_;
};

}  // namespace

std::unique_ptr<Backend> CreateCpuBackend(int threads, const WeightPolicy& policy) {
  if (threads <= 0) threads = tbb::info::default_concurrency();
  return std::make_unique<CpuBackend>(threads, policy);
}

}  // namespace moe::runtime
