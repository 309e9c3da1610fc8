#include "moe/runtime/weight_policy.h"

#include "absl/strings/str_cat.h"
#include "moe/experts/gguf_types.h"

namespace moe::runtime {

WeightUse UseOf(TensorRole role, int rank) {
  if (rank <= 1) return WeightUse::kVector;
  switch (role) {
    case TensorRole::kEmbedding:
      return WeightUse::kEmbedding;
    case TensorRole::kRouter:
      return WeightUse::kRouter;
    default:
      return WeightUse::kMatrix;
  }
}

WeightPolicy WeightPolicy::Uniform(experts::ExpertFormat format, int group) {
  WeightPolicy p;
  p.matrices = format;
  p.group = group;
  return p;
}

experts::ExpertFormat WeightPolicy::MatrixFormat(TensorRole role) const {
  const auto it = by_role.find(role);
  return it != by_role.end() ? it->second : matrices;
}

bool WeightPolicy::packs() const {
  if (matrices != experts::ExpertFormat::kBF16) return true;
  for (const auto& [role, format] : by_role) {
    if (format != experts::ExpertFormat::kBF16) return true;
  }
  return false;
}

std::string WeightPolicy::Describe() const {
  std::string s = experts::FormatName(matrices);
  if (matrices == experts::ExpertFormat::kInt4) absl::StrAppend(&s, " (group ", group, ")");
  for (const auto& [role, format] : by_role) {
    absl::StrAppend(&s, ", ", std::string(TensorRoleName(role)), ": ", experts::FormatName(format));
  }
  return s;
}

int Fp8Group(const WeightFormat& stored) {
  if (stored.kind != WeightFormat::Kind::kBlockScaled || stored.element != core::DType::kF8E4M3) return 0;
  for (int g : {128, 64, 32}) {
    if (stored.scale_cols % g == 0) return g;
  }
  return 0;
}

bool SupportsStoredWeight(WeightHome home, const WeightFormat& stored, WeightUse use) {
  if (stored.kind == WeightFormat::Kind::kBlockScaled) {
    // The CPU backend keeps a Linear's fp8 codes and block scales, for the pool's fp8 kernels.
    return home == WeightHome::kHost && use == WeightUse::kMatrix && Fp8Group(stored) > 0;
  }
  if (stored.kind == WeightFormat::Kind::kBlocks) {
    // The CPU backend keeps a Linear's GGUF blocks as they are, for the expert pool's kernels.
    // An embedding's rows stay as stored and are dequantized as they are gathered.
    if (home == WeightHome::kHost && use == WeightUse::kEmbedding) return experts::FindGgufType(stored.type_id) != nullptr;
    return home == WeightHome::kHost && use == WeightUse::kMatrix &&
           experts::FormatForGgufType(stored.type_id).ok();
  }
  return stored.plain() && (stored.element == core::DType::kBF16 || stored.element == core::DType::kF16 ||
                            stored.element == core::DType::kF32);
}

int64_t DeviceWeightBytes(WeightHome home, const WeightPolicy& policy, const core::Shape& shape,
                          const WeightFormat& stored, WeightUse use, TensorRole role) {
  const int64_t elements = core::NumElements(shape);
  if (use == WeightUse::kVector) return elements * 4;
  if (home == WeightHome::kGpu) return elements * 2;  // bf16
  if (stored.kind == WeightFormat::Kind::kBlockScaled && SupportsStoredWeight(home, stored, use) && shape.size() == 2) {
    const absl::StatusOr<experts::MatrixLayout> layout =
        experts::MakeLayout(experts::ExpertFormat::kFp8, shape[0], shape[1], Fp8Group(stored));
    if (layout.ok()) return layout->bytes();  // fp8 codes and a scale per row and group
  }
  if (!stored.plain() && SupportsStoredWeight(home, stored, use)) return stored.Bytes(shape);  // GGUF blocks
  if (use == WeightUse::kMatrix && shape.size() == 2) {
    const experts::ExpertFormat f = policy.MatrixFormat(role);
    if (f != experts::ExpertFormat::kBF16) {
      const absl::StatusOr<experts::MatrixLayout> layout = experts::MakeLayout(f, shape[0], shape[1], policy.group);
      if (layout.ok()) return layout->bytes();
    }
  }
  // Read where it lies in the mapped checkpoint (bf16, f32), or from an f32 copy of an f16 one.
  return stored.plain() && stored.element == core::DType::kBF16 ? elements * 2 : elements * 4;
}

}  // namespace moe::runtime
