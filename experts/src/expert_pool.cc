// ExpertPool: the pool's calls and measurements, on the parts in the other files: the threads
// (worker_crew.h), loading the arena (expert_loading.h), grouping a call's tokens by expert
// (token_grouping.h), the two schedules (expert_schedules.h), the phase times
// (phase_timing.h) and the probes (pool_probes.h).
#include "moe/experts/expert_pool.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "expert_loading.h"
#include "moe/experts/gguf_types.h"
#include "expert_schedules.h"
#include "packed_experts.h"
#include "phase_timing.h"
#include "pool_probes.h"
#include "worker_crew.h"

namespace moe::experts {

float ExpertMatrix::Fp8Scale(int64_t row, int64_t col) const {
  const int64_t scale_cols_n = (tensor.dim(1) + scale_cols - 1) / scale_cols;
  const int64_t i = (row / scale_rows) * scale_cols_n + col / scale_cols;
  if (scale_dtype == core::DType::kBF16) return core::Bf16ToFloat(static_cast<const uint16_t*>(scales)[i]);
  return static_cast<const float*>(scales)[i];
}

int64_t ExpertMatrix::bytes() const {
  if (is_fp8()) {
    const int64_t blocks = ((tensor.dim(0) + scale_rows - 1) / scale_rows) * ((tensor.dim(1) + scale_cols - 1) / scale_cols);
    return tensor.bytes() + blocks * core::DTypeSize(scale_dtype);
  }
  if (!is_gguf()) return tensor.bytes();
  const GgufType* t = FindGgufType(gguf_type);
  return t == nullptr || tensor.rank() != 2 ? 0 : tensor.dim(0) * GgufRowBytes(*t, tensor.dim(1));
}

std::string ExpertMatrix::TypeName() const {
  if (!is_gguf()) return core::DTypeName(tensor.dtype);
  const GgufType* t = FindGgufType(gguf_type);
  return t != nullptr ? t->name : absl::StrCat("GGUF type ", gguf_type);
}

namespace {

// Native GGUF types: each layer's formats, from expert 0 of the layer.
absl::StatusOr<internal::PackedExperts> LayOutNativeExperts(const ExpertShape& shape, const ExpertWeightSource& source) {
  std::vector<std::pair<ExpertFormat, ExpertFormat>> formats;
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    auto w = source(layer, 0);
    if (!w.ok()) return w.status();
    auto format_of = [&](const ExpertMatrix& m, const char* what) -> absl::StatusOr<ExpertFormat> {
      if (!m.is_gguf()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "MoE layer ", layer, " expert 0 ", what, " is ", m.TypeName(),
            ": the native expert format keeps quantized GGUF types only; use --expert-format bf16, int8 or int4"));
      }
      auto f = FormatForGgufType(m.gguf_type);
      if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat("MoE layer ", layer, " expert 0 ", what, ": ", f.status().message()));
      return *f;
    };
    auto gate = format_of(w->gate, "gate");
    if (!gate.ok()) return gate.status();
    auto up = format_of(w->up, "up");
    if (!up.ok()) return up.status();
    auto down = format_of(w->down, "down");
    if (!down.ok()) return down.status();
    if (*gate != *up) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MoE layer ", layer, ": gate is ", w->gate.TypeName(), " and up ", w->up.TypeName(),
          "; the native expert format fuses gate and up and needs one type for both (use --expert-format int8 or int4)"));
    }
    formats.push_back({*gate, *down});
  }
  return internal::LayOutExpertsPerLayer(shape, formats);
}

// The kernels a pool in `format` may run (native: those of the GGUF formats, all alike).
ExpertFormat KernelFormat(ExpertFormat format) {
  return format == ExpertFormat::kNative ? ExpertFormat::kQ8_0 : format;
}

}  // namespace

class ExpertPool::Impl {
 public:
  Impl(int threads, const ExpertPoolOptions& options, const std::vector<int>& cpus,
       const internal::PackedExperts& experts)
      : workers(threads, options.linger_us, options.pin_threads, cpus),
        loops(workers.crew(), threads),
        experts(experts),
        scratch(experts.num_experts),
        times(threads) {}

  internal::WorkerThreads workers;
  internal::CrewLoops loops;        // the crew lent to the caller's other loops
  internal::PackedExperts experts;  // data set once the arena is loaded
  internal::CallScratch scratch;
  internal::PhaseTimes times;
  absl::Status result;
  uint64_t ticket = 0;
  std::vector<KernelKind> usable;  // kernels this CPU runs for the pool's format
};

ExpertPool::~ExpertPool() {
  if (impl_ == nullptr) return;
  if (in_flight_) impl_->workers.crew().Finish();
  impl_->workers.crew().Park();
}

