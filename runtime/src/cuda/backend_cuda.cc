#include "moe/runtime/backend_cuda.h"

#include <cuda_runtime.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cuda/cuda_status.h"
#include "cuda/gather.h"
#include "cuda/op_timer.h"
#include "cuda/ops.h"
#include "cuda/routing.h"
#include "cuda/streamed_layout.h"
#include "moe/comm/communicator.h"
#include "moe/core/dtype.h"
#include "moe/core/logging.h"
#include "moe/core/status.h"

namespace moe::runtime {
namespace {

using core::DType;

constexpr int64_t kLinearWorkspaceBytes = 32 << 20;
constexpr int64_t kStagingBytes = 64 << 20;  // each of the two pinned load buffers

std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1 << 30)); }

// cudaMalloc'd memory, freed on destruction.
class CudaBuffer : public DeviceBuffer {
 public:
  CudaBuffer(void* data, DType dtype, int64_t rows, int64_t cols)
      : data_(data), dtype_(dtype), rows_(rows), cols_(cols) {}
  ~CudaBuffer() override { cudaFree(data_); }
  Tensor tensor() const override { return Tensor{data_, dtype_, rows_, cols_}; }

 private:
  void* data_;
  DType dtype_;
  int64_t rows_, cols_;
};

class PinnedBuffer : public HostBuffer {
 public:
  PinnedBuffer(void* data, int64_t bytes) : data_(data), bytes_(bytes) {}
  ~PinnedBuffer() override { cudaFreeHost(data_); }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* data_;
  int64_t bytes_;
};

class CudaEvent : public Event {
 public:
  CudaEvent(cudaEvent_t event, cudaStream_t stream) : event_(event), stream_(stream) {}
  ~CudaEvent() override { cudaEventDestroy(event_); }
  void Record() override { cudaEventRecord(event_, stream_); }
  absl::Status Wait() override {
    MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    return absl::OkStatus();
  }

 private:
  cudaEvent_t event_;
  cudaStream_t stream_;
};

// A weight in device memory: bf16 matrices, fp32 vectors.
// A matrix whose rows are not a multiple of 8 (a router of 60 experts, a shared expert's gate)
// is stored with zero rows up to the next multiple, which cuBLASLt needs; its Linear writes the
// padded width to scratch and keeps the real columns.
int64_t PaddedRows(int64_t rows) { return (rows + 7) / 8 * 8; }

class CudaWeight : public DeviceWeight {
 public:
  CudaWeight(std::unique_ptr<DeviceBuffer> buffer, core::Shape shape) : buffer_(std::move(buffer)) {
    shape_ = std::move(shape);
  }
  bool padded() const { return shape_.size() == 2 && shape_[0] % 8 != 0; }
  int64_t bytes() const override { return buffer_->tensor().bytes(); }
  const void* data() const { return buffer_->tensor().data; }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data());
  }

 private:
  std::unique_ptr<DeviceBuffer> buffer_;
};

const CudaWeight& AsCuda(const DeviceWeight& w) { return static_cast<const CudaWeight&>(w); }

class CudaExpertWeights : public BackendExpertWeights {
 public:
  int64_t bytes() const override { return gate_up->tensor().bytes() + down->tensor().bytes(); }
  std::unique_ptr<DeviceBuffer> gate_up, down;
  cuda::ExpertWeights weights;
};

