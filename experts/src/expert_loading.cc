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
#include "moe/core/status.h"
#include "moe/experts/gguf_types.h"
#include "oneapi/tbb/parallel_for.h"

namespace moe::experts::internal {
namespace {

// The shared segment's key: the model, the shape and every matrix's format (per layer where
// they differ: native GGUF types), so that a pool never attaches to another layout.
uint64_t ArenaKey(const ExpertShape& s, const ExpertPoolOptions& o, const PackedExperts& layout) {
  std::string text = absl::StrCat(o.model_id, "|", FormatName(o.format), "|", o.group, "|", s.num_layers, "|",
                                  s.num_experts, "|", s.hidden, "|", s.intermediate, "|layout1");
  if (IsGgufFormat(o.format) || o.format == ExpertFormat::kNative) {
    absl::StrAppend(&text, "|gguf1");
    for (int l = 0; l < s.num_layers; ++l) {
      const PackedExperts p = layout.ForLayer(l);
      absl::StrAppend(&text, "|", FormatName(p.gate_up.format), ",", FormatName(p.down.format));
    }
  }
  return std::hash<std::string>{}(text);
}

absl::Status CheckShapes(const ExpertWeights& w, int layer, int expert, int64_t h, int64_t inter) {
  const core::Shape io = {inter, h}, oi = {h, inter};
  if (w.gate.shape() == io && w.up.shape() == io && w.down.shape() == oi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("MoE layer ", layer, " expert ", expert, ": gate ", core::ShapeString(w.gate.shape()), ", up ",
                   core::ShapeString(w.up.shape()), ", down ", core::ShapeString(w.down.shape()),
                   "; expected gate and up ", core::ShapeString(io), ", down ", core::ShapeString(oi)));
}

// A matrix's type against the format its layout keeps: GGUF formats take their own type only.
absl::Status CheckType(const ExpertMatrix& m, const MatrixLayout& l, bool native, int layer, int expert,
                       const char* what) {
  if (l.gguf_type < 0) {
    if (m.is_gguf() && FindGgufType(m.gguf_type) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("MoE layer ", layer, " expert ", expert, " ", what,
                                                     ": GGUF type id ", m.gguf_type, " is not read; types supported: ",
                                                     SupportedGgufTypeNames()));
    }
    return absl::OkStatus();
  }
  if (m.gguf_type == l.gguf_type) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "MoE layer ", layer, " expert ", expert, " ", what, " is ", m.TypeName(), ", but the expert pool keeps ",
      FormatName(l.format), " there",
      native ? " (the type of expert 0 of the layer): every expert of a layer must have the same types"
             : " (the format asked): use --expert-format native to keep each matrix's type",
      ", or bf16, int8 or int4 to convert them"));
}

// Row `n` of a matrix as floats: its values converted, or its GGUF blocks dequantized.
void RowAsFloats(const ExpertMatrix& m, int64_t n, float* dst) {
  const int64_t cols = m.tensor.dim(1);
  if (m.is_gguf()) {
    const GgufType& t = *FindGgufType(m.gguf_type);
    DequantizeRow(m.gguf_type, static_cast<const uint8_t*>(m.tensor.data) + n * GgufRowBytes(t, cols), cols, dst);
    return;
  }
  if (m.is_fp8()) {
    const uint8_t* codes = static_cast<const uint8_t*>(m.tensor.data) + n * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += m.scale_cols) {
      const float scale = m.Fp8Scale(n, c0);
      for (int64_t c = c0; c < std::min(cols, c0 + m.scale_cols); ++c) dst[c] = core::F8E4M3ToFloat(codes[c]) * scale;
    }
    return;
  }
  const int64_t elem = core::DTypeSize(m.tensor.dtype);
  core::ConvertToFloat(static_cast<const uint8_t*>(m.tensor.data) + n * cols * elem, m.tensor.dtype, dst, cols);
}

// Whether `m`'s fp8 codes go into an fp8 layout as they are: each of the layout's scale groups
// lies within one of the matrix's scale blocks.
bool KeepsFp8(const ExpertMatrix& m, const MatrixLayout& l) {
  return l.format == ExpertFormat::kFp8 && m.is_fp8() && m.scale_cols % l.group == 0;
}

// Packs an fp8 matrix's codes and scales as they are (KeepsFp8); `row(n)` maps a layout row to
// the matrix and its row (null: zeros).
void PackFp8(const MatrixLayout& l, const std::function<std::pair<const ExpertMatrix*, int64_t>(int64_t)>& row,
             uint8_t* out) {
  PackFp8Rows(
      l,
      [&](int64_t n) -> const uint8_t* {
        const auto [m, r] = row(n);
        return m == nullptr ? nullptr : static_cast<const uint8_t*>(m->tensor.data) + r * m->tensor.dim(1);
      },
      [&](int64_t n, int64_t g) {
        const auto [m, r] = row(n);
        return m == nullptr ? 0.0f : m->Fp8Scale(r, g * l.group);
      },
      out);
}