absl::StatusOr<std::unique_ptr<ExpertPool>> ExpertPool::Create(const ExpertShape& shape,
                                                               const ExpertPoolOptions& options,
                                                               const ExpertWeightSource& source) {
  if (shape.num_layers <= 0 || shape.num_experts <= 0 || shape.hidden <= 0 || shape.intermediate <= 0 ||
      shape.top_k <= 0 || shape.top_k > shape.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("expert pool: bad shape: ", shape.num_layers, " layers, ",
                                                   shape.num_experts, " experts, top-", shape.top_k, ", hidden ",
                                                   shape.hidden, ", intermediate ", shape.intermediate));
  }
  std::unique_ptr<ExpertPool> pool(new ExpertPool());
  pool->shape_ = shape;
  pool->options_ = options;
  auto experts = options.format == ExpertFormat::kNative ? LayOutNativeExperts(shape, source)
                                                         : internal::LayOutExperts(shape, options.format, options.group);
  if (!experts.ok()) return experts.status();
  pool->expert_bytes_ = experts->expert_bytes;

  const core::CpuFeatures& cpu = core::GetCpuFeatures();
  if (options.kernel.has_value()) {
    const std::string why = KernelUnsupportedReason(*options.kernel, KernelFormat(options.format), cpu);
    if (!why.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("expert kernel ", KernelName(*options.kernel), " for ",
                                                        FormatName(options.format), ": ", why,
                                                        " (this CPU: ", cpu.ToString(), ")"));
    }
  }
  const std::vector<int> cpus = internal::AllowedCpus();
  pool->threads_ = options.threads > 0 ? options.threads : std::max<int>(1, static_cast<int>(cpus.size()));
  pool->impl_ = std::make_unique<Impl>(pool->threads_, options, cpus, *experts);
  Impl& impl = *pool->impl_;
  for (KernelKind k : KernelsFor(KernelFormat(options.format))) {
    if (KernelUnsupportedReason(k, KernelFormat(options.format), cpu).empty()) impl.usable.push_back(k);
  }
  auto loaded = internal::LoadExperts(shape, options, impl.experts, impl.workers.arena(), source);
  if (!loaded.ok()) return loaded.status();
  pool->arena_ = std::move(loaded->arena);
  pool->load_seconds_ = loaded->seconds;
  pool->loaded_bytes_ = loaded->checkpoint_bytes;
  impl.experts.data = pool->arena_->data();
  return pool;
}

absl::Status ExpertPool::SetKernel(std::optional<KernelKind> kernel) {
  if (kernel.has_value()) {
    const std::string why = KernelUnsupportedReason(*kernel, KernelFormat(options_.format), core::GetCpuFeatures());
    if (!why.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert kernel ", KernelName(*kernel), " for ", FormatName(options_.format), ": ", why));
    }
  }
  options_.kernel = kernel;
  return absl::OkStatus();
}

KernelKind ExpertPool::KernelFor(int64_t tokens) const {
  if (options_.kernel.has_value()) return *options_.kernel;
  auto usable = [&](KernelKind k) {
    return std::find(impl_->usable.begin(), impl_->usable.end(), k) != impl_->usable.end();
  };
  switch (options_.format) {
    case ExpertFormat::kBF16:
      // AMX (with split activations) where there are enough tokens to fill its tiles.
      if (tokens >= 16 && usable(KernelKind::kAmx)) return KernelKind::kAmx;
      return usable(KernelKind::kAvx512) ? KernelKind::kAvx512 : KernelKind::kPortable;
    case ExpertFormat::kInt8:
    case ExpertFormat::kInt4: {
      // On the 32-core machine (1024-token calls at most: `moeserve bench experts`), int8 AMX was
      // 1.00-1.01x VNNI at 16 tokens per expert and 1.07-1.19x at 32; int4 AMX 0.90x at 16 and
      // 1.13-1.17x at 32, as each AMX step of an int4 group costs what a step of int8 does.
      const int64_t amx_from = options_.format == ExpertFormat::kInt8 ? 16 : 24;
      if (tokens >= amx_from && usable(KernelKind::kAmx)) return KernelKind::kAmx;
      return usable(KernelKind::kVnni) ? KernelKind::kVnni : KernelKind::kPortable;
    }
    case ExpertFormat::kFp8:
      return usable(KernelKind::kAvx512Bf16) ? KernelKind::kAvx512Bf16 : KernelKind::kPortable;
    default:  // GGUF formats and native: VNNI for every token count (it decodes each span once per call)
      return usable(KernelKind::kVnni) ? KernelKind::kVnni : KernelKind::kPortable;
  }
  return KernelKind::kPortable;
}

absl::StatusOr<ExpertPool::Ticket> ExpertPool::Submit(int layer, const float* hidden, int64_t num_tokens,
                                                      const int32_t* topk_ids, const float* topk_weights, float* out) {
  if (in_flight_) return absl::FailedPreconditionError("expert pool: a call is already in flight; Wait first");
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert pool: ", num_tokens, " tokens"));
  }
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert pool: MoE layer ", layer, " outside [0, ", shape_.num_layers, ")"));
  }
  for (int64_t i = 0; i < num_tokens * shape_.top_k; ++i) {
    if (topk_ids[i] < kSkippedSlot || topk_ids[i] >= shape_.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("expert pool: expert id ", topk_ids[i], " of token ",
                                                     i / shape_.top_k, " outside [0, ", shape_.num_experts,
                                                     ") (-1 skips a slot)"));
    }
  }
  in_flight_ = true;
  const Ticket ticket{next_ticket_++};
  impl_->ticket = ticket.id;
  impl_->workers.crew().Post([this, layer, hidden, num_tokens, topk_ids, topk_weights, out] {
    impl_->result = Run(layer, hidden, num_tokens, topk_ids, topk_weights, out);
  });
  return ticket;
}

