#include "moe/runtime/backend.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"

namespace moe::runtime {
namespace {

constexpr int64_t kArenaAlignment = 256;  // cuBLASLt and vector loads want aligned operands

int64_t AlignUp(int64_t n) { return (n + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment; }

}  // namespace

absl::StatusOr<std::unique_ptr<KvCache>> Backend::CreateKvCache(const CachePlan& plan, int num_blocks) {
  if (plan.groups.size() != 1 || !plan.groups[0].paged()) {
    return absl::UnimplementedError(absl::StrCat(name(), " keeps one paged cache group; this plan has ",
                                                 plan.groups.size(), " groups, the first ",
                                                 plan.groups.empty() ? "none" : CacheKindName(plan.groups[0].kind)));
  }
  const CacheGroup& group = plan.groups[0];
  if (num_blocks <= 0 || group.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache needs positive num_blocks and block_size, got ", num_blocks, " and ", group.block_size));
  }
  const core::DType dtype = group.dtype;
  if (!SupportsKvDtype(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name(), " keeps its KV cache in ", core::DTypeName(activation_dtype()), ", not ", core::DTypeName(dtype)));
  }
  const bool latent = group.kind == CacheKind::kPagedLatent;
  if (latent && dtype == core::DType::kF8E4M3) {
    return absl::InvalidArgumentError("an MLA latent cache is kept in the activation dtype; fp8 is not supported");
  }
  const KvCacheShape shape = KvShapeOf(group, num_blocks);
  const int64_t rows = static_cast<int64_t>(shape.num_layers) * (shape.num_blocks + 1);
  const int64_t scales =
      dtype == core::DType::kF8E4M3 ? static_cast<int64_t>(shape.block_size) * shape.num_kv_heads : 0;
  auto allocate = [&]() -> absl::StatusOr<std::unique_ptr<KvCache>> {
    MOE_ASSIGN_OR_RETURN(auto k, Allocate(dtype, rows, shape.elements_per_block_layer()));
    std::unique_ptr<DeviceBuffer> v;  // a latent cache has no V
    if (!latent) {
      MOE_ASSIGN_OR_RETURN(v, Allocate(dtype, rows, shape.elements_per_block_layer()));
    }
    std::unique_ptr<DeviceBuffer> k_scale, v_scale;
    if (scales > 0) {
      MOE_ASSIGN_OR_RETURN(k_scale, Allocate(core::DType::kF32, rows, scales));
      MOE_ASSIGN_OR_RETURN(v_scale, Allocate(core::DType::kF32, rows, scales));
    }
    return std::make_unique<KvCache>(shape, dtype, std::move(k), std::move(v), std::move(k_scale), std::move(v_scale));
  };
  auto cache = allocate();
  if (!cache.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a KV cache of ", (plan.BlockBytes() * (num_blocks + 1)) >> 20, " MiB (",
                     num_blocks, " blocks of ", group.block_size, " positions, ", core::DTypeName(dtype), ") on ",
                     name(), ": ", cache.status().message()));
  }
  return cache;
}

StepContext::~StepContext() {
  if (backend_ == nullptr) return;
  backend_->ClearContextGraphs(id_);  // they hold this context's arena
  if (backend_->current_ == this) backend_->current_ = &backend_->default_context_;
}

Backend::Backend() : default_context_(nullptr, 0) {}

Backend::~Backend() = default;

std::unique_ptr<StepContext> Backend::CreateContext() {
  return std::unique_ptr<StepContext>(new StepContext(this, next_context_id_++));
}

void Backend::UseContext(StepContext* context) { current_ = context != nullptr ? context : &default_context_; }

absl::Status Backend::ReserveArena(int64_t bytes, int64_t input_bytes) {
  StepContext& c = *current_;
  c.arena_.reset();
  c.staging_.reset();
  c.arena_bytes_ = c.arena_used_ = 0;
  bytes = AlignUp(bytes);
  auto arena = Allocate(core::DType::kI8, 1, bytes);
  if (!arena.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot reserve a step arena of ", bytes >> 20, " MiB on ", name(),
                                                     ": ", arena.status().message()));
  }
  MOE_ASSIGN_OR_RETURN(c.staging_, AllocateHost(input_bytes));
  c.arena_ = std::move(*arena);
  c.arena_bytes_ = bytes;
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Backend::Take(core::DType dtype, int64_t rows, int64_t cols) {
  StepContext& c = *current_;
  const int64_t bytes = AlignUp(rows * cols * core::DTypeSize(dtype));
  if (c.arena_ == nullptr || c.arena_used_ + bytes > c.arena_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("the step arena of ", c.arena_bytes_ >> 20,
                                                     " MiB is too small for this step (", bytes, " bytes more at ",
                                                     c.arena_used_, "); the model was loaded for smaller steps"));
  }
  Tensor t{static_cast<char*>(c.arena_->tensor().data) + c.arena_used_, dtype, rows, cols};
  c.arena_used_ += bytes;
  return t;
}

absl::StatusOr<StepTensors> Backend::BeginStep(const StepInputs& in) {
  StepContext& c = *current_;
  c.arena_used_ = 0;
  const std::vector<int32_t>* parts[] = {&in.token_ids, &in.positions,   &in.row_seq,   &in.seq_start,
                                         &in.seq_len,   &in.block_table, &in.logit_rows};
  int64_t total = 0;
  for (const auto* p : parts) total += AlignUp(static_cast<int64_t>(p->size()) * 4);
  if (c.staging_ == nullptr || total > c.staging_->bytes()) {
    return absl::ResourceExhaustedError(absl::StrCat("the step's inputs take ", total, " bytes, the staging buffer ",
                                                     c.staging_ == nullptr ? 0 : c.staging_->bytes()));
  }
  MOE_ASSIGN_OR_RETURN(Tensor device, Take(core::DType::kI8, 1, total));
  Tensor views[7];
  int64_t offset = 0;
  for (int i = 0; i < 7; ++i) {
    const int64_t n = static_cast<int64_t>(parts[i]->size());
    if (n > 0) std::memcpy(c.staging_->as<char>() + offset, parts[i]->data(), n * 4);
    views[i] = Tensor{static_cast<char*>(device.data) + offset, core::DType::kI32, n, 1};
    offset += AlignUp(n * 4);
  }
  CopyFromHost(c.staging_->data(), device);
  StepTensors step;
  step.token_ids = views[0];
  step.positions = views[1];
  step.row_seq = views[2];
  step.seq_start = views[3];
  step.seq_len = views[4];
  step.block_table = views[5].Reshaped(in.num_seqs(), in.max_blocks);
  step.logit_rows = views[6];
  step.num_tokens = in.num_tokens();
  step.num_seqs = in.num_seqs();
  step.max_blocks = in.max_blocks;
  step.max_q_len = in.max_q_len;
  step.max_kv_len = in.max_kv_len;
  step.host = &in;
  return step;
}

}  // namespace moe::runtime
