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

std::vector<KernelKind> KernelsFor(ExpertFormat format) {
  if (format == ExpertFormat::kBF16) {
    return {KernelKind::kPortable, KernelKind::kAvx512, KernelKind::kAvx512Bf16, KernelKind::kAmx};
  }
  if (format == ExpertFormat::kInt8) return {KernelKind::kPortable, KernelKind::kVnni, KernelKind::kAmx};
  return {KernelKind::kPortable, KernelKind::kVnni, KernelKind::kAmx};
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
    case KernelKind::kAvx512Bf16: return avx512 && cpu.avx512_bf16 ? "" : "needs AVX-512 BF16";
    case KernelKind::kVnni: return avx512 && cpu.avx512_vnni ? "" : "needs AVX-512 VNNI";
    case KernelKind::kAmx:
      if (!cpu.amx_tile) return "needs AMX tiles";
      if (format == ExpertFormat::kBF16 && !cpu.amx_bf16) return "needs AMX-BF16";
      if (format != ExpertFormat::kBF16 && !cpu.amx_int8) return "needs AMX-INT8";
      return internal::EnableAmxForProcess() ? "" : "the OS refused AMX tile data (arch_prctl)";
  }
  return "unknown kernel";
}

MatmulKernel GetKernel(KernelKind kind, ExpertFormat format) {
  switch (kind) {
    case KernelKind::kPortable: return internal::MatmulPortable;
    case KernelKind::kAvx512: return format == ExpertFormat::kBF16 ? internal::MatmulAvx512Bf16F32 : nullptr;
    case KernelKind::kAvx512Bf16: return format == ExpertFormat::kBF16 ? internal::MatmulAvx512Bf16Dp : nullptr;
    case KernelKind::kVnni:
      if (format == ExpertFormat::kInt8) return internal::MatmulVnniInt8;
      if (format == ExpertFormat::kInt4) return internal::MatmulVnniInt4;
      return nullptr;
    case KernelKind::kAmx:
      if (format == ExpertFormat::kBF16) return internal::MatmulAmxBf16;
      if (format == ExpertFormat::kInt8) return internal::MatmulAmxInt8;
      if (format == ExpertFormat::kInt4) return internal::MatmulAmxInt4;
      return nullptr;
  }
  return nullptr;
}

SwiGluKernel GetSwiGluKernel(KernelKind kind, ExpertFormat format) {
  if (kind != KernelKind::kAmx) return nullptr;
  if (format == ExpertFormat::kInt8) return internal::SwiGluAmxInt8;
  if (format == ExpertFormat::kInt4) return internal::SwiGluAmxInt4;
  return nullptr;
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