absl::Status ExpertPool::Wait(const Ticket& ticket) {
  if (!in_flight_ || ticket.id != impl_->ticket) {
    return absl::FailedPreconditionError("expert pool: no call in flight for this ticket");
  }
  impl_->workers.crew().Finish();
  in_flight_ = false;
  return impl_->result;
}

absl::Status ExpertPool::Compute(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                                 const float* topk_weights, float* out) {
  auto ticket = Submit(layer, hidden, num_tokens, topk_ids, topk_weights, out);
  if (!ticket.ok()) return ticket.status();
  return Wait(*ticket);
}

absl::Status ExpertPool::Run(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                             const float* topk_weights, float* out) {
  Impl& s = *impl_;
  s.times.StartPhases();
  internal::ExpertCall c(*this, s.experts, s.scratch, s.times, layer, num_tokens, topk_ids, hidden, topk_weights, out);
  const bool batch = num_tokens > options_.decode_max_tokens;
  if (absl::Status st = c.SetUp(batch); !st.ok()) return st;
  s.times.EndPhase("set-up");

  s.times.StartWork();
  if (batch) {
    internal::RunBatch(c, s.workers.crew());
  } else {
    internal::RunDecode(c, s.workers.crew());
  }
  s.times.EndWork();
  s.times.EndPhase("sort and experts");
  if (c.error.failed()) return c.error.status();
  s.times.CountCall();
  return absl::OkStatus();
}

HostThreads& ExpertPool::host_threads() { return impl_->loops; }

std::string ExpertPool::PhaseReport() const { return impl_->times.Report(); }

void ExpertPool::ResetPhases() { impl_->times.Reset(); }

double MeasureHostReadBandwidth(int threads, size_t bytes, int repeats) {
  const std::vector<int> cpus = internal::AllowedCpus();
  const int n = threads > 0 ? threads : std::max<int>(1, static_cast<int>(cpus.size()));
  internal::WorkerThreads workers(n, /*linger_us=*/0, /*pin=*/true, cpus);
  return internal::MeasureReadBandwidth(workers, n, bytes, repeats);
}

absl::StatusOr<int64_t> PackedExpertBytes(const ExpertShape& shape, ExpertFormat format, int group) {
  auto experts = internal::LayOutExperts(shape, format, group);
  if (!experts.ok()) return experts.status();
  return experts->expert_bytes;
}

ExpertPool::ArenaLayout ExpertPool::arena_layout() const {
  const internal::PackedExperts& e = impl_->experts;
  ArenaLayout a{e.data, e.expert_bytes, e.gate_up, e.down, e.layers == nullptr, {}};
  int64_t offset = 0;
  for (int l = 0; l < shape_.num_layers; ++l) {
    const internal::PackedExperts p = e.ForLayer(l);
    a.layers.push_back({offset, p.expert_bytes, p.gate_up, p.down});
    offset += p.expert_bytes * shape_.num_experts;
  }
  return a;
}

double ExpertPool::MeasureReadBandwidth(size_t bytes, int repeats) {
  if (in_flight_) return 0.0;
  impl_->workers.crew().Park();  // the lingering threads would hold the arena's slots
  return internal::MeasureReadBandwidth(impl_->workers, threads_, bytes, repeats);
}

ExpertPool::KernelStream ExpertPool::MeasureKernelStream(int64_t tokens, int repeats) {
  if (in_flight_ || tokens < 1) return KernelStream{};
  impl_->workers.crew().Park();  // as MeasureReadBandwidth
  return internal::MeasureKernelStream(impl_->workers, threads_, shape_, impl_->experts, options_.format,
                                       KernelFor(tokens), tokens, repeats);
}

std::string ExpertPool::Describe() const {
  std::string format = FormatName(options_.format);
  if (options_.format == ExpertFormat::kNative) {  // the types of the first layer's matrices
    const internal::PackedExperts p = impl_->experts.ForLayer(0);
    format = absl::StrCat(format, " (", FormatName(p.gate_up.format), "/", FormatName(p.down.format),
                          impl_->experts.layers != nullptr ? " in layer 0" : "", ")");
  }
  return absl::StrFormat("%s experts: %d layers x %d, %.2f GB in %s, %d %sthreads", format,
                         shape_.num_layers, shape_.num_experts, arena_->size() / 1e9, arena_->page_kind(), threads_,
                         options_.pin_threads ? "pinned " : "");
}

}  // namespace moe::experts
