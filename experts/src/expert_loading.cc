#include "expert_loading.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "first_error.h"
#include "moe/core/dtype.h"
#include "moe/core/progress.h"
#include "oneapi/tbb/parallel_for.h"

namespace moe::experts::internal {
namespace {

uint64_t ArenaKey(const ExpertShape& s, const ExpertPoolOptions& o) {
  const std::string text = absl::StrCat(o.model_id, "|", FormatName(o.format), "|", o.group, "|", s.num_layers, "|",
                                        s.num_experts, "|", s.hidden, "|", s.intermediate, "|layout1");
  return std::hash<std::string>{}(text);
}

absl::Status CheckShapes(const ExpertWeights& w, int layer, int expert, int64_t h, int64_t inter) {
  const core::Shape io = {inter, h}, oi = {h, inter};
  if (w.gate.shape == io && w.up.shape == io && w.down.shape == oi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("MoE layer ", layer, " expert ", expert, ": gate ", core::ShapeString(w.gate.shape), ", up ",
                   core::ShapeString(w.up.shape), ", down ", core::ShapeString(w.down.shape), "; expected gate and up ",
                   core::ShapeString(io), ", down ", core::ShapeString(oi)));
}

// Packs one expert's checkpoint weights, of the shapes CheckShapes wants, into its place in the
// arena.
absl::Status PackExpert(const ExpertWeights& w, const PackedExperts& experts, int layer, int expert, int64_t h,
                        int64_t inter) {
  // Fused gate+up: 16 gate rows, then the same 16 up rows, block after block.
  const PackedMatrix gu = experts.GateUp(layer, expert);
  auto gate_up_row = [&](int64_t n) -> std::pair<const core::TensorView*, int64_t> {
    const int64_t unit = (n / 32) * 16 + n % 16;
    return {(n / 16) % 2 == 0 ? &w.gate : &w.up, unit};
  };
  if (w.gate.dtype == core::DType::kBF16 && w.up.dtype == core::DType::kBF16) {
    // bf16 rows go in as they are, without a row of floats in between.
    PackRowsBf16(
        experts.gate_up,
        [&](int64_t n) -> const uint16_t* {
          const auto [src, unit] = gate_up_row(n);
          return unit < inter ? static_cast<const uint16_t*>(src->data) + unit * h : nullptr;
        },
        const_cast<uint8_t*>(gu.data));
  } else {
    PackRows(
        experts.gate_up,
        [&](int64_t n, float* dst) {
          const auto [src, unit] = gate_up_row(n);
          if (unit >= inter) {
            std::fill(dst, dst + h, 0.0f);
            return;
          }
          const int64_t elem = core::DTypeSize(src->dtype);
          core::ConvertToFloat(static_cast<const uint8_t*>(src->data) + unit * h * elem, src->dtype, dst, h);
        },
        const_cast<uint8_t*>(gu.data));
  }
  const PackedMatrix d = experts.Down(layer, expert);
  return PackMatrix(w.down, experts.down, const_cast<uint8_t*>(d.data));
}

}  // namespace

absl::StatusOr<LoadedExperts> LoadExperts(const ExpertShape& shape, const ExpertPoolOptions& options,
                                          const PackedExperts& layout, tbb::task_arena& threads,
                                          const ExpertWeightSource& source) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t jobs = static_cast<int64_t>(shape.num_layers) * shape.num_experts;
  const size_t bytes = static_cast<size_t>(jobs * layout.expert_bytes);
  LoadedExperts loaded;
  if (!options.shm_name.empty()) {
    auto arena = HostArena::OpenShared(options.shm_name, ArenaKey(shape, options), bytes);
    if (!arena.ok()) return arena.status();
    loaded.arena = std::move(*arena);
    if (loaded.arena->attached()) {
      loaded.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return loaded;
    }
  } else {
    auto arena = HostArena::CreatePrivate(bytes);
    if (!arena.ok()) return arena.status();
    loaded.arena = std::move(*arena);
  }
  PackedExperts experts = layout;
  experts.data = loaded.arena->data();

  const int64_t h = shape.hidden, inter = shape.intermediate;
  core::ProgressReporter progress(absl::StrCat("loading ", FormatName(options.format), " experts"),
                                  jobs * 3 * h * inter * 2, options.progress);
  FirstError error;
  std::atomic<int64_t> read{0};
  threads.execute([&] {
    tbb::parallel_for(int64_t{0}, jobs, [&](int64_t job) {
      if (error.failed()) return;
      const int layer = static_cast<int>(job / shape.num_experts);
      const int expert = static_cast<int>(job % shape.num_experts);
      auto w = source(layer, expert);
      if (!w.ok()) return error.Set(w.status());
      if (absl::Status s = CheckShapes(*w, layer, expert, h, inter); !s.ok()) return error.Set(s);
      error.Set(PackExpert(*w, experts, layer, expert, h, inter));
      const int64_t n = w->gate.bytes() + w->up.bytes() + w->down.bytes();
      read += n;
      progress.Add(n);
    });
  });
  progress.Finish();
  loaded.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  loaded.checkpoint_bytes = read.load();
  if (error.failed()) return error.status();
  loaded.arena->Publish();
  return loaded;
}

}  // namespace moe::experts::internal