const uint8_t* GgufRow(const ExpertMatrix& m, int64_t n) {
  return static_cast<const uint8_t*>(m.tensor.data) + n * GgufRowBytes(*FindGgufType(m.gguf_type), m.tensor.dim(1));
}

// Packs one expert's checkpoint weights, of the shapes CheckShapes wants, into its place in the
// arena.
absl::Status PackExpert(const ExpertWeights& w, const PackedExperts& experts, bool native, int layer, int expert,
                        int64_t h, int64_t inter) {
  // Fused gate+up: 16 gate rows, then the same 16 up rows, block after block.
  const PackedMatrix gu = experts.GateUp(layer, expert);
  auto gate_up_row = [&](int64_t n) -> std::pair<const ExpertMatrix*, int64_t> {
    const int64_t unit = (n / 32) * 16 + n % 16;
    return {(n / 16) % 2 == 0 ? &w.gate : &w.up, unit};
  };
  const PackedMatrix d = experts.Down(layer, expert);
  MOE_RETURN_IF_ERROR(CheckType(w.gate, gu.layout, native, layer, expert, "gate"));
  MOE_RETURN_IF_ERROR(CheckType(w.up, gu.layout, native, layer, expert, "up"));
  MOE_RETURN_IF_ERROR(CheckType(w.down, d.layout, native, layer, expert, "down"));
  if (gu.layout.gguf_type >= 0) {
    // GGUF blocks as they are.
    PackGgufRows(
        gu.layout,
        [&](int64_t n) -> const uint8_t* {
          const auto [src, unit] = gate_up_row(n);
          return unit < inter ? GgufRow(*src, unit) : nullptr;
        },
        const_cast<uint8_t*>(gu.data));
    PackGgufRows(d.layout, [&](int64_t n) { return GgufRow(w.down, n); }, const_cast<uint8_t*>(d.data));
    return absl::OkStatus();
  }
  if (KeepsFp8(w.gate, gu.layout) && KeepsFp8(w.up, gu.layout) && KeepsFp8(w.down, d.layout)) {
    // fp8 codes and their scales as they are.
    PackFp8(
        gu.layout,
        [&](int64_t n) -> std::pair<const ExpertMatrix*, int64_t> {
          const auto [src, unit] = gate_up_row(n);
          return {unit < inter ? src : nullptr, unit};
        },
        const_cast<uint8_t*>(gu.data));
    PackFp8(d.layout, [&](int64_t n) { return std::pair<const ExpertMatrix*, int64_t>{&w.down, n}; },
            const_cast<uint8_t*>(d.data));
    return absl::OkStatus();
  }
  if (!w.gate.is_gguf() && !w.up.is_gguf() && w.gate.tensor.dtype == core::DType::kBF16 &&
      w.up.tensor.dtype == core::DType::kBF16) {
    // bf16 rows go in as they are, without a row of floats in between.
    PackRowsBf16(
        experts.gate_up,
        [&](int64_t n) -> const uint16_t* {
          const auto [src, unit] = gate_up_row(n);
          return unit < inter ? static_cast<const uint16_t*>(src->tensor.data) + unit * h : nullptr;
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
          RowAsFloats(*src, unit, dst);
        },
        const_cast<uint8_t*>(gu.data));
  }
  if (!w.down.is_gguf() && !w.down.is_fp8()) return PackMatrix(w.down.tensor, d.layout, const_cast<uint8_t*>(d.data));
  PackRows(d.layout, [&](int64_t n, float* dst) { RowAsFloats(w.down, n, dst); }, const_cast<uint8_t*>(d.data));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LoadedExperts> LoadExperts(const ExpertShape& shape, const ExpertPoolOptions& options,
                                          const PackedExperts& layout, tbb::task_arena& threads,
                                          const ExpertWeightSource& source) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t jobs = static_cast<int64_t>(shape.num_layers) * shape.num_experts;
  const size_t bytes = static_cast<size_t>(layout.TotalBytes(shape.num_layers));
  LoadedExperts loaded;
  if (!options.shm_name.empty()) {
    auto arena = HostArena::OpenShared(options.shm_name, ArenaKey(shape, options, layout), bytes);
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
                                  IsGgufFormat(options.format) || options.format == ExpertFormat::kNative ||
                                          options.format == ExpertFormat::kFp8
                                      ? layout.TotalBytes(shape.num_layers)
                                      : jobs * 3 * h * inter * 2,
                                  options.progress);
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
      error.Set(PackExpert(*w, experts, options.format == ExpertFormat::kNative, layer, expert, h, inter));
      const int64_t n = w->gate.bytes() + w->up.bytes() + w->down.bytes();  // as the source holds them
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
