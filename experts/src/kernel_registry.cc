// Which kernel exists for which format, what a CPU needs for each, and the dispatch to them.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "moe/experts/kernels.h"

namespace moe::experts {

const char* KernelName(KernelKind k) {
  switch (k) {
    case KernelKind::kPortable: return "portable";
    case KernelKind::kAvx512: return "avx512";
    case KernelKind::kAvx512Bf16: return "avx512bf16";
    case KernelKind::kVnni: return "vnni";
    case KernelKind::kAmx: return "amx";
  }
  return "?";
}

absl::StatusOr<KernelKind> ParseKernel(const std::string& name) {
  for (KernelKind k : {KernelKind::kPortable, KernelKind::kAvx512, KernelKind::kAvx512Bf16, KernelKind::kVnni,
                       KernelKind::kAmx}) {
    if (name == KernelName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("expert kernel '", name, "' is not one of portable, avx512, avx512bf16, vnni, amx"));
}

const std::vector<KernelEntry>& KernelTable() {
  using F = ExpertFormat;
  using K = KernelKind;
  static const std::vector<KernelEntry> table = [] {
    std::vector<KernelEntry> t = {
      {K::kPortable, F::kBF16, internal::MatmulPortable, nullptr},
      {K::kAvx512, F::kBF16, internal::MatmulAvx512Bf16F32, nullptr},
      {K::kAvx512Bf16, F::kBF16, internal::MatmulAvx512Bf16Dp, nullptr},
      {K::kAmx, F::kBF16, internal::MatmulAmxBf16, nullptr},
      {K::kPortable, F::kInt8, internal::MatmulPortable, nullptr},
      {K::kVnni, F::kInt8, internal::MatmulVnniInt8, nullptr},
      {K::kAmx, F::kInt8, internal::MatmulAmxInt8, internal::SwiGluAmxInt8},
      {K::kPortable, F::kInt4, internal::MatmulPortable, nullptr},
      {K::kVnni, F::kInt4, internal::MatmulVnniInt4, nullptr},
      {K::kAmx, F::kInt4, internal::MatmulAmxInt4, internal::SwiGluAmxInt4},
    };
    t.push_back({K::kPortable, F::kFp8, internal::MatmulFp8Portable, nullptr});
    t.push_back({K::kAvx512Bf16, F::kFp8, internal::MatmulFp8Avx512Bf16, nullptr});
    for (const FormatDescriptor& d : PackedFormats()) {
      if (!IsGgufFormat(d.format)) continue;
      t.push_back({K::kPortable, d.format, internal::MatmulGgufPortable, nullptr});
      t.push_back({K::kVnni, d.format, internal::MatmulGgufVnni, nullptr});
    }
    return t;
  }();
  return table;
}

namespace {

const KernelEntry* FindKernel(KernelKind kind, ExpertFormat format) {
  for (const KernelEntry& e : KernelTable()) {
    if (e.kind == kind && e.format == format) return &e;
  }
  return nullptr;
}

}  // namespace

std::vector<KernelKind> KernelsFor(ExpertFormat format) {
  std::vector<KernelKind> kinds;
  for (const KernelEntry& e : KernelTable()) {
    if (e.format == format) kinds.push_back(e.kind);
  }
  return kinds;
}

std::string KernelUnsupportedReason(KernelKind kind, ExpertFormat format, const core::CpuFeatures& cpu) {
  const auto& list = KernelsFor(format);
  if (std::find(list.begin(), list.end(), kind) == list.end()) {
    return absl::StrCat("no ", KernelName(kind), " kernel for ", FormatName(format));
  }
  const bool avx512 = cpu.avx512f && cpu.avx512bw && cpu.avx512vl;
  switch (kind) {
    case KernelKind::kPortable: return "";
    case KernelKind::kAvx512: return avx512 ? "" : "needs AVX-512 (F, BW, VL)";
    case KernelKind::kAvx512Bf16:
      if (format == ExpertFormat::kFp8 && !cpu.avx512_vbmi) return "needs AVX-512 VBMI";
      return avx512 && cpu.avx512_bf16 ? "" : "needs AVX-512 BF16";
    case KernelKind::kVnni: return avx512 && cpu.avx512_vnni ? "" : "needs AVX-512 VNNI";
    case KernelKind::kAmx:
      if (!cpu.amx_tile) return "needs AMX tiles";
      if (Describe(format).bits == 16 && !cpu.amx_bf16) return "needs AMX-BF16";
      if (Describe(format).bits != 16 && !cpu.amx_int8) return "needs AMX-INT8";
      return internal::EnableAmxForProcess() ? "" : "the OS refused AMX tile data (arch_prctl)";
  }
  return "unknown kernel";
}

MatmulKernel GetKernel(KernelKind kind, ExpertFormat format) {
  const KernelEntry* e = FindKernel(kind, format);
  return e != nullptr ? e->matmul : nullptr;
}

SwiGluKernel GetSwiGluKernel(KernelKind kind, ExpertFormat format) {
  const KernelEntry* e = FindKernel(kind, format);
  return e != nullptr ? e->swiglu : nullptr;
}

absl::Status PrepareThreadForKernel(KernelKind kind) {
  if (kind != KernelKind::kAmx) return absl::OkStatus();
  if (!internal::EnableAmxForProcess()) {
    return absl::FailedPreconditionError("the OS refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)");
  }
  internal::ConfigureAmxTiles();
  return absl::OkStatus();
}

}  // namespace moe::experts