// Calls whose errors must be kept for Synchronize: the first one is the step's error.
#define MOE_CUDA_KEEP(call) Keep((call), #call)

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {}
  ~CudaBackend() override {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (host_stream_ != nullptr) cudaStreamSynchronize(host_stream_);
    if (host_thread_.joinable()) {
      host_stop_.store(true);
      host_thread_.join();
    }
    if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
    ReleaseHostExperts();
    for (int i = 0; i < 2; ++i) {
      if (staged_[i] != nullptr) cudaEventDestroy(staged_[i]);
      if (staging_free_[i] != nullptr) cudaEventDestroy(staging_free_[i]);
    }
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    for (auto& [key, graph] : graphs_) cudaGraphExecDestroy(graph.exec);
    for (cudaEvent_t e : {host_fork_, host_join_, host_step_done_}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (host_stream_ != nullptr) cudaStreamDestroy(host_stream_);
    delete linear_;
    if (linear_workspace_ != nullptr) cudaFree(linear_workspace_);
    for (int i = 0; i < 2; ++i) {
      if (staging_[i] != nullptr) cudaFreeHost(staging_[i]);
      if (staging_done_[i] != nullptr) cudaEventDestroy(staging_done_[i]);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    MOE_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));  // starts the context now, not in the first step
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&linear_workspace_, kLinearWorkspaceBytes));
    MOE_RETURN_IF_ERROR(cuda::Linear::Create(linear_workspace_, kLinearWorkspaceBytes, &linear_));
    for (int i = 0; i < 2; ++i) {
      MOE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&staging_[i], kStagingBytes, cudaHostAllocDefault));
      MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&staging_done_[i], cudaEventDisableTiming));
    }
    name_ = absl::StrCat("cuda:", device_, " (", CudaBackendDeviceName(device_), ")");
    return absl::OkStatus();
  }

  std::string name() const override { return name_; }
  DType activation_dtype() const override { return DType::kBF16; }
  bool SupportsKvDtype(DType dtype) const override { return dtype == DType::kBF16 || dtype == DType::kF8E4M3; }
  bool SupportsGraphs() const override { return true; }

  // ---- Memory ----
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(DType dtype, int64_t rows, int64_t cols) override {
    const int64_t bytes = std::max<int64_t>(rows * cols * core::DTypeSize(dtype), 1);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      return absl::ResourceExhaustedError(absl::StrCat("out of GPU memory on ", name_, ": ", GiB(bytes), " needed, ",
                                                       GiB(free), " free of ", GiB(total)));
    }
    return std::unique_ptr<DeviceBuffer>(new CudaBuffer(p, dtype, rows, cols));
  }

  absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(int64_t bytes) override {
    void* p = nullptr;
    MOE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, std::max<int64_t>(bytes, 1), cudaHostAllocDefault));
    return std::unique_ptr<HostBuffer>(new PinnedBuffer(p, bytes));
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    cudaEvent_t e;
    MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return std::unique_ptr<Event>(new CudaEvent(e, stream_));
  }

  int64_t FreeMemoryBytes() const override {
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return static_cast<int64_t>(free);
  }

  // Matrices, routers and embeddings in bf16, vectors in fp32, whatever the role.
  const WeightPolicy& weight_policy() const override { return policy_; }

  absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareWeight(const core::TensorView& host, WeightUse use,
                                                              TensorRole role = TensorRole::kOther) override {
    return PrepareFusedWeight({host}, use, role);
  }

  absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareFusedWeight(const std::vector<core::TensorView>& parts,
                                                                   WeightUse use,
                                                                   TensorRole role = TensorRole::kOther) override {
    const DType dtype = use == WeightUse::kVector ? DType::kF32 : DType::kBF16;
    int64_t rows = 0;
    for (const auto& p : parts) {
      if (p.rank() < 1 || p.rank() > 2) {
        return absl::InvalidArgumentError(absl::StrCat("weights must be 1-D or 2-D, got ", core::ShapeString(p.shape)));
      }
      if (p.dtype != DType::kBF16 && p.dtype != DType::kF16 && p.dtype != DType::kF32) {
        return absl::InvalidArgumentError(
            absl::StrCat("dtype ", core::DTypeName(p.dtype), " is not a weight type (BF16, F16, F32)"));
      }
      rows += p.shape[0];
    }
    const bool vector = parts[0].rank() == 1;
    const int64_t cols = vector ? 1 : parts[0].shape[1];
    const int64_t stored_rows = vector ? rows : PaddedRows(rows);
    MOE_ASSIGN_OR_RETURN(auto buffer, Allocate(dtype, stored_rows, cols));
    char* dst = static_cast<char*>(buffer->tensor().data);
    if (stored_rows != rows) {
      const int64_t row_bytes = cols * core::DTypeSize(dtype);
      MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst + rows * row_bytes, 0, (stored_rows - rows) * row_bytes, stream_));
      max_padded_rows_ = std::max(max_padded_rows_, stored_rows);
    }
    for (const auto& p : parts) {
      MOE_RETURN_IF_ERROR(Upload(p, dtype, dst));
      dst += p.numel() * core::DTypeSize(dtype);
    }
    core::Shape shape = vector ? core::Shape{rows} : core::Shape{rows, cols};
    return std::unique_ptr<DeviceWeight>(new CudaWeight(std::move(buffer), std::move(shape)));
  }

  absl::StatusOr<std::unique_ptr<BackendExpertWeights>> PrepareExperts(
      const std::vector<core::TensorView>& gate, const std::vector<core::TensorView>& up,
      const std::vector<core::TensorView>& down) override {
    const int e = static_cast<int>(gate.size());
    const int64_t width = gate[0].shape[0], hidden = gate[0].shape[1];
    auto experts = std::make_unique<CudaExpertWeights>();
    MOE_ASSIGN_OR_RETURN(experts->gate_up, Allocate(DType::kBF16, e * 2 * width, hidden));
    MOE_ASSIGN_OR_RETURN(experts->down, Allocate(DType::kBF16, e * hidden, width));
    char* gu = static_cast<char*>(experts->gate_up->tensor().data);
    char* dn = static_cast<char*>(experts->down->tensor().data);
    const int64_t part = width * hidden * 2;
    for (int i = 0; i < e; ++i) {
      MOE_RETURN_IF_ERROR(Upload(gate[i], DType::kBF16, gu + (2 * i) * part));
      MOE_RETURN_IF_ERROR(Upload(up[i], DType::kBF16, gu + (2 * i + 1) * part));
      MOE_RETURN_IF_ERROR(Upload(down[i], DType::kBF16, dn + i * part));
    }
    experts->weights.gate_up = static_cast<const uint16_t*>(experts->gate_up->tensor().data);
    experts->weights.down = static_cast<const uint16_t*>(experts->down->tensor().data);
    experts->weights.num_experts = e;
    experts->weights.hidden = static_cast<int>(hidden);
    experts->weights.intermediate = static_cast<int>(width);
    return std::unique_ptr<BackendExpertWeights>(std::move(experts));
  }

  // Grows what an earlier call reserved to the larger of both (a draft model beside its target):
  // the scratch is shared by every context, and recorded graphs hold its addresses.
  absl::Status ReserveScratch(const StepLimits& asked) override {
    StepLimits l = asked;
    if (scratch_reserved_) {
      const StepLimits& r = reserved_;
      const bool fits = l.max_tokens <= r.max_tokens && l.max_logit_rows <= r.max_logit_rows &&
                        l.max_context <= r.max_context && l.num_heads <= r.num_heads && l.head_dim <= r.head_dim &&
                        l.vocab <= r.vocab && l.hidden <= r.hidden && l.num_experts <= r.num_experts &&
                        l.top_k <= r.top_k && l.moe_intermediate <= r.moe_intermediate &&
                        l.max_bias_width <= r.max_bias_width && (!l.host_experts || r.host_experts);
      if (fits) return absl::OkStatus();
      MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      ClearGraphs();
      l.max_tokens = std::max(l.max_tokens, r.max_tokens);
      l.max_logit_rows = std::max(l.max_logit_rows, r.max_logit_rows);
      l.max_context = std::max(l.max_context, r.max_context);
      l.num_heads = std::max(l.num_heads, r.num_heads);
      l.head_dim = std::max(l.head_dim, r.head_dim);
      l.vocab = std::max(l.vocab, r.vocab);
      l.hidden = std::max(l.hidden, r.hidden);
      l.num_experts = std::max(l.num_experts, r.num_experts);
      l.top_k = std::max(l.top_k, r.top_k);
      l.moe_intermediate = std::max(l.moe_intermediate, r.moe_intermediate);
      l.max_bias_width = std::max(l.max_bias_width, r.max_bias_width);
      l.host_experts = l.host_experts || r.host_experts;
    }
    reserved_ = l;
    scratch_reserved_ = true;
    const int64_t attention = cuda::AttentionWorkspaceFloats(l.max_tokens, l.max_context, l.num_heads, l.head_dim);
    MOE_ASSIGN_OR_RETURN(attention_ws_, Allocate(DType::kF32, 1, std::max<int64_t>(attention, 1)));
    if (l.num_experts > 0) {
      const int64_t moe = cuda::MoeWorkspaceBytes(l.max_tokens, l.top_k, l.num_experts, l.hidden, l.moe_intermediate);
      MOE_ASSIGN_OR_RETURN(moe_ws_, Allocate(DType::kI8, 1, std::max<int64_t>(moe, 1)));
    }
    max_logit_rows_ = l.max_logit_rows;
    const int64_t sampling = cuda::SamplingWorkspaceBytes(l.max_logit_rows, l.vocab);
    MOE_ASSIGN_OR_RETURN(sampling_ws_, Allocate(DType::kI8, 1, std::max<int64_t>(sampling, 1)));
    vocab_ = l.vocab;
    // Parameters, penalty history and results of a step's rows: one pinned area mirrored on the
    // device, so a step's sampling is one copy in and one copy out.
    const int64_t rows = l.max_logit_rows;
    history_capacity_ = std::max<int64_t>(int64_t{1} << 20, 4 * int64_t{l.max_context});
    sample_bytes_ =
        rows * sizeof(cuda::SampleParamsGpu) + history_capacity_ * 4 + rows * (4 + 4 + 4 + 2 * cuda::kMaxLogprobs * 4);
    MOE_ASSIGN_OR_RETURN(sample_host_, AllocateHost(sample_bytes_));
    MOE_ASSIGN_OR_RETURN(sample_dev_, Allocate(DType::kI8, 1, sample_bytes_));
    if (l.max_bias_width > 0 || max_padded_rows_ > 0) {
      const int64_t width = std::max<int64_t>(l.max_bias_width, max_padded_rows_);
      MOE_ASSIGN_OR_RETURN(bias_out_, Allocate(DType::kF32, l.max_tokens, width));
    }
    if (l.host_experts) MOE_RETURN_IF_ERROR(ReserveHostExperts(l));
    return absl::OkStatus();
  }

  absl::StatusOr<Roofline> MeasureRoofline(int64_t bytes) override {
    Roofline r;
    MOE_ASSIGN_OR_RETURN(auto a, Allocate(DType::kI8, 1, bytes));
    MOE_ASSIGN_OR_RETURN(auto b, Allocate(DType::kI8, 1, bytes));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a->tensor().data, 1, bytes, stream_));
    cudaEvent_t start, stop;
    MOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
    MOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
    auto time = [&](auto&& work, int reps) -> absl::StatusOr<double> {
      work();  // warm-up
      MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream_));
      for (int i = 0; i < reps; ++i) work();
      MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream_));
      MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
      float ms = 0;
      MOE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
      return ms / 1e3 / reps;
    };
    auto copy = time(
        [&] { cudaMemcpyAsync(b->tensor().data, a->tensor().data, bytes, cudaMemcpyDeviceToDevice, stream_); }, 10);
    if (!copy.ok()) return copy.status();
    r.memory_gbps = 2.0 * bytes / *copy / 1e9;
    r.memory_what = absl::StrFormat("device-to-device copy of %.1f GiB, bytes read + written", bytes / double(1 << 30));
    // bf16 GEMM 8192^3 through the same Linear the model uses, on non-zero data.
    const int n = 8192;
    MOE_ASSIGN_OR_RETURN(auto x, Allocate(DType::kBF16, n, n));
    MOE_ASSIGN_OR_RETURN(auto w, Allocate(DType::kBF16, n, n));
    MOE_ASSIGN_OR_RETURN(auto y, Allocate(DType::kBF16, n, n));
    {
      // Random operands: constant or zero data runs faster than real weights do.
      std::vector<uint16_t> host(int64_t{n} * n);
      uint32_t state = 12345;
      for (uint16_t& v : host) {
        state = state * 1664525u + 1013904223u;
        v = core::FloatToBf16((static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 0.1f);
      }
      const core::TensorView view{host.data(), DType::kBF16, {n, n}};
      MOE_RETURN_IF_ERROR(Upload(view, DType::kBF16, static_cast<char*>(x->tensor().data)));
      MOE_RETURN_IF_ERROR(Upload(view, DType::kBF16, static_cast<char*>(w->tensor().data)));
    }
    absl::Status gemm_status;
    auto gemm = time(
        [&] {
          absl::Status s = linear_->Run(x->tensor().as<uint16_t>(), n, w->tensor().as<uint16_t>(), n, n, nullptr,
                                        y->tensor().data, false, stream_);
          if (!s.ok()) gemm_status = s;
        },
        10);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (!gemm.ok()) return gemm.status();
    MOE_RETURN_IF_ERROR(gemm_status);
    r.matmul_tflops = 2.0 * n * n * double(n) / *gemm / 1e12;
    r.matmul_what = "bf16 GEMM 8192^3 (cuBLASLt)";
    return r;
  }

  absl::Status SampleRows(const Tensor& logits, const std::vector<SampleInput>& in,
                          std::vector<SampleOutput>* out) override {
    const int rows = static_cast<int>(in.size());
    if (rows == 0) {
      out->clear();
      return absl::OkStatus();
    }
    if (rows > max_logit_rows_ || logits.cols != vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("sampling ", rows, " rows of ", logits.cols,
                                                     " logits; the backend was set up for ", max_logit_rows_, " of ",
                                                     vocab_));
    }
    // Layout: params [R], history [capacity], tokens [R], non-finite [R], logprob [R], top ids
    // [R x 20], top logprobs [R x 20].
    char* host = sample_host_->as<char>();
    auto* params = reinterpret_cast<cuda::SampleParamsGpu*>(host);
    int32_t* history = reinterpret_cast<int32_t*>(host + rows * sizeof(cuda::SampleParamsGpu));
    int64_t used = 0;
    bool any_logprobs = false;
    for (int r = 0; r < rows; ++r) {
      const SampleInput& row = in[r];
      const SamplingParams& p = *row.params;
      cuda::SampleParamsGpu& g = params[r];
      g.temperature = p.temperature;
      g.top_k = p.top_k;
      g.top_p = p.top_p;
      g.min_p = p.min_p;
      g.repetition_penalty = p.repetition_penalty;
      g.presence_penalty = p.presence_penalty;
      g.frequency_penalty = p.frequency_penalty;
      g.seed_lo = static_cast<uint32_t>(row.key.seed);
      g.seed_hi = static_cast<uint32_t>(row.key.seed >> 32);
      g.position = static_cast<int32_t>(row.key.position);
      g.sequence = static_cast<int32_t>(row.key.sequence);
      g.history_start = static_cast<int32_t>(used);
      g.prompt_len = 0;
      g.output_len = 0;
      g.logprobs = std::min(row.logprobs, cuda::kMaxLogprobs);
      any_logprobs = any_logprobs || row.logprobs > 0;
      if (p.penalized() && row.history != nullptr) {
        const int64_t n = static_cast<int64_t>(row.history->size());
        if (used + n > history_capacity_) {
          return absl::ResourceExhaustedError(
              absl::StrCat("the step's penalty history of more than ", history_capacity_, " tokens"));
        }
        std::memcpy(history + used, row.history->data(), n * 4);
        g.prompt_len = row.prompt_len;
        g.output_len = static_cast<int32_t>(n) - row.prompt_len;
        used += n;
      }
    }
    const int64_t in_bytes = rows * sizeof(cuda::SampleParamsGpu) + history_capacity_ * 4;
    char* dev = static_cast<char*>(sample_dev_->tensor().data);
    const int64_t head = rows * sizeof(cuda::SampleParamsGpu);
    MOE_CUDA_KEEP(cudaMemcpyAsync(dev, host, head, cudaMemcpyHostToDevice, stream_));
    if (used > 0) MOE_CUDA_KEEP(cudaMemcpyAsync(dev + head, history, used * 4, cudaMemcpyHostToDevice, stream_));
    int32_t* tokens = reinterpret_cast<int32_t*>(dev + in_bytes);
    int32_t* non_finite = tokens + rows;
    float* logprob = reinterpret_cast<float*>(non_finite + rows);
    int32_t* top_ids = reinterpret_cast<int32_t*>(logprob + rows);
    float* top_lp = reinterpret_cast<float*>(top_ids + rows * cuda::kMaxLogprobs);
    // The check reads the logits before the penalties change them.
    Begin("FirstNonFinite");
    cuda::FirstNonFinite(logits.as<float>(), rows, logits.cols, non_finite, stream_);
    Launched("FirstNonFinite");
    Begin("SampleRows");
    cuda::SampleRows(logits.as<float>(), rows, static_cast<int>(logits.cols),
                     reinterpret_cast<const cuda::SampleParamsGpu*>(dev), reinterpret_cast<const int32_t*>(dev + head),
                     sampling_ws_->tensor().data, tokens, any_logprobs ? logprob : nullptr,
                     any_logprobs ? top_ids : nullptr, any_logprobs ? top_lp : nullptr, stream_);
    Launched("SampleRows");
    const int64_t out_bytes = rows * (4 + 4 + 4 + 2 * cuda::kMaxLogprobs * 4);
    char* host_out = host + in_bytes;
    MOE_CUDA_KEEP(cudaMemcpyAsync(host_out, tokens, out_bytes, cudaMemcpyDeviceToHost, stream_));
    MOE_RETURN_IF_ERROR(Synchronize());
    const int32_t* h_tokens = reinterpret_cast<const int32_t*>(host_out);
    const int32_t* h_bad = h_tokens + rows;
    const float* h_lp = reinterpret_cast<const float*>(h_bad + rows);
    const int32_t* h_top = reinterpret_cast<const int32_t*>(h_lp + rows);
    const float* h_top_lp = reinterpret_cast<const float*>(h_top + rows * cuda::kMaxLogprobs);
    out->assign(rows, SampleOutput{});
    for (int r = 0; r < rows; ++r) {
      SampleOutput& o = (*out)[r];
      o.token = h_tokens[r];
      o.non_finite_at = h_bad[r];
      if (in[r].logprobs > 0) {
        o.logprob = h_lp[r];
        for (int j = 0; j < std::min(in[r].logprobs, cuda::kMaxLogprobs); ++j) {
          o.top.emplace_back(h_top[r * cuda::kMaxLogprobs + j], h_top_lp[r * cuda::kMaxLogprobs + j]);
        }
      }
    }
    return absl::OkStatus();
  }

  // ---- A step ----
  void CopyToHost(const Tensor& src, void* dst) override {
    Begin("copy to host");
    MOE_CUDA_KEEP(cudaMemcpyAsync(dst, src.data, src.bytes(), cudaMemcpyDeviceToHost, stream_));
    Ended();
  }
  void CopyFromHost(const void* src, const Tensor& dst) override {
    Begin("copy from host");
    MOE_CUDA_KEEP(cudaMemcpyAsync(dst.data, src, dst.bytes(), cudaMemcpyHostToDevice, stream_));
    Ended();
  }

  absl::Status Synchronize() override {
    step_held_ = false;
    if (!lost_.ok()) return lost_;
    if (host_stream_ != nullptr) {
      // With the pool's threads on every core but one, this thread sleeps rather than spin on a
      // core they need: a blocking-sync event wakes it when the step ends.
      Keep(cudaEventRecord(host_step_done_, stream_), "the step's end (cudaEventRecord)");
      Keep(cudaEventSynchronize(host_step_done_), "the step's kernels (cudaEventSynchronize)");
    }
    Keep(cudaStreamSynchronize(stream_), "the step's kernels (cudaStreamSynchronize)");
    if (host_stream_ != nullptr) {
      Keep(cudaStreamSynchronize(host_stream_), "the host experts' copies (cudaStreamSynchronize)");
      eager_host_calls_.clear();  // every call queued eagerly has run
      host_in_flight_ = false;
      streaming_in_flight_ = false;
      std::lock_guard<std::mutex> lock(host_mu_);
      if (!host_error_.ok() && pending_.ok()) pending_ = host_error_;
      host_error_ = absl::OkStatus();
    }
    absl::Status s = std::move(pending_);
    pending_ = absl::OkStatus();
    if (!s.ok()) staged_layer_[0] = staged_layer_[1] = -1;  // a staged copy may not have happened
    return s;
  }

  void ClearGraphs() override {
    if (graphs_.empty()) return;
    cudaStreamSynchronize(stream_);  // a replay in flight keeps its graph until it ends
    for (auto& [key, graph] : graphs_) cudaGraphExecDestroy(graph.exec);
    graphs_.clear();
  }

  void ClearContextGraphs(uint64_t context_id) override {
    auto first = graphs_.lower_bound(GraphKey{context_id, 0});
    if (first == graphs_.end() || first->first.first != context_id) return;
    cudaStreamSynchronize(stream_);
    while (first != graphs_.end() && first->first.first == context_id) {
      cudaGraphExecDestroy(first->second.exec);
      first = graphs_.erase(first);
    }
  }

  // ---- Hybrid execution: a layer's routed experts on the host ----
  // On a stream of its own, forked from the main one and joined back by FinishHostExperts: the
  // inputs packed into mapped pinned memory (one kernel), a host function that runs the experts
  // there, and the sum copied back; the main stream runs the shared experts meanwhile. Each call's
  // parameters live in a HostCall that the host function reads: eager calls are freed at the next
  // Synchronize, recorded ones with their graph.
  absl::Status StartHostExperts(HostExpertCompute& host, int layer, int pool_layer, const Tensor& x, const Tensor& ids,
                                const Tensor& weights, const Tensor& out) override {
    if (host_stream_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("routed experts on the host on ", name_,
                                                        ": no host buffers; ReserveScratch was not told of them"));
    }
    if (host_in_flight_) return absl::FailedPreconditionError("a host experts call is already in flight");
    if (x.rows > host_rows_ || ids.cols != host_top_k_ || x.cols != host_hidden_ || x.dtype != DType::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat("routed experts on the host: [", x.rows, " x ", x.cols,
                                                     "] tokens with top-", ids.cols, "; the buffers hold [", host_rows_,
                                                     " x ", host_hidden_, "] with top-", host_top_k_));
    }
    // A long chunk (not a graph's step): the layer's experts come over PCIe and run here.
    if (stream_tokens_ > 0 && x.rows >= stream_tokens_ && !in_graph_ && pool_layer >= 0 &&
        pool_layer < streamed_.num_layers) {
      StreamLayer(pool_layer, x, ids, weights, out);
      host_in_flight_ = true;
      streaming_in_flight_ = true;
      return absl::OkStatus();
    }
    MOE_CUDA_KEEP(cudaEventRecord(host_fork_, stream_));
    MOE_CUDA_KEEP(cudaStreamWaitEvent(host_stream_, host_fork_, 0));
    cuda::PackHostExpertInputs(x.as<uint16_t>(), static_cast<int>(x.rows), static_cast<int>(x.cols), ids.as<int32_t>(),
                               weights.as<float>(), static_cast<int>(ids.cols), host_x_dev_, host_ids_dev_,
                               host_weights_dev_, host_stream_);
    Launched("PackHostExpertInputs");
    if (handoff_ == HostHandoff::kMappedFlags) {
      polled_host_.store(&host);
      cuda::PostHostRequest(host_counter_, mailbox_dev_, layer, x.rows, host_stream_);
      Launched("PostHostRequest");
      cuda::WaitHostDone(host_counter_, mailbox_dev_, host_stream_);
      Launched("WaitHostDone");
    } else {
      auto call = std::make_unique<HostCall>(HostCall{this, &host, layer, x.rows});
      MOE_CUDA_KEEP(cudaLaunchHostFunc(host_stream_, &CudaBackend::RunHostCall, call.get()));
      (capturing_ ? captured_host_calls_ : eager_host_calls_).push_back(std::move(call));
    }
    MOE_CUDA_KEEP(
        cudaMemcpyAsync(out.data, host_out_, x.rows * x.cols * sizeof(float), cudaMemcpyHostToDevice, host_stream_));
    MOE_CUDA_KEEP(cudaEventRecord(host_join_, host_stream_));
    host_in_flight_ = true;
    return absl::OkStatus();
  }

  absl::Status SetHostHandoff(HostHandoff handoff) override {
    if (host_stream_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(name_, " reserved no host buffers for routed experts"));
    }
    if (handoff != handoff_) {
      ClearGraphs();  // they hold the other hand-off's nodes
      MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(host_stream_));
      handoff_ = handoff;
    }
    return absl::OkStatus();
  }
  HostHandoff host_handoff() const override { return handoff_; }

  absl::Status FinishHostExperts() override {
    if (!host_in_flight_) return absl::FailedPreconditionError("FinishHostExperts without StartHostExperts");
    host_in_flight_ = false;
    if (streaming_in_flight_) {  // computed on the stream itself
      streaming_in_flight_ = false;
      return absl::OkStatus();
    }
    MOE_CUDA_KEEP(cudaStreamWaitEvent(stream_, host_join_, 0));
    return absl::OkStatus();
  }

  absl::Status SetStreamedExperts(const StreamedExpertArena& e) override {
    if (streamed_.data != nullptr) return absl::FailedPreconditionError("streamed experts are already set");
    const int64_t h = e.down.n, inter = e.intermediate;
    if (inter % 16 != 0 || e.gate_up.n != 2 * inter || e.gate_up.k != h || e.down.k != inter ||
        int64_t{e.num_layers} * e.num_experts * e.expert_bytes > e.bytes) {
      return absl::FailedPreconditionError(absl::StrCat("streaming experts of intermediate size ", inter,
                                                        " (a multiple of 16 is needed) or a layout that does not "
                                                        "match: not supported"));
    }
    // Page-locked, so that the copies run at the link's speed without staging; read-only where the
    // GPU allows it (a process attached to a shared arena maps it read-only).
    int read_only = 0;
    if (cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, device_) != cudaSuccess) {
      (void)cudaGetLastError();
      read_only = 0;
    }
    const cudaError_t registered = cudaHostRegister(const_cast<uint8_t*>(e.data), e.bytes,
                                                    read_only ? cudaHostRegisterReadOnly : cudaHostRegisterDefault);
    if (registered != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("the expert arena cannot be page-locked for streaming (", cudaGetErrorName(registered), ")"));
    }
    registered_ = e.data;
    const int64_t layer_bytes = int64_t{e.num_experts} * e.expert_bytes;
    for (int i = 0; i < 2; ++i) {
      MOE_ASSIGN_OR_RETURN(staging_layer_[i], Allocate(DType::kI8, 1, layer_bytes));
    }
    MOE_ASSIGN_OR_RETURN(streamed_gate_up_, Allocate(DType::kBF16, int64_t{e.num_experts} * 2 * inter, h));
    MOE_ASSIGN_OR_RETURN(streamed_down_, Allocate(DType::kBF16, int64_t{e.num_experts} * h, inter));
    if (copy_stream_ == nullptr) {
      MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
      for (int i = 0; i < 2; ++i) {
        MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&staged_[i], cudaEventDisableTiming));
        MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&staging_free_[i], cudaEventDisableTiming));
      }
    }
    streamed_ = e;
    stream_tokens_ = e.min_tokens;
    return absl::OkStatus();
  }
  void SetStreamTokens(int min_tokens) override { stream_tokens_ = streamed_.data != nullptr ? min_tokens : 0; }

  void ReleaseHostExperts() override {
    if (host_stream_ != nullptr) cudaStreamSynchronize(host_stream_);
    if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
    if (host_thread_.joinable()) {
      host_stop_.store(true);
      host_thread_.join();
    }
    polled_host_.store(nullptr);
    stream_tokens_ = 0;
    if (registered_ != nullptr) cudaHostUnregister(const_cast<uint8_t*>(registered_));
    registered_ = nullptr;
    streamed_ = StreamedExpertArena{};
    staged_layer_[0] = staged_layer_[1] = -1;
  }
  int64_t streamed_calls() const override { return streamed_calls_; }

  absl::Status RunGraph(uint64_t key, absl::FunctionRef<absl::Status()> body) override {
    // A graph's steps never stream experts: its eager run and its recording take the same path.
    in_graph_ = true;
    const absl::Status s = RunGraphBody(key, body);
    in_graph_ = false;
    return s;
  }

  absl::Status RunGraphBody(uint64_t key, absl::FunctionRef<absl::Status()> body) {
    if (timer_.active()) return body();  // timed op by op
    const GraphKey graph_key{context().id(), key};
    if (auto it = graphs_.find(graph_key); it != graphs_.end()) {
      MOE_CUDA_KEEP(cudaGraphLaunch(it->second.exec, stream_));
      return absl::OkStatus();
    }
    // The first step of a shape runs eagerly (cuBLASLt picks its algorithms, modules load), and
    // is recorded for the next ones.
    MOE_RETURN_IF_ERROR(body());
    cudaGraph_t graph = nullptr;
    // A step that failed in its eager run (pending_ holds why) is not recorded: its graph could
    // miss the operation that failed.
    if (!pending_.ok()) return absl::OkStatus();
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    captured_host_calls_.clear();
    const absl::Status recorded = body();
    capturing_ = false;
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    host_in_flight_ = false;
    std::vector<std::unique_ptr<HostCall>> calls = std::move(captured_host_calls_);
    captured_host_calls_.clear();
    MOE_RETURN_IF_ERROR(recorded);
    MOE_CUDA_RETURN_IF_ERROR(end);
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    MOE_CUDA_RETURN_IF_ERROR(inst);
    if (!pending_.ok()) {  // an operation of the recording failed
      cudaGraphExecDestroy(exec);
      return absl::OkStatus();
    }
    graphs_[graph_key] = Graph{exec, std::move(calls)};
    return absl::OkStatus();
  }

  // ---- Operations ----
  void Embed(const DeviceWeight& table, const StepTensors& step, const Tensor& x) override {
    Begin("Embed");
    cuda::Embed(AsCuda(table).as<uint16_t>(), step.token_ids.as<int32_t>(), step.num_tokens, static_cast<int>(x.cols),
                x.as<float>(), stream_);
    Launched("Embed");
  }

  void AddRmsNorm(const Tensor& x, const Tensor* delta, const DeviceWeight& w, float eps, const Tensor& out) override {
    Begin("AddRmsNorm");
    cuda::AddRmsNorm(x.as<float>(), delta != nullptr ? delta->as<float>() : nullptr, AsCuda(w).as<float>(), eps,
                     static_cast<int>(x.rows), static_cast<int>(x.cols), out.as<uint16_t>(), stream_);
    Launched("AddRmsNorm");
  }

  void Linear(const Tensor& x, const DeviceWeight& w, const DeviceWeight* bias, const Tensor& out) override {
    if (timer_.active()) Begin(absl::StrCat("Linear [", w.rows(), " x ", w.cols(), "]"));
    // A bias with a bf16 output goes through fp32: the bias is added before the one rounding, as
    // the CPU reference does (rounding the product, then the sum, loses up to an ulp of the
    // product where the bias cancels it).
    const CudaWeight& cw = AsCuda(w);
    if (cw.padded()) {
      const int64_t wide = PaddedRows(w.rows());
      if (bias_out_ == nullptr || x.rows * wide > bias_out_->tensor().numel()) {
        if (pending_.ok()) pending_ = absl::FailedPreconditionError("Linear of a padded weight: no scratch reserved");
        return;
      }
      const absl::Status s =
          linear_->Run(x.as<uint16_t>(), static_cast<int>(x.rows), cw.as<uint16_t>(), static_cast<int>(wide),
                       static_cast<int>(w.cols()), nullptr, bias_out_->tensor().data, true, stream_);
      if (!s.ok() && pending_.ok()) pending_ = core::Annotate(s, "Linear");
      cuda::NarrowColumns(bias_out_->tensor().as<float>(), static_cast<int>(x.rows), static_cast<int>(wide),
                          static_cast<int>(w.rows()), bias != nullptr ? AsCuda(*bias).as<float>() : nullptr, out.data,
                          out.dtype == DType::kF32, stream_);
      Launched("Linear");
      return;
    }
    const bool via_f32 = bias != nullptr && out.dtype != DType::kF32 && bias_out_ != nullptr &&
                         out.numel() <= bias_out_->tensor().numel();
    void* target = via_f32 ? bias_out_->tensor().data : out.data;
    const absl::Status s =
        linear_->Run(x.as<uint16_t>(), static_cast<int>(x.rows), AsCuda(w).as<uint16_t>(), static_cast<int>(w.rows()),
                     static_cast<int>(w.cols()), bias != nullptr ? AsCuda(*bias).as<float>() : nullptr, target,
                     via_f32 || out.dtype == DType::kF32, stream_);
    if (!s.ok() && pending_.ok()) pending_ = core::Annotate(s, "Linear");
    if (via_f32) cuda::F32ToBf16(bias_out_->tensor().as<float>(), out.numel(), out.as<uint16_t>(), stream_);
    Launched("Linear");
  }

  void Attention(const AttentionArgs& a, const StepTensors& step) override {
    const cuda::StepMeta meta = Meta(step);
    cuda::KvLayer kv;
    kv.k = a.cache->k(a.layer);
    kv.v = a.cache->v(a.layer);
    kv.k_scale = a.cache->k_scale(a.layer);
    kv.v_scale = a.cache->v_scale(a.layer);
    kv.fp8 = a.cache->dtype() == DType::kF8E4M3;
    kv.block_size = a.cache->shape().block_size;
    kv.kv_heads = a.num_kv_heads;
    kv.head_dim = a.head_dim;
    Begin("QkNormRopeStoreKv");
    cuda::QkNormRopeStoreKv(a.qkv.as<uint16_t>(), meta, a.num_heads, kv,
                            a.q_norm != nullptr ? AsCuda(*a.q_norm).as<float>() : nullptr,
                            a.k_norm != nullptr ? AsCuda(*a.k_norm).as<float>() : nullptr, a.eps, a.rotary_dim,
                            a.inv_freq->as<float>(), a.q.as<uint16_t>(), stream_);
    Launched("QkNormRopeStoreKv");
    if (!HasScratch(attention_ws_, "PagedAttention")) return;
    Begin("PagedAttention");
    cuda::PagedAttention(a.q.as<uint16_t>(), meta, a.num_heads, kv, a.scale, attention_ws_->tensor().as<float>(),
                         a.out.as<uint16_t>(), stream_);
    Launched("PagedAttention");
  }

  void SiluMul(const Tensor& gate_up, const Tensor& out) override {
    Begin("SiluMul");
    cuda::SiluMul(gate_up.as<uint16_t>(), static_cast<int>(out.rows), static_cast<int>(out.cols), out.as<uint16_t>(),
                  stream_);
    Launched("SiluMul");
  }

  void Route(const Tensor& logits, const RoutingSpec& spec, const DeviceWeight* correction_bias, const Tensor& ids,
             const Tensor& weights) override {
    cuda::RouterParams p;
    p.sigmoid = spec.scoring == ScoringFunction::kSigmoid;
    p.num_experts = spec.num_experts;
    p.top_k = spec.top_k;
    p.normalize_top_k = spec.normalize_top_k;
    p.n_group = spec.n_group;
    p.topk_group = spec.topk_group;
    p.routed_scaling_factor = spec.routed_scaling_factor;
    p.correction_bias = correction_bias != nullptr ? AsCuda(*correction_bias).as<float>() : nullptr;
    Begin("RouteTopK");
    if (absl::Status s = cuda::CheckRouterParams(p); !s.ok() && pending_.ok())
      pending_ = core::Annotate(s, "RouteTopK");
    cuda::RouteTopK(logits.as<float>(), static_cast<int>(logits.rows), p, ids.as<int32_t>(), weights.as<float>(),
                    stream_);
    Launched("RouteTopK");
  }

  void SplitRouting(const Tensor& ids, const Tensor& weights, const Tensor& backend_index, const Tensor& host_ids,
                    const Tensor& host_weights, const Tensor& backend_ids, const Tensor& backend_weights) override {
    Begin("SplitRouting");
    cuda::SplitRouting(ids.as<int32_t>(), weights.as<float>(), static_cast<int>(ids.rows), static_cast<int>(ids.cols),
                       backend_index.as<int32_t>(), host_ids.as<int32_t>(), host_weights.as<float>(),
                       backend_ids.as<int32_t>(), backend_weights.as<float>(), stream_);
    Launched("SplitRouting");
  }

  void CountPicks(const Tensor& ids, const StepTensors& step, int scratch_block, const Tensor& counts) override {
    Begin("CountPicks");
    cuda::CountPicks(ids.as<int32_t>(), static_cast<int>(ids.rows), static_cast<int>(ids.cols),
                     step.row_seq.as<int32_t>(), step.block_table.as<int32_t>(), step.max_blocks, scratch_block,
                     static_cast<int>(counts.cols), counts.as<int32_t>(), stream_);
    Launched("CountPicks");
  }

  absl::Status ReplaceExpert(BackendExpertWeights& experts, int slot, const core::TensorView& gate,
                             const core::TensorView& up, const core::TensorView& down) override {
    auto& ex = static_cast<CudaExpertWeights&>(experts);
    if (slot < 0 || slot >= ex.weights.num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert slot ", slot, " outside [0, ", ex.weights.num_experts, ")"));
    }
    const int64_t part = int64_t{ex.weights.intermediate} * ex.weights.hidden * 2;
    char* gu = static_cast<char*>(ex.gate_up->tensor().data);
    char* dn = static_cast<char*>(ex.down->tensor().data);
    // Queued on the stream through the pinned staging buffers: in order with the steps around it.
    MOE_RETURN_IF_ERROR(Upload(gate, DType::kBF16, gu + (2 * slot) * part));
    MOE_RETURN_IF_ERROR(Upload(up, DType::kBF16, gu + (2 * slot + 1) * part));
    return Upload(down, DType::kBF16, dn + slot * part);
  }

  void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights, const BackendExpertWeights& experts,
                  const Tensor& out) override {
    if (!HasScratch(moe_ws_, "MoeExperts")) return;
    Begin("MoeExperts");
    cuda::MoeExperts(x.as<uint16_t>(), static_cast<int>(x.rows), ids.as<int32_t>(), weights.as<float>(),
                     static_cast<int>(ids.cols), static_cast<const CudaExpertWeights&>(experts).weights,
                     moe_ws_->tensor().data, out.as<float>(), stream_);
    Launched("MoeExperts");
  }

  void AddSharedExpert(const Tensor& out, const Tensor& shared, const Tensor* gate) override {
    Begin("AddSharedExpert");
    cuda::AddSharedExpert(out.as<float>(), shared.as<float>(), gate != nullptr ? gate->as<float>() : nullptr,
                          static_cast<int>(out.rows), static_cast<int>(out.cols), stream_);
    Launched("AddSharedExpert");
  }

  void GatherRows(const Tensor& src, const Tensor& rows, const Tensor& out) override {
    Begin("GatherRows");
    cuda::GatherRowsBytes(src.data, src.cols * core::DTypeSize(src.dtype), rows.as<int32_t>(),
                          static_cast<int>(rows.rows), out.data, stream_);
    Launched("GatherRows");
  }

  // The communicator queues on stream_ (made with stream_handle()); a failure it reports at once
  // is kept for Synchronize like a failed launch.
  void AllReduceSum(const Tensor& t, comm::Communicator& comm) override {
    Begin("AllReduceSum");
    KeepStatus(comm.AllReduceSum(t.data, t.numel(), t.dtype), "AllReduceSum");
    Launched("AllReduceSum");
  }
  void AllGather(const Tensor& t, comm::Communicator& comm, const Tensor& out) override {
    Begin("AllGather");
    KeepStatus(comm.AllGather(t.data, out.data, t.bytes()), "AllGather");
    Launched("AllGather");
  }
  void SendTensor(const Tensor& t, int peer, comm::Communicator& comm) override {
    Begin("SendTensor");
    KeepStatus(comm.Send(t.data, t.bytes(), peer), "SendTensor");
    Launched("SendTensor");
  }
  void RecvTensor(const Tensor& t, int peer, comm::Communicator& comm) override {
    Begin("RecvTensor");
    KeepStatus(comm.Recv(t.data, t.bytes(), peer), "RecvTensor");
    Launched("RecvTensor");
  }
  void ConcatColumns(const Tensor& stacked, int parts, const Tensor& out) override {
    Begin("ConcatColumns");
    const size_t elem = core::DTypeSize(out.dtype), width = stacked.cols * elem;
    for (int p = 0; p < parts; ++p) {
      MOE_CUDA_KEEP(cudaMemcpy2DAsync(static_cast<char*>(out.data) + p * width, out.cols * elem,
                                      static_cast<const char*>(stacked.data) + p * out.rows * width, width, width,
                                      out.rows, cudaMemcpyDeviceToDevice, stream_));
    }
    Launched("ConcatColumns");
  }
  void* stream_handle() const override { return stream_; }

 private:
  static cuda::StepMeta Meta(const StepTensors& step) {
    cuda::StepMeta m;
    m.token_ids = step.token_ids.as<int32_t>();
    m.positions = step.positions.as<int32_t>();
    m.row_seq = step.row_seq.as<int32_t>();
    m.seq_start = step.seq_start.as<int32_t>();
    m.seq_len = step.seq_len.as<int32_t>();
    m.block_table = step.block_table.as<int32_t>();
    m.num_tokens = step.num_tokens;
    m.num_seqs = step.num_seqs;
    m.max_blocks = step.max_blocks;
    m.max_q_len = step.max_q_len;
    m.max_kv_len = step.max_kv_len;
    return m;
  }

  // Streams pool layer `l`'s packed experts into a staging slot (unless the last call prefetched
  // them), unpacks them to bf16 and runs the layer here; queues the next layer's copy meanwhile.
  void StreamLayer(int l, const Tensor& x, const Tensor& ids, const Tensor& weights, const Tensor& out) {
    int slot = staged_layer_[0] == l ? 0 : staged_layer_[1] == l ? 1 : -1;
    if (slot < 0) {
      slot = next_stage_;
      QueueLayerCopy(l, slot);
    }
    next_stage_ = slot ^ 1;
    MOE_CUDA_KEEP(cudaStreamWaitEvent(stream_, staged_[slot], 0));
    const int inter = streamed_.intermediate, h = static_cast<int>(streamed_.down.n);
    Begin("UnpackExperts");
    cuda::UnpackExperts(staging_layer_[slot]->tensor().as<uint8_t>(), streamed_.num_experts, streamed_.expert_bytes,
                        cuda::ToPackedMatrixLayout(streamed_.gate_up), streamed_.gate_up.bytes(),
                        cuda::ToPackedMatrixLayout(streamed_.down), inter, streamed_gate_up_->tensor().as<uint16_t>(),
                        streamed_down_->tensor().as<uint16_t>(), stream_);
    Launched("UnpackExperts");
    MOE_CUDA_KEEP(cudaEventRecord(staging_free_[slot], stream_));
    staged_layer_[slot] = -1;
    if (l + 1 < streamed_.num_layers && staged_layer_[slot ^ 1] != l + 1) QueueLayerCopy(l + 1, slot ^ 1);
    cuda::ExpertWeights w;
    w.gate_up = streamed_gate_up_->tensor().as<uint16_t>();
    w.down = streamed_down_->tensor().as<uint16_t>();
    w.num_experts = streamed_.num_experts;
    w.hidden = h;
    w.intermediate = inter;
    if (!HasScratch(moe_ws_, "MoeExperts (streamed)")) return;
    Begin("MoeExperts (streamed)");
    cuda::MoeExperts(x.as<uint16_t>(), static_cast<int>(x.rows), ids.as<int32_t>(), weights.as<float>(),
                     static_cast<int>(ids.cols), w, moe_ws_->tensor().data, out.as<float>(), stream_);
    Launched("MoeExperts (streamed)");
    ++streamed_calls_;
  }

  void QueueLayerCopy(int l, int slot) {
    const int64_t layer_bytes = int64_t{streamed_.num_experts} * streamed_.expert_bytes;
    cudaError_t err = cudaStreamWaitEvent(copy_stream_, staging_free_[slot], 0);
    if (err == cudaSuccess) {
      err = cudaMemcpyAsync(staging_layer_[slot]->tensor().data, streamed_.data + l * layer_bytes, layer_bytes,
                            cudaMemcpyHostToDevice, copy_stream_);
    }
    if (err == cudaSuccess) err = cudaEventRecord(staged_[slot], copy_stream_);
    Keep(err, "copying a layer's experts to the GPU");
    staged_layer_[slot] = err == cudaSuccess ? l : -1;
  }

  // One host experts call, as its host function sees it.
  struct HostCall {
    CudaBackend* backend;
    HostExpertCompute* host;
    int layer;
    int64_t rows;
  };
  static void RunHostCall(void* p) {
    const HostCall& c = *static_cast<const HostCall*>(p);
    CudaBackend& b = *c.backend;
    absl::Status s = c.host->Compute(c.layer, b.host_x_, c.rows, b.host_ids_, b.host_weights_, b.host_out_);
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(b.host_mu_);
    if (b.host_error_.ok())
      b.host_error_ = core::Annotate(s, absl::StrCat("routed experts on the host, layer ", c.layer));
  }

  // The mapped-flags hand-off's host side: polls the mailbox for a request, runs it, answers. It
  // spins (pausing) for a while after each request, as the pool's threads linger, then sleeps
  // between polls so that an idle server costs no core.
  void PollHostRequests() {
    constexpr auto kSpin = std::chrono::milliseconds(20);
    constexpr auto kIdlePoll = std::chrono::microseconds(50);
    volatile cuda::HostMailbox* m = mailbox_;
    uint32_t seen = 0;
    auto last = std::chrono::steady_clock::now();
    uint32_t polls = 0;
    while (!host_stop_.load(std::memory_order_relaxed)) {
      const uint32_t request = m->request;
      if (request != seen) {
        std::atomic_thread_fence(std::memory_order_acquire);
        seen = request;
        HostExpertCompute* host = polled_host_.load();
        absl::Status s = host != nullptr
                             ? host->Compute(m->layer, host_x_, m->rows, host_ids_, host_weights_, host_out_)
                             : absl::InternalError("a host experts request with no experts to run it");
        if (!s.ok()) {
          std::lock_guard<std::mutex> lock(host_mu_);
          if (host_error_.ok()) {
            host_error_ = core::Annotate(s, absl::StrCat("routed experts on the host, layer ", m->layer));
          }
        }
        std::atomic_thread_fence(std::memory_order_seq_cst);  // the sums before the answer
        m->done = request;
        last = std::chrono::steady_clock::now();
        continue;
      }
      if (++polls % 64 != 0) {
#if defined(__x86_64__)
        _mm_pause();
#endif
        continue;
      }
      if (std::chrono::steady_clock::now() - last > kSpin) std::this_thread::sleep_for(kIdlePoll);
    }
  }

  // Mapped pinned memory for a step's worth of a MoE layer's inputs and output, the stream the
  // host calls queue on, and its fork and join events.
  absl::Status ReserveHostExperts(const StepLimits& l) {
    host_rows_ = l.max_tokens;
    host_hidden_ = l.hidden;
    host_top_k_ = l.top_k;
    const int64_t x_bytes = int64_t{host_rows_} * host_hidden_ * 4, k_bytes = int64_t{host_rows_} * host_top_k_ * 4;
    const int64_t bytes = 2 * x_bytes + 2 * k_bytes;
    void* p = nullptr;
    MOE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocMapped));
    host_io_ = std::make_unique<PinnedBuffer>(p, bytes);
    char* base = static_cast<char*>(p);
    host_x_ = reinterpret_cast<float*>(base);
    host_out_ = reinterpret_cast<float*>(base + x_bytes);
    host_ids_ = reinterpret_cast<int32_t*>(base + 2 * x_bytes);
    host_weights_ = reinterpret_cast<float*>(base + 2 * x_bytes + k_bytes);
    void* dev = nullptr;
    MOE_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev, p, 0));
    char* dbase = static_cast<char*>(dev);
    host_x_dev_ = reinterpret_cast<float*>(dbase);
    host_ids_dev_ = reinterpret_cast<int32_t*>(dbase + 2 * x_bytes);
    host_weights_dev_ = reinterpret_cast<float*>(dbase + 2 * x_bytes + k_bytes);
    if (host_stream_ == nullptr) {
      void* m = nullptr;
      MOE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&m, sizeof(cuda::HostMailbox), cudaHostAllocMapped));
      mailbox_io_ = std::make_unique<PinnedBuffer>(m, sizeof(cuda::HostMailbox));
      mailbox_ = new (m) cuda::HostMailbox{};
      void* mdev = nullptr;
      MOE_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&mdev, m, 0));
      mailbox_dev_ = static_cast<cuda::HostMailbox*>(mdev);
      MOE_ASSIGN_OR_RETURN(counter_buffer_, Allocate(DType::kI32, 1, 1));
      host_counter_ = counter_buffer_->tensor().as<uint32_t>();
      MOE_CUDA_RETURN_IF_ERROR(cudaMemset(host_counter_, 0, sizeof(uint32_t)));
      cudaStream_t stream = nullptr;
      MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&host_fork_, cudaEventDisableTiming));
      MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&host_join_, cudaEventDisableTiming));
      MOE_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&host_step_done_, cudaEventDisableTiming | cudaEventBlockingSync));
      host_stream_ = stream;  // last: a half-made set is not taken for a working one
    }
    if (!host_thread_.joinable()) {  // the first model on this backend, or one after ReleaseHostExperts
      host_stop_.store(false);
      host_thread_ = std::thread([this] { PollHostRequests(); });
    }
    return absl::OkStatus();
  }

  // Copies `host` to `dst` as `dtype` through the pinned staging buffers, two in flight.
  absl::Status Upload(const core::TensorView& host, DType dtype, char* dst) {
    const int64_t n = host.numel(), out_size = core::DTypeSize(dtype);
    const int64_t per_chunk = kStagingBytes / std::max<int64_t>(out_size, core::DTypeSize(host.dtype));
    for (int64_t first = 0; first < n; first += per_chunk) {
      const int64_t count = std::min(per_chunk, n - first);
      const int slot = next_staging_;
      next_staging_ ^= 1;
      MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_done_[slot]));
      const char* src = static_cast<const char*>(host.data) + first * core::DTypeSize(host.dtype);
      ConvertInto(src, host.dtype, count, dtype, staging_[slot]);
      MOE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst + first * out_size, staging_[slot], count * out_size, cudaMemcpyHostToDevice, stream_));
      MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_done_[slot], stream_));
    }
    return absl::OkStatus();
  }

  // `count` elements of `src` (bf16, f16 or f32) as `to` (bf16 or f32).
  static void ConvertInto(const char* src, DType from, int64_t count, DType to, void* dst) {
    if (from == to) {
      std::memcpy(dst, src, count * core::DTypeSize(to));
      return;
    }
    if (to == DType::kF32) {
      core::ConvertToFloat(src, from, static_cast<float*>(dst), count);
      return;
    }
    uint16_t* out = static_cast<uint16_t*>(dst);
    constexpr int64_t kBlock = 4096;
    float tmp[kBlock];
    for (int64_t i = 0; i < count; i += kBlock) {
      const int64_t m = std::min(kBlock, count - i);
      core::ConvertToFloat(src + i * core::DTypeSize(from), from, tmp, m);
      for (int64_t j = 0; j < m; ++j) out[i + j] = core::FloatToBf16(tmp[j]);
    }
  }

  // The workspace an operation needs exists only after ReserveScratch: without it the
  // operation is skipped and the step fails at Synchronize.
  bool HasScratch(const std::unique_ptr<DeviceBuffer>& ws, const char* op) {
    if (ws != nullptr) return true;
    if (pending_.ok()) {
      pending_ = absl::FailedPreconditionError(
          absl::StrCat(op, " on ", name_, ": no workspace; ReserveScratch was not called before the step"));
    }
    return false;
  }

  void Launched(const char* op) {
    Ended();
    if (capturing_) return;  // launch errors during capture show at cudaStreamEndCapture
    Keep(cudaGetLastError(), op);
  }

  // ---- Operation timing (cuda/op_timer.h) ----
  absl::Status BeginOpTiming() override { return timer_.Start(); }
  absl::StatusOr<OpTiming> EndOpTiming() override { return timer_.Finish(stream_); }
  void Begin(std::string op) {
    if (!timer_.has_room() || capturing_) return;
    const bool first_of_step = !step_held_;
    step_held_ = true;
    MOE_CUDA_KEEP(timer_.Before(std::move(op), first_of_step, stream_));
  }
  void Ended() {
    if (!timer_.active() || capturing_) return;
    MOE_CUDA_KEEP(timer_.After(stream_));
  }

  void KeepStatus(const absl::Status& s, const char* what) {
    if (!s.ok() && pending_.ok()) pending_ = core::Annotate(s, what);
  }

  void Keep(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return;
    absl::Status s = cuda::CudaStatus(err, what, __FILE__, __LINE__);
    const bool sticky =
        err == cudaErrorIllegalAddress || err == cudaErrorLaunchFailure || err == cudaErrorHardwareStackError ||
        err == cudaErrorIllegalInstruction || err == cudaErrorMisalignedAddress || err == cudaErrorInvalidPc ||
        err == cudaErrorECCUncorrectable || err == cudaErrorDevicesUnavailable || err == cudaErrorContextIsDestroyed;
    s = absl::InternalError(absl::StrCat(sticky ? "the GPU context is lost: " : "", "CUDA error in ", what, " on ",
                                         name_, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
    if (sticky && lost_.ok()) lost_ = s;
    if (pending_.ok()) pending_ = s;
  }

  const int device_;
  const WeightPolicy policy_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  void* linear_workspace_ = nullptr;
  cuda::Linear* linear_ = nullptr;
  void* staging_[2] = {nullptr, nullptr};
  cudaEvent_t staging_done_[2] = {nullptr, nullptr};
  int next_staging_ = 0;
  std::unique_ptr<DeviceBuffer> attention_ws_, moe_ws_, sampling_ws_;
  // fp32 output of the biased Linears, then rounded, and of the padded weights' Linears.
  std::unique_ptr<DeviceBuffer> bias_out_;
  int64_t max_padded_rows_ = 0;
  std::unique_ptr<HostBuffer> sample_host_;
  std::unique_ptr<DeviceBuffer> sample_dev_;
  int64_t sample_bytes_ = 0, history_capacity_ = 0;
  int64_t vocab_ = 0;
  int max_logit_rows_ = 0;
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    std::vector<std::unique_ptr<HostCall>> host_calls;  // what its host function nodes read
  };
  // By (step context, the model's key): each model on this backend records its own.
  using GraphKey = std::pair<uint64_t, uint64_t>;
  std::map<GraphKey, Graph> graphs_;
  // The largest limits ReserveScratch was asked for, over every context.
  StepLimits reserved_;
  bool scratch_reserved_ = false;
  // Hybrid execution (ReserveHostExperts).
  cudaStream_t host_stream_ = nullptr;
  cudaEvent_t host_fork_ = nullptr, host_join_ = nullptr, host_step_done_ = nullptr;
  std::unique_ptr<HostBuffer> host_io_;
  float *host_x_ = nullptr, *host_out_ = nullptr, *host_weights_ = nullptr;
  int32_t* host_ids_ = nullptr;
  float *host_x_dev_ = nullptr, *host_weights_dev_ = nullptr;  // the same memory, as the GPU sees it
  int32_t* host_ids_dev_ = nullptr;
  int host_rows_ = 0, host_hidden_ = 0, host_top_k_ = 0;
  bool host_in_flight_ = false;
  HostHandoff handoff_ = HostHandoff::kMappedFlags;
  std::vector<std::unique_ptr<HostCall>> eager_host_calls_, captured_host_calls_;  // host-function nodes
  // The mapped-flags hand-off: the mailbox, the GPU's request counter, the polling thread.
  std::unique_ptr<HostBuffer> mailbox_io_;
  cuda::HostMailbox* mailbox_ = nullptr;
  cuda::HostMailbox* mailbox_dev_ = nullptr;
  std::unique_ptr<DeviceBuffer> counter_buffer_;
  uint32_t* host_counter_ = nullptr;
  std::atomic<HostExpertCompute*> polled_host_{nullptr};
  std::atomic<bool> host_stop_{false};
  std::thread host_thread_;
  std::mutex host_mu_;
  absl::Status host_error_;  // the first failed host call since the last Synchronize
  // Streaming the host's experts for long chunks (SetStreamedExperts): two staging slots for a
  // layer's packed bytes, the layer unpacked to bf16, the copies' stream and events.
  StreamedExpertArena streamed_;
  int stream_tokens_ = 0;
  bool in_graph_ = false;
  bool streaming_in_flight_ = false;
  cudaStream_t copy_stream_ = nullptr;
  std::unique_ptr<DeviceBuffer> staging_layer_[2], streamed_gate_up_, streamed_down_;
  cudaEvent_t staged_[2] = {nullptr, nullptr}, staging_free_[2] = {nullptr, nullptr};
  int staged_layer_[2] = {-1, -1};
  int next_stage_ = 0;
  int64_t streamed_calls_ = 0;
  const uint8_t* registered_ = nullptr;  // the page-locked arena
  bool capturing_ = false;
  bool step_held_ = false;  // this step's operations are queued behind a hold (timing)
  cuda::OpTimer timer_;
  absl::Status pending_;  // the first error since the last Synchronize
  absl::Status lost_;     // set once the context is lost: every later Synchronize fails
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  auto backend = std::make_unique<CudaBackend>(device);
  MOE_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

int CudaBackendDeviceCount() { return cuda::VisibleDeviceCount(); }

absl::StatusOr<std::pair<int64_t, int64_t>> CudaBackendMemoryInfo(int device) {
  int previous = 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  size_t free = 0, total = 0;
  const cudaError_t err = cudaMemGetInfo(&free, &total);
  cudaSetDevice(previous);
  MOE_CUDA_RETURN_IF_ERROR(err);
  return std::make_pair(static_cast<int64_t>(free), static_cast<int64_t>(total));
}

std::string CudaBackendDeviceName(int device) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::StrCat("GPU ", device);
  }
  return absl::StrFormat("%s, %.1f GiB", prop.name, static_cast<double>(prop.totalGlobalMem) / (1 << 30));
}

}  // namespace moe::runtime
